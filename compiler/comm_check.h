/* comm_check.h - proves, before any worker runs, that the communication of
 * every rank's program fits together.
 *
 * Each rank's program is reduced to its communication: an ordered list of
 * events (collectives on named groups, sends and receives).  The check
 * simulates all ranks at once: a collective completes when every member of
 * its group has reached it, and then every member must issue the same kind,
 * count, dtype and root (the groups' sequences agree); a send completes with
 * the receive its peer posts for it, in order per pair, and both must move
 * the same count and dtype.  Point-to-point events posted together (the
 * same `batch` number, e.g. 1F1B's send-activation/receive-gradient pair)
 * complete together once each has its partner, as with batched isend/irecv;
 * a detached send (batch MR_CEV_DETACHED, started and waited on only at
 * the end) never blocks: the peer's receives match such sends in the order
 * they were issued, and one never received is an error; everything else
 * blocks in program order.  The first mismatch, or the
 * state in which no rank can move (a deadlock), is reported naming the
 * ranks, the group, the operation's ordinal on the group and the
 * instructions involved. */
#ifndef MR_COMM_CHECK_H
#define MR_COMM_CHECK_H

#include <stddef.h>
#include <stdint.h>

#include "common/dtype.h"

enum mr_comm_event_kind {
  MR_CEV_ALL_REDUCE,
  MR_CEV_REDUCE_SCATTER,
  MR_CEV_ALL_GATHER,
  MR_CEV_BROADCAST,
  MR_CEV_ALL_TO_ALL,
  MR_CEV_BARRIER,
  MR_CEV_SEND,
  MR_CEV_RECV,
};

struct mr_comm_event {
  enum mr_comm_event_kind kind;
  const char *group;            // group name, identical on every member
  const int *ranks;             // [n_ranks] global ranks of the group
  int n_ranks;
  int peer;                     // SEND / RECV: the peer's global rank
  int64_t count;                // elements (per rank, as the comm API takes)
  enum mr_dtype dtype;
  int root;                     // BROADCAST: group rank of the root
  int batch;                    // p2p posted together: same number >= 0; -1 alone;
                                // MR_CEV_DETACHED: a send the program does
                                // not wait for (matched later, in order)
  int id;                       // the instruction's id in the rank's program
  const char *what;             // what it moves, e.g. "layer 3 attention out"
};

#define MR_CEV_DETACHED (-2)

struct mr_comm_trace {
  const struct mr_comm_event *ev; // borrowed, [n] in program order
  int n;
};

/* Name of an event kind ("AllReduce", "Send", ...). */
const char *mr_comm_event_kind_name(enum mr_comm_event_kind k);

/* Checks the traces of ranks 0..world-1 (trace[r] is rank r's, borrowed).
 * Returns 0 when every collective and send/receive matches and all ranks
 * reach their ends; otherwise MR_EPLAN with mr_error_message() naming the
 * first mismatch or every waiting rank of a deadlock, or MR_ENOMEM. */
int mr_comm_check(const struct mr_comm_trace *trace, int world);

#endif
