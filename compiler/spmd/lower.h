/* lower.h - from a job and its strategy to the distributed training graph
 * every rank shares, and from that to one rank's program.
 *
 * Lowering is deterministic and pure (no I/O, no clocks), so each worker
 * lowers its own program from the job text the coordinator sends, the
 * launcher lowers every rank's to check before launch that their
 * communication fits together, and `meshrun plan --rank R --dump` prints
 * exactly what rank R will run.
 *
 * The shared part (struct mr_lowered):
 *  1. the model graph for one micro-batch of the whole data-parallel group
 *     (compiler/model.h), differentiated (compiler/autodiff.h);
 *  2. recomputation, as a graph pass: full recomputation repeats the
 *     forward ops of every group of `recompute_every` layers just before
 *     the group's backward, selective repeats each layer's attention core;
 *     the backward ops of the group then read the repeated tensors, so the
 *     forward ones die at the end of the forward pass;
 *  3. pipeline chunks: layers are split over pp x vp chunks, balanced by
 *     their FLOPs (compiler/planner/partition.h; the embedding runs on the
 *     first chunk, the final norm, head and loss on the last); chunk c
 *     lives on pipeline stage c % pp (Megatron's interleaving); a backward
 *     op lives with the forward op it differentiates;
 *  4. completion on one stage's mesh (data x model, compiler/spmd/
 *     completion.h): every tensor's DistAttr and every reshard edge.  Every
 *     stage has the same mesh shape, so a tensor crossing a stage boundary
 *     travels coordinate to coordinate as its local shard.
 *
 * The rank program (struct mr_rank_program) is the schedule of passes —
 * (chunk, micro-batch, forward | backward) in GPipe, 1F1B or interleaved
 * 1F1B order — expanded into numbered instructions, with every buffer
 * planned up front: parameters and gradient accumulators (persistent), the
 * tensors a forward pass keeps for its backward (one slot per micro-batch
 * in flight on that chunk), and one arena for everything else, placed
 * first-fit per pass.  So the rank's peak memory is known before it runs.
 *
 * Gradients: each micro-batch's gradient of a parameter is added to its
 * accumulator as soon as the op producing it has run; on the last
 * micro-batch the accumulated mean starts its synchronisation at once
 * (AllReduce over data, asynchronous, overlapping the rest of the
 * backward).  Under ZeRO-2/3 every micro-batch's gradient is
 * reduce-scattered instead, so a rank keeps only its block (a data rank
 * with fewer micro-batches than another joins the rest of its
 * reduce-scatters, and gathers, in phantom slots: no data, zeros); under
 * ZeRO-3 parameters are kept as blocks too and all-gathered just before each pass
 * that reads them.  The optimizer updates each rank's block (ZeRO >= 1)
 * and all-gathers the updated parameters (ZeRO-1/2). */
#ifndef MR_SPMD_LOWER_H
#define MR_SPMD_LOWER_H

#include <stdint.h>
#include <stdio.h>

#include "compiler/comm_check.h"
#include "common/job.h"
#include "compiler/model.h"
#include "compiler/spmd/completion.h"

enum mr_rc_kind { MR_RC_NONE = 0, MR_RC_SELECTIVE = 1, MR_RC_FULL = 2 };

/* The strategy as the runtime executes it. */
struct mr_layout {
  int world;
  int dp, tp, pp, vp;             // degrees; vp: model chunks per pipeline stage
  enum mr_mesh_mapping mapping;   // tp,dp,pp: rank = (p * dp + d) * tp + t;
                                  // tp,pp,dp: rank = (d * pp + p) * tp + t
  int n_micro;                    // micro-batches per optimizer step
  int64_t micro_seqs;             // sequences per micro-batch, whole data group
  enum mr_pp_schedule schedule;
  int sp, zero, offload;
  int recompute;                  // enum mr_rc_kind
  int recompute_every;            // full: layers per recomputed group
  enum mr_amp_dtype amp;
  int accum_in_op;                // gradients add up in the op producing
                                  // them, not in a buffer each (the job's
                                  // gradient_accumulation_in_op, default 1)
};

/* Reads the layout of job (its strategy as chosen, degrees fixed) for world
 * ranks: unset degrees are 1, micro-batches = pipeline micro-batches x
 * gradient accumulation steps.  Returns 0 or MR_EINVAL naming the field
 * (degrees that do not multiply to world, a batch that does not split). */
int mr_layout_from_job(const struct mr_job *job, int world, struct mr_layout *lay);

/* Writes "dp2 x tp2 x pp2 (1f1b, 4 micro-batches), ZeRO-1, ..." into buf. */
void mr_layout_format(const struct mr_layout *lay, char *buf, size_t n);

struct mr_lowered {
  struct mr_layout lay;
  struct mr_model model;          // one micro-batch, forward + backward
  int seed;                       // the loss gradient input tensor
  int n_chunks;                   // pp * vp
  int *op_chunk;                  // [n_ops]
  int *op_layer;                  // [n_ops] -1: embedding, layers: head
  int *chunk_first_layer;         // [n_chunks + 1] layers of chunk c:
                                  //   [first[c], first[c + 1])
  double layer_flops;             // forward FLOPs of one layer, of what the
  double first_flops, last_flops; //   first chunk adds (embedding) and the
                                  //   last (final norm, head, loss)
  struct mr_mesh mesh;            // one stage: data x model (dims > 1)
  int data_dim, model_dim;        // in mesh, -1 when absent
  struct mr_dist_graph dg;
  int n_local;                    // local tensor ids: graph tensors, then
                                  // one per reshard edge (n_tensors + e)
  int *edge_at;                   // [n_edges] op it runs before, -1: none
  int *dp_micro;                  // [dp] micro-batches each data-parallel
                                  // rank runs a step (strategy.data_parallel.
                                  // micro_batches); NULL: lay.n_micro each
};

/* Builds everything ranks share for job on world ranks into L
 * (caller-allocated; free with mr_lowered_close).  Returns 0, MR_EINVAL or
 * MR_ENOTSUP with a message naming what cannot be lowered, or MR_ENOMEM. */
int mr_lower_graph(const struct mr_job *job, int world, struct mr_lowered *L);

/* The same with the loss in the given form (enum mr_loss_form, common/
 * model.h); mr_lower_graph starts fused and switches to the vocabulary-
 * parallel form when completion splits the logits by vocabulary. */
int mr_lower_graph_form(const struct mr_job *job, int world, int form, struct mr_lowered *L);

void mr_lowered_close(struct mr_lowered *L);

/* The layout as mr_layout_format writes it, then the micro-batches of each
 * data-parallel rank when they are set: "... (by data rank: 6,2)". */
void mr_lowered_format(const struct mr_lowered *L, char *buf, size_t n);

/* The edge making the loss whole (partial to replicated), or -1. */
int mr_lowered_loss_edge(const struct mr_lowered *L);
/* Whether the loss is made whole once a step rather than each micro-batch:
 * its edge's steps are linear (all-reduces, scalings), so they run once on
 * the sum of the step's partial losses at its end (one small collective a
 * step instead of one a micro-batch, which would also pace the data ranks
 * micro-batch by micro-batch). */
int mr_lowered_loss_deferred(const struct mr_lowered *L);

/* Rank of mesh coordinates (pipe, data, model) and back. */
int mr_lower_rank(const struct mr_layout *lay, int pipe, int data, int model);
void mr_lower_coords(const struct mr_layout *lay, int rank, int *pipe, int *data,
                     int *model);

enum mr_ins_kind {
  MR_INS_RECV,       // tensor from rank `peer` (a pipeline boundary)
  MR_INS_LOAD,       // the micro-batch's token inputs this chunk reads
  MR_INS_SEED,       // the loss gradient: the loss scale
  MR_INS_GATHER,     // ZeRO-3: all-gather parameter `tensor` over data
  MR_INS_RESHARD,    // reshard edge `edge` into local tensor n_tensors + edge
  MR_INS_KERNEL,     // graph op `op` on local shards
  MR_INS_LOSS,       // adds the (replicated) loss to the step's sum
  MR_INS_GRAD,       // this micro-batch's gradient of parameter `tensor` is
                     // done; `edge` its synchronisation edge, -1: none
  MR_INS_GRAD_WAIT,  // ZeRO >= 2: the pass's reduce-scatters are done
  MR_INS_SEND,       // starts sending `tensor` to rank `peer` (detached)
  MR_INS_SYNC_WAIT,  // every gradient synchronisation and send is done
  MR_INS_OPTIMIZER,  // global norm, clipping, AdamW, ZeRO all-gathers
  MR_INS_PARAM_SYNC, // tied parameters: the owner's update to the other stages
  MR_INS_STEP_END,   // the loss to every stage; checkpoint agreement
  MR_INS_KIND_COUNT
};

struct mr_ins {
  enum mr_ins_kind kind;
  int pass;          // index into the program's passes, -1: none
  int micro, slot;   // micro-batch and its stash slot
  int op, edge, tensor, peer;
  int ev, n_ev;      // its communication events (program's ev[])
};

/* A pass template: the instructions of (chunk, forward | backward) for
 * any micro-batch, with where its arena tensors lie. */
struct mr_pass {
  int chunk;
  int backward;
  int first, n;      // its instructions in the program's tmpl[]
  int64_t *arena_off; // [n_local] byte offset in the arena, -1: not here
  int64_t send_base;  // its send buffers: micro-batch m's at send_base +
  int64_t send_bytes; //   m * send_bytes in the send region
};

enum mr_region {
  MR_REG_NONE = 0,   // not on this rank
  MR_REG_PARAM,      // persistent (a parameter; under ZeRO-3 its block)
  MR_REG_STASH,      // per micro-batch slot of its chunk
  MR_REG_ARENA,      // per pass (offset in the pass's arena_off)
  MR_REG_ACC,        // a gradient written straight into its accumulator
};

struct mr_lbuf {
  int ndim;
  int64_t shape[MR_MAX_DIMS];     // local
  int64_t numel;                  // local elements
  int64_t bytes;                  // reserved (64-byte multiple; ZeRO padding)
  enum mr_region region;
  int chunk;                      // STASH: whose slots
  int64_t offset;                 // PARAM, STASH: bytes into the region / slot
};

/* A parameter held by this rank. */
struct mr_param_plan {
  int tensor;                     // graph id
  int chunk;
  int64_t numel;                  // local elements
  int64_t block;                  // ZeRO: ceil(numel / dp); else numel
  int64_t begin, len;             // this rank's part of the flattened local
                                  // tensor: its block (ZeRO) or all
  int64_t goff[MR_MAX_DIMS];      // the local tensor within the global one
  int64_t glen[MR_MAX_DIMS];
  int norm;                       // 1: its elements [begin, +len) count in
                                  // the global gradient norm here
  int64_t store_offset;           // bytes into the parameter region of what
                                  // this rank stores: the local tensor, or
                                  // its block under ZeRO-3
  int64_t acc_offset;             // bytes into the accumulator region
  int64_t zero_tmp_offset;        // ZeRO-2/3: bytes into the landing region
                                  // of its reduce-scatter block
  int64_t acc_floats;             // numel, or block under ZeRO >= 2
  int64_t state_offset;           // bytes into the optimizer region (m; v
                                  // mr_param_moment_stride bytes after)
  int sync_ev;                    // first event of its synchronisation
  int replica_of;                 // a copy of a parameter another stage owns
                                  // (tied embeddings): the owner's rank, whose
                                  // update arrives after each step; -1: owned
  int *replicas;                  // owned: ranks holding copies (n_replicas)
  int n_replicas;
  int off_data;                   // its synchronisation has steps off the data
                                  // dim (run per micro-batch into the
                                  // gradient staging buffer)
};

/* Elements a tied parameter's owner sends each copy after the update: the
 * whole parameter, or under ZeRO-3 the block each side stores. */
static inline int64_t mr_param_sync_count(const struct mr_layout *lay,
                                          const struct mr_param_plan *pp) {
  return lay->zero >= 3 ? pp->block : pp->numel;
}

/* Bytes from a parameter's first moment m to its second v in the
 * optimizer region (m's len floats rounded up to 64 bytes). */
static inline int64_t mr_param_moment_stride(const struct mr_param_plan *pp) {
  return (pp->len * 4 + 63) / 64 * 64;
}

struct mr_group_desc {
  char name[64];                  // "data{0,2}" (cut short with "." past 64)
  int *ranks;                     // [n] global ranks in group order; owned
  int n;
};

struct mr_rank_program {
  const struct mr_lowered *L;     // borrowed
  int rank, pipe, data, model;    // coordinates
  int coord[MR_MESH_MAX_DIMS];    // in L->mesh
  int n_micro;                    // micro-batches this rank runs a step
  int n_slots;                    // micro-batch slots of its schedule: n_micro,
                                  // but under ZeRO-2/3 with micro-batches set
                                  // per data rank the busiest one's; the slots
                                  // past n_micro are phantoms, which run only
                                  // the data-parallel collectives every rank
                                  // of the group must join: ZeRO-3's gathers
                                  // and reduce-scatters of zeros, left in
                                  // flight (each slot's land apart, summed at
                                  // sync_wait).  Under ZeRO-2 without a
                                  // pipeline they come first, so a slow rank
                                  // posts them and goes on to its own work
  int first_slice;                // the first of them: the step's batch is
                                  // dp * lay.n_micro slices of micro_seqs /
                                  // dp sequences, read by data rank in order
                                  // (L->dp_micro set; else micro m of data
                                  // rank d reads slice m * dp + d)
  struct mr_group_desc pipe_group, data_group, model_group;
  struct mr_lbuf *buf;            // [L->n_local]
  struct mr_param_plan *params;
  int n_params;
  int *param_of;                  // [n_tensors] index in params or -1
  struct mr_graph local;          // local shapes and localized op attributes
                                  // (tensors [n_local], ops [n_ops]); owned
  int *stash_slots;               // [n_chunks] micro-batches in flight
  int64_t *stash_bytes;           // [n_chunks] one slot
  int64_t param_bytes, acc_bytes, optim_bytes, arena_bytes, send_bytes;
  int64_t zero_tmp_bytes;         // ZeRO-2/3: reduce-scatter landing blocks
                                  // (one per parameter: zero_landing_bytes),
                                  // one more set per phantom slot and, with
                                  // phantoms, the zeros they reduce-scatter
                                  // (the largest padded gradient); ZeRO-1:
                                  // the largest block (what an all-gather
                                  // sends)
  int64_t zero_landing_bytes;     // ZeRO-2/3: one set of landing blocks
  int64_t scratch_bytes;          // reshard staging (three buffers of this)
  int64_t grad_stage_bytes;       // a gradient brought to its parameter's
                                  // shard (padded to dp blocks under ZeRO)
  struct mr_pass *passes;         // templates: per chunk of this rank, F and B
  int n_passes;
  struct mr_ins *tmpl;            // the templates' instructions
  int n_tmpl;
  struct mr_ins *step;            // one optimizer step, expanded
  int n_step;
  int *eval_passes;               // an evaluation batch: forward passes, in
  int *eval_micro;                //   order (micro-batch outer), n_eval
  int n_eval;
  struct mr_comm_event *ev;       // communication of a step then of an
  int n_ev;                       //   evaluation batch
  int n_ev_step;
  char **ev_what;                 // [n_ev] owned descriptions
  int64_t *send_off;              // [n_local] offset of a tensor sent by its
                                  // pass within one of the pass's send
                                  // buffers, -1: never sent
};

/* Builds rank `rank`'s program from L (borrowed; must outlive p) into p
 * (caller-allocated).  Returns 0, MR_ENOTSUP naming what the runtime cannot
 * execute, or MR_ENOMEM. */
int mr_rank_program_build(const struct mr_lowered *L, int rank,
                          struct mr_rank_program *p);

void mr_rank_program_close(struct mr_rank_program *p);

/* Bytes this rank holds at its peak: every region above (offloaded
 * optimizer state excluded when lay.offload). */
int64_t mr_rank_program_peak_bytes(const struct mr_rank_program *p);

/* The step's (eval 0) or an evaluation batch's (eval 1) communication, as
 * the checker takes it (borrowing p). */
struct mr_comm_trace mr_rank_program_trace(const struct mr_rank_program *p, int eval);

/* Lowers every rank of world and checks that their communication fits
 * together for a step and for an evaluation batch; with digests ([world])
 * not NULL, each rank's program digest goes there.  Returns 0, MR_EPLAN
 * naming the first mismatch, or a lowering error. */
int mr_lower_check_all(const struct mr_job *job, int world, uint64_t *digests);

/* A 64-bit digest (XXH3) of what p executes: its step's instructions, its
 * communication, its regions and its parameters' places.  The launcher
 * sends each rank the digest of the program it checked; a worker that
 * lowers a different one from the same plan stops (never 0). */
uint64_t mr_rank_program_digest(const struct mr_rank_program *p);

/* "kernel", "reshard", ... */
const char *mr_ins_kind_name(enum mr_ins_kind k);

/* p as text: the layout, buffers, passes and the step's instructions.
 * Returns a malloc'd string (the caller frees it), or NULL when out of
 * memory. */
char *mr_rank_program_format(const struct mr_rank_program *p);

/* One line describing instruction i of the step ("12 F c0 m1 kernel
 * L0.q"), for hang diagnosis. */
void mr_ins_describe(const struct mr_rank_program *p, const struct mr_ins *in, char *buf,
                     size_t n);

#endif
