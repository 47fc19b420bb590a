/* program.h - a rank's program: the numbered instructions one rank runs for
 * a training step, lowered deterministically from the job and its strategy,
 * so the launcher can show any rank's program (`meshrun plan --rank R
 * --dump`) and prove before launch that every rank's communication fits
 * together (common/comm_check.h) — the workers derive the same sequence
 * from the same job text.
 *
 * This lowering covers the data-parallel family the engine executes in
 * worker/train.c: dp replicas, ZeRO-1, gradient accumulation.  One step:
 * for each micro-batch, load its rows and run the forward kernels; every
 * micro-batch but the last runs its backward locally (gradients
 * accumulated); the last starts each parameter gradient's AllReduce right
 * after the kernel that finishes it, then waits for them all; the loss is
 * averaged; the optimizer updates (under ZeRO-1 each rank its block of
 * every parameter, then the blocks are all-gathered, parameter by
 * parameter); a step at the evaluation interval then runs, per evaluation
 * batch, the forward kernels of each micro-batch and one AllReduce of the
 * batch loss; finally the ranks agree on whether to checkpoint. */
#ifndef MR_PROGRAM_H
#define MR_PROGRAM_H

#include <stdio.h>

#include "common/comm_check.h"
#include "common/job.h"
#include "common/model.h"

enum mr_instr_kind {
  MR_INSTR_LOAD_BATCH,   // reads this rank's rows of micro-batch `micro`
  MR_INSTR_KERNEL,       // runs graph op `op`
  MR_INSTR_COMM_START,   // starts comm event `comm`
  MR_INSTR_COMM_WAIT,    // waits for comm event `comm`
  MR_INSTR_ACCUMULATE,   // adds this micro-batch's gradients to the sums
  MR_INSTR_OPTIMIZER,    // clips and applies AdamW to this rank's elements
  MR_INSTR_STEP_END,     // reports metrics, maybe checkpoints
};

struct mr_instr {
  enum mr_instr_kind kind;
  int micro;                    // LOAD_BATCH, KERNEL: micro-batch
  int op;                       // KERNEL: op id in the graph
  int comm;                     // COMM_*: index into the program's events
  int eval;                     // 1: only on steps that evaluate
};

struct mr_rank_program {
  int rank, world;
  int dp, dp_rank, accum, zero_stage;
  int eval_batches;             // per evaluation; 0: the job never evaluates
  int64_t micro_rows;           // rows of one micro-batch on this rank
  struct mr_model model;        // this rank's graph (owned)
  struct mr_instr *ins;         // [n_ins] in execution order
  int n_ins;
  struct mr_comm_event *ev;     // [n_ev] in start order, evaluation included
  int n_ev;
  struct mr_comm_event *ev_plain; // [n_ev_plain] those of a step without
  int n_ev_plain;                 // evaluation
  int *group_ranks;             // [dp] the data-parallel group's ranks
  char group[4096];             // its name, "data{0,1,...}"
  char **what;                  // [n_ev] descriptions (owned)
};

/* Lowers rank `rank` of `world` for job (borrowed; its strategy as chosen,
 * e.g. after mr_strategy_apply) into p (caller-allocated).  Returns 0,
 * MR_EINVAL (the world does not divide into the strategy, with a message
 * naming the fields), MR_ENOTSUP (a strategy this lowering does not cover)
 * or MR_ENOMEM. */
int mr_program_lower(const struct mr_job *job, int world, int rank,
                     struct mr_rank_program *p);

void mr_program_close(struct mr_rank_program *p);

/* p's communication for a step, as the checker takes it (borrowing p):
 * with eval, a step that also evaluates. */
struct mr_comm_trace mr_program_trace(const struct mr_rank_program *p, int eval);

/* Lowers every rank of world and checks that their communication fits
 * together, for a training step and an evaluation step.  Returns 0,
 * MR_EPLAN naming the first mismatch, or a lowering error. */
int mr_program_check_all(const struct mr_job *job, int world);

/* Prints p, one numbered instruction per line. */
void mr_program_dump(const struct mr_rank_program *p, FILE *f);

#endif
