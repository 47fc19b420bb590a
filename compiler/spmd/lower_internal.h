/* lower_internal.h - what the lowering's files share (compiler/spmd/
 * lower_program.c builds a rank's program, lower_memory.c plans its
 * buffers, lower_events.c lists the communication of its instructions,
 * lower_dump.c prints and checks programs). */
#ifndef MR_SPMD_LOWER_INTERNAL_H
#define MR_SPMD_LOWER_INTERNAL_H

#include "compiler/spmd/lower.h"

struct build {
  struct mr_rank_program *p;
  const struct mr_lowered *L;
  const struct mr_graph *g;
  int cap_tmpl, cap_step, cap_ev;
  int rc;
  int *prod_chunk, *prod_dir;     // [n_local] where written, -1: input/param
  int *my_chunk;                  // [n_chunks] 1: on this rank
};

/* Input i of op k as the local graph has it (reshard edges substituted). */
int mr__lower_nth_in(const struct build *b, int k, int i);

/* The group of mesh dim md of the lowered graph's stage mesh. */
const struct mr_group_desc *mr__lower_dim_group(const struct mr_rank_program *p, int md);

/* The grad-sync edge of parameter t, or -1. */
int mr__lower_sync_edge(const struct mr_lowered *L, int t);
/* Micro-batches set per data rank: the loss made whole once a step or an
 * evaluation batch, on the stage holding it (events of in). */
void mr__lower_loss_events(struct build *b, struct mr_ins *in);

/* Classifies every tensor of b's passes (parameter, kept per micro-batch
 * slot, arena) and places them; fills the program's region sizes.
 * Returns 0 or an error. */
int mr__lower_plan_buffers(struct build *b);

/* Elements a collective step moves as the comm API counts them (an
 * AllGather: all ranks' together); *staging grows to what it needs. */
int64_t mr__lower_step_count(const struct mr_lowered *L, const int *coord, int t,
                             const struct mr_dist_attr *before,
                             const struct mr_reshard_step *s, int64_t *staging);

/* Appends the communication events of instruction in (expanded, with its
 * micro-batch) to the program; *staging grows to the reshard staging it
 * needs. */
void mr__lower_events_of(struct build *b, struct mr_ins *in, int64_t *staging);

/* Appends one event on group gd (batch: -1, or MR_CEV_DETACHED for a send
 * the program does not wait for) and counts it as instruction in's (may be
 * NULL); returns its index or -1 after a failure (b->rc). */
int mr__lower_add_event(struct build *b, struct mr_ins *in, enum mr_comm_event_kind kind,
                        const struct mr_group_desc *gd, int peer, int64_t count,
                        enum mr_dtype dt, int root, int batch, const char *what);

#endif
