/* slurm.h - a launch inside a Slurm job step.
 *
 * `srun --ntasks-per-node=1 meshrun launch job.json` runs one launcher on
 * every node of the step; each reads from the step's environment what the
 * flags would say: the node count (SLURM_STEP_NUM_NODES), its own index
 * (SLURM_NODEID), node 0's host (the first of SLURM_STEP_NODELIST) and a
 * port and token file of the job's own (SLURM_JOB_ID).  A flag given on the
 * command line wins over what the step says. */
#ifndef MR_SLURM_H
#define MR_SLURM_H

#include <stddef.h>

#define MR_SLURM_PORT_BASE 20000 // node 0 listens on BASE + job id % SPAN
#define MR_SLURM_PORT_SPAN 20000

struct mr_slurm_step {
  int in_step;            // inside an srun step (SLURM_STEP_ID set)
  int in_job_nodes;       // outside one: the job's node count (0: not a job)
  long job_id;
  long nnodes, node_rank; // the step's nodes and this one's index
  char master[300];       // "HOST:PORT" of node 0
  char token_file[4096];  // $HOME/.cache/meshrun/slurm-JOB.token ("" without HOME)
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

#endif
