/* slurm.h - a launch inside a Slurm job step.
 *
 * `srun --ntasks-per-node=1 meshrun launch job.json` runs one launcher on
 * every node of the step; each reads from the step's environment what the
 * flags would say: the node count (SLURM_STEP_NUM_NODES), its own index
 * (SLURM_NODEID), node 0's host (the first of SLURM_STEP_NODELIST), the
 * CPUs and GPUs the allocation gave this node (the default --nproc), and a
 * port and token file of the step's own (SLURM_JOB_ID, SLURM_STEP_ID).  A
 * flag given on the command line wins over what the step says. */
#ifndef MR_SLURM_H
#define MR_SLURM_H

#include <stddef.h>

#define MR_SLURM_PORT_BASE 20000 // node 0 listens on BASE + job id % SPAN
#define MR_SLURM_PORT_SPAN 20000

struct mr_slurm_step {
  int in_step;            // inside an srun step (SLURM_STEP_ID set)
  int in_job_nodes;       // outside one: the job's node count (0: not a job)
  long job_id, step_id;   // step_id -1 outside a step
  long nnodes, node_rank; // the step's nodes and this one's index
  long cpus;              // CPUs the allocation gives this launcher (0: unsaid)
  const char *cpus_var;   //   the variable that said so
  long gpus;              // GPUs it gives this node (-1: unsaid)
  const char *gpus_var;   //   the variable that said so
  char host[256];         // node 0's host: the first of...
  char host_from[300];    //   ...this: `SLURM_STEP_NODELIST "n[1-2]"`
  char master[300];       // "HOST:PORT" of node 0
  char token_file[4096];  // $HOME/.cache/meshrun/slurm-[CLUSTER-]JOB.STEP.token
                          //   ("" without HOME or outside a step)
};

/* Reads the Slurm job step from the environment into out.  Returns 0 (with
 * in_step 0 outside a step), or MR_EINVAL naming the variable and what was
 * expected: a step of several tasks on a node (meshrun starts the node's
 * ranks itself), a malformed number or host list. */
int mr_slurm_step(struct mr_slurm_step *out);

/* The first host of a Slurm host list into host[n]: "gpu[07-09,12],cpu3"
 * gives "gpu07" (ranges keep their leading zeros).  Returns 0 or MR_EINVAL
 * saying what was expected. */
int mr_slurm_first_host(const char *list, char *host, size_t n);

/* Node `node`'s count in a Slurm per-node list such as
 * SLURM_JOB_CPUS_PER_NODE's "4(x2),2" (nodes 0 and 1 have 4, node 2 has
 * 2) into *out.  Returns 0, or MR_EINVAL saying what was expected
 * (a malformed list, or one of fewer nodes). */
int mr_slurm_per_node(const char *list, long node, long *out);

/* Node 0 of a step: removes the job token files in s's folder that no
 * live job of this cluster owns any longer, and those of this job's
 * earlier steps, so that a launcher killed before it could remove its own
 * leaves nothing that a later job could mistake for its own.  Which jobs
 * live asks `squeue`; where it cannot answer (not on PATH, no controller
 * within a few seconds) only this job's earlier steps go.  Returns the
 * number removed. */
int mr_slurm_clean_tokens(const struct mr_slurm_step *s);

#endif
