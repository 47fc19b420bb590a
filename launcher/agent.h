/* agent.h - `meshrun launch --nnodes N --node-rank K` for K > 0: the
 * launcher of one node of a job that node 0's launcher coordinates
 * (launcher/coordinator.h), as torchrun's agent is on every node.
 *
 * It reads the job token from the token file (waiting for node 0 to write
 * it), connects to node 0's launcher over TCP (retrying until the join
 * timeout), authenticates, and says Hello as node K with its rank count.
 * Welcome gives it the job id and world size.  Then it does what node 0
 * says: START spawns its ranks K*nproc .. (K+1)*nproc - 1 for that group
 * restart (after the previous group's have exited), STOP stops them
 * (SIGTERM, SIGKILL after the stop grace), FINISH carries the job's exit
 * code.  Its workers connect to node 0 themselves; their output is
 * prefixed and logged here as on node 0.  When the connection closes the
 * ranks are stopped, and it exits with the code FINISH gave (1 without
 * one: node 0 was lost).  A first SIGINT/SIGTERM is left to node 0 (a
 * scheduler signals every node; node 0 checkpoints and stops the job); a
 * second kills this node's ranks. */
#ifndef MR_AGENT_H
#define MR_AGENT_H

struct mr_agent_opts {
  int nnodes, node_rank;        // of the job; node_rank > 0
  int nproc;                    // ranks on this node
  const char *master;           // node 0's launcher, "HOST:PORT"
  const char *token_file;       // the job token (node 0 writes it)
  const char *log_dir;          // per-rank logs of this node's ranks
  const char *worker_bin;       // path of meshrun-worker
  int threads;                  // compute threads per rank
  double join_timeout_s;        // how long to wait for node 0
  int token_file_of_step;       // token_file is this step's alone: removed
                                //   when node 0 is gone (it cannot be)
};

/* Runs this node's part of the job.  Returns the process exit code. */
int mr_agent_run(const struct mr_agent_opts *o);

#endif
