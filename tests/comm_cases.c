/* comm_cases.c - every operation x dtype x group size {1,2,3,4,8} x element
 * count {0, 1, 777, 1 Mi + 3 (64 Ki + 3 sanitized)}, plus two groups at
 * once and overlapping asynchronous operations.
 *
 * Counts are whole messages: AllReduce, Broadcast and Send/Recv move count
 * elements; ReduceScatter, AllGather and AllToAll use blocks of
 * ceil(count / n) per rank.  Inputs are drawn from a fixed table of random
 * floats (or integers), so rank k's element i is known to every rank, and
 * each rank recomputes the expected output serially: float32 sums in rank
 * order, bf16/fp16 widened to float32 and rounded once, integers wrapping
 * (int32) or exact (int64), averages truncated for integers. */
#include "comm_cases.h"

#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "comm_harness.h"
#include "common/dtype.h"
#include "common/error.h"
#include "common/tunable.h"

static const char *transport;
static uint64_t btab[MR_DTYPE_COUNT][4096]; /* stored bits of each value */
static float vtab[MR_DTYPE_COUNT][4096];    /* its float value */

static const enum mr_dtype dtypes[] = {MR_F32, MR_BF16, MR_F16, MR_I32,
                                       MR_I64};
/* The largest crosses the shm transport's staging chunk (1 MiB) several
 * times over.  A sanitized build, ten times slower, runs a 64 KiB chunk
 * and a count 16 times smaller: the same crossings, a sixteenth of the
 * work. */
#ifdef __SANITIZE_ADDRESS__
#define BIG_COUNT ((1u << 16) + 3)
#define SHM_CHUNK "65536"
#else
#define BIG_COUNT ((1u << 20) + 3)
#endif
static const size_t counts[] = {0, 1, 777, BIG_COUNT};

static float as_float(enum mr_dtype dt, uint64_t b);

static void make_tables(void) {
  uint64_t x = 0x243f6a8885a308d3ull;
  for (int i = 0; i < 4096; i++) {
    x = x * 6364136223846793005ull + 1442695040888963407ull;
    uint64_t r = x ^ (x >> 29);
    /* varied exponents, so that the order of a sum changes its rounding */
    float f = ((float)(x >> 40) / 16777216.0f - 0.5f) * 8.0f *
              (float)(1u << ((x >> 20) % 9)) / 16.0f;
    uint32_t u;
    memcpy(&u, &f, 4);
    btab[MR_F32][i] = u;
    btab[MR_BF16][i] = mr_f32_to_bf16(f);
    btab[MR_F16][i] = mr_f32_to_f16(f);
    btab[MR_I32][i] = (uint32_t)r;
    /* int64 kept within +-2^40 so sums are exact */
    btab[MR_I64][i] = (uint64_t)((int64_t)(r % (1ull << 41)) - (1ll << 40));
    for (int d = MR_F32; d <= MR_F16; d++)
      vtab[d][i] = as_float((enum mr_dtype)d, btab[d][i]);
  }
}

static size_t tix(int k, size_t i) {
  return (i * 7 + (size_t)k * 131 + (i >> 12) * 3) & 4095;
}

/* Rank k's input element i, as stored bits. */
static uint64_t in_bits(enum mr_dtype dt, int k, size_t i) {
  return btab[dt][tix(k, i)];
}

static float as_float(enum mr_dtype dt, uint64_t b) {
  if (dt == MR_F32) {
    float f;
    uint32_t u = (uint32_t)b;
    memcpy(&f, &u, 4);
    return f;
  }
  return dt == MR_BF16 ? mr_bf16_to_f32((uint16_t)b) : mr_f16_to_f32((uint16_t)b);
}

/* The reduction of element i of every rank's input, as stored bits. */
static uint64_t ref_bits(enum mr_dtype dt, enum mr_red_op op, int n,
                         size_t i) {
  if (dt == MR_I32) {
    uint32_t s = 0;
    int64_t exact = 0;
    int32_t m = (int32_t)(uint32_t)in_bits(dt, 0, i);
    for (int k = 0; k < n; k++) {
      int32_t x = (int32_t)(uint32_t)in_bits(dt, k, i);
      s += (uint32_t)x;
      exact += x;
      m = x > m ? x : m;
    }
    return op == MR_RED_SUM ? s : op == MR_RED_MAX ? (uint32_t)m
                                                   : (uint32_t)(exact / n);
  }
  if (dt == MR_I64) {
    int64_t s = 0, m = (int64_t)in_bits(dt, 0, i);
    for (int k = 0; k < n; k++) {
      int64_t x = (int64_t)in_bits(dt, k, i);
      s += x;
      m = x > m ? x : m;
    }
    return (uint64_t)(op == MR_RED_SUM ? s : op == MR_RED_MAX ? m : s / n);
  }
  float acc = vtab[dt][tix(0, i)];
  for (int k = 1; k < n; k++) {
    float x = vtab[dt][tix(k, i)];
    if (op == MR_RED_MAX)
      acc = (x > acc || x != x) ? x : acc;
    else
      acc += x;
  }
  if (op == MR_RED_AVG)
    acc /= (float)n;
  if (dt == MR_F32) {
    uint32_t u;
    memcpy(&u, &acc, 4);
    return u;
  }
  return dt == MR_BF16 ? mr_f32_to_bf16(acc) : mr_f32_to_f16(acc);
}

static uint64_t get(const void *buf, enum mr_dtype dt, size_t i) {
  size_t es = mr_dtype_size(dt);
  uint64_t v = 0;
  memcpy(&v, (const unsigned char *)buf + i * es, es);
  return v;
}

static void put(void *buf, enum mr_dtype dt, size_t i, uint64_t v) {
  memcpy((unsigned char *)buf + i * mr_dtype_size(dt), &v, mr_dtype_size(dt));
}

/* Fills count elements with rank k's inputs starting at global index from. */
static void fill(void *buf, enum mr_dtype dt, int k, size_t from,
                 size_t count) {
  for (size_t i = 0; i < count; i++)
    put(buf, dt, i, in_bits(dt, k, from + i));
}

static void *alloc(size_t count, enum mr_dtype dt) {
  void *p = malloc(count * mr_dtype_size(dt) + 8);
  memset(p, 0xa5, count * mr_dtype_size(dt) + 8);
  return p;
}

static const char *rname(enum mr_red_op op) {
  return op == MR_RED_SUM ? "sum" : op == MR_RED_AVG ? "avg" : "max";
}

#define FAIL_AT(rc, what, dt, count, i, got, want)                           \
  rank_fail(rc, "%s %s count %zu: element %zu is %#llx, expected %#llx",     \
            what, mr_dtype_name(dt), count, (size_t)(i),                     \
            (unsigned long long)(got), (unsigned long long)(want))

static int run(struct rank_ctx *rc, const char *what, int rc_start,
               struct mr_comm_req **req) {
  if (rc_start != 0) {
    rank_fail(rc, "%s: start failed: %s", what, mr_error_message());
    return -1;
  }
  int r = mr_comm_wait(*req);
  if (r != 0)
    rank_fail(rc, "%s: %s", what, mr_error_message());
  return r;
}

static void check_allreduce(struct rank_ctx *rc, struct mr_comm_group *g,
                            enum mr_dtype dt, size_t count, int in_shm) {
  int n = g->comm->ops->group_size(g), me = g->comm->ops->group_rank(g);
  size_t bytes = count * mr_dtype_size(dt);
  for (enum mr_red_op op = MR_RED_SUM; op <= MR_RED_MAX; op++) {
    void *send, *recv;
    if (in_shm) {
      g->comm->ops->mem_alloc(g, bytes, &send);
      g->comm->ops->mem_alloc(g, bytes, &recv);
    } else {
      send = alloc(count, dt);
      recv = alloc(count, dt);
    }
    fill(send, dt, me, 0, count);
    int in_place = op == MR_RED_AVG;
    void *out = in_place ? send : recv;
    struct mr_comm_req *req;
    char what[64];
    snprintf(what, sizeof what, "AllReduce(%s%s%s)", rname(op),
             in_place ? ", in place" : "", in_shm ? ", shm buffers" : "");
    if (run(rc, what, mr_comm_all_reduce(g, send, out, count, dt, op, &req), &req) == 0)
      for (size_t i = 0; i < count; i++) {
        uint64_t want = ref_bits(dt, op, n, i), got = get(out, dt, i);
        if (got != want) {
          FAIL_AT(rc, what, dt, count, i, got, want);
          break;
        }
      }
    if (in_shm) {
      g->comm->ops->mem_free(g, send);
      g->comm->ops->mem_free(g, recv);
    } else {
      free(send);
      free(recv);
    }
  }
}

static void check_reduce_scatter(struct rank_ctx *rc, struct mr_comm_group *g,
                                 enum mr_dtype dt, size_t count) {
  int n = g->comm->ops->group_size(g), me = g->comm->ops->group_rank(g);
  size_t b = (count + (size_t)n - 1) / (size_t)n;
  for (enum mr_red_op op = MR_RED_SUM; op <= MR_RED_MAX; op++) {
    void *send = alloc(b * (size_t)n, dt), *recv = alloc(b, dt);
    fill(send, dt, me, 0, b * (size_t)n);
    struct mr_comm_req *req;
    char what[64];
    snprintf(what, sizeof what, "ReduceScatter(%s)", rname(op));
    if (run(rc, what, mr_comm_reduce_scatter(g, send, recv, b, dt, op, &req), &req) == 0)
      for (size_t i = 0; i < b; i++) {
        uint64_t want = ref_bits(dt, op, n, (size_t)me * b + i);
        if (get(recv, dt, i) != want) {
          FAIL_AT(rc, what, dt, count, i, get(recv, dt, i), want);
          break;
        }
      }
    free(send);
    free(recv);
  }
}

static void check_all_gather(struct rank_ctx *rc, struct mr_comm_group *g,
                             enum mr_dtype dt, size_t count, int uneven) {
  int n = g->comm->ops->group_size(g), me = g->comm->ops->group_rank(g);
  size_t b = (count + (size_t)n - 1) / (size_t)n, total = 0;
  size_t *cnt = calloc((size_t)n, sizeof *cnt);
  for (int r = 0; r < n; r++) {
    cnt[r] = uneven ? (r == 0 ? 0 : b + (size_t)(r % 3)) : b;
    total += cnt[r];
  }
  void *send = alloc(cnt[me], dt), *recv = alloc(total, dt);
  fill(send, dt, me, 0, cnt[me]);
  struct mr_comm_req *req;
  const char *what = uneven ? "AllGather(uneven)" : "AllGather";
  if (run(rc, what,
          mr_comm_all_gather(g, send, recv, b, uneven ? cnt : NULL, dt, &req), &req) == 0) {
    size_t at = 0;
    for (int r = 0; r < n; r++)
      for (size_t i = 0; i < cnt[r]; i++, at++) {
        uint64_t want = in_bits(dt, r, i);
        if (get(recv, dt, at) != want) {
          FAIL_AT(rc, what, dt, count, at, get(recv, dt, at), want);
          r = n;
          break;
        }
      }
  }
  free(cnt);
  free(send);
  free(recv);
}

static void check_broadcast(struct rank_ctx *rc, struct mr_comm_group *g,
                            enum mr_dtype dt, size_t count) {
  int n = g->comm->ops->group_size(g), me = g->comm->ops->group_rank(g);
  int root = (int)(count % (size_t)n);
  void *buf = alloc(count, dt);
  if (me == root)
    fill(buf, dt, root, 0, count);
  struct mr_comm_req *req;
  if (run(rc, "Broadcast", mr_comm_broadcast(g, buf, count, dt, root, &req), &req) == 0)
    for (size_t i = 0; i < count; i++)
      if (get(buf, dt, i) != in_bits(dt, root, i)) {
        FAIL_AT(rc, "Broadcast", dt, count, i, get(buf, dt, i),
                in_bits(dt, root, i));
        break;
      }
  free(buf);
}

static void check_all_to_all(struct rank_ctx *rc, struct mr_comm_group *g,
                             enum mr_dtype dt, size_t count) {
  int n = g->comm->ops->group_size(g), me = g->comm->ops->group_rank(g);
  size_t b = (count + (size_t)n - 1) / (size_t)n;
  void *send = alloc(b * (size_t)n, dt), *recv = alloc(b * (size_t)n, dt);
  fill(send, dt, me, 0, b * (size_t)n);
  struct mr_comm_req *req;
  if (run(rc, "AllToAll", mr_comm_all_to_all(g, send, recv, b, dt, &req), &req) == 0)
    for (int j = 0; j < n; j++)
      for (size_t i = 0; i < b; i++) {
        uint64_t want = in_bits(dt, j, (size_t)me * b + i);
        if (get(recv, dt, (size_t)j * b + i) != want) {
          FAIL_AT(rc, "AllToAll", dt, count, (size_t)j * b + i,
                  get(recv, dt, (size_t)j * b + i), want);
          j = n;
          break;
        }
      }
  free(send);
  free(recv);
}

/* A pipeline: activations flow 0 -> n-1, gradients n-1 -> 0. */
static void check_send_recv(struct rank_ctx *rc, struct mr_comm_group *g,
                            enum mr_dtype dt, size_t count) {
  int n = g->comm->ops->group_size(g), me = g->comm->ops->group_rank(g);
  void *buf = alloc(count, dt);
  struct mr_comm_req *req;
  for (int dir = 1; dir >= -1; dir -= 2) {
    int from = me - dir, to = me + dir;
    if (from >= 0 && from < n) {
      if (run(rc, "Recv", mr_comm_recv(g, buf, count, dt, from, &req), &req))
        break;
      for (size_t i = 0; i < count; i++)
        if (get(buf, dt, i) != in_bits(dt, from + 7 * (dir < 0), i)) {
          FAIL_AT(rc, "Recv", dt, count, i, get(buf, dt, i),
                  in_bits(dt, from + 7 * (dir < 0), i));
          break;
        }
    }
    if (to >= 0 && to < n) {
      fill(buf, dt, me + 7 * (dir < 0), 0, count);
      if (run(rc, "Send", mr_comm_send(g, buf, count, dt, to, &req), &req))
        break;
    }
  }
  free(buf);
}

static void check_barrier(struct rank_ctx *rc, struct mr_comm_group *g,
                          uint64_t round) {
  int n = g->comm->ops->group_size(g);
  if (rc->rank % 2)
    usleep(2000); /* make the odd ranks late */
  atomic_fetch_add(&rc->shared[0], 1);
  struct mr_comm_req *req;
  if (run(rc, "Barrier", mr_comm_barrier(g, &req), &req) == 0) {
    uint64_t seen = atomic_load(&rc->shared[0]);
    if (seen < round * (uint64_t)n)
      rank_fail(rc, "Barrier %llu returned after %llu arrivals, expected %llu",
                (unsigned long long)round, (unsigned long long)seen,
                (unsigned long long)(round * (uint64_t)n));
  }
}

static struct mr_comm_group *world_group(struct rank_ctx *rc,
                                         const char *name) {
  int ranks[64];
  for (int i = 0; i < rc->world; i++)
    ranks[i] = i;
  struct mr_comm_group *g = NULL;
  if (rc->comm->ops->group_new(rc->comm, name, ranks, rc->world, &g) != 0)
    rank_fail(rc, "group_new %s: %s", name, mr_error_message());
  return g;
}

static void matrix_body(struct rank_ctx *rc) {
  make_tables();
  struct mr_comm_group *g = world_group(rc, "model");
  if (g == NULL)
    return;
  uint64_t round = 0;
  for (size_t d = 0; d < MR_ARRAY_LEN(dtypes); d++)
    for (size_t c = 0; c < MR_ARRAY_LEN(counts); c++) {
      enum mr_dtype dt = dtypes[d];
      size_t count = counts[c];
      check_allreduce(rc, g, dt, count, 0);
      if (strcmp(transport, "shm") == 0 && count > 0 && dt == MR_F32) {
        /* buffers from mem_alloc on every rank: the zero-copy path; on the
         * even ranks only: the members must agree on the staged path */
        check_allreduce(rc, g, dt, count, 1);
        check_allreduce(rc, g, dt, count, rc->rank % 2 == 0);
      }
      check_reduce_scatter(rc, g, dt, count);
      check_all_gather(rc, g, dt, count, 0);
      check_all_gather(rc, g, dt, count, 1);
      check_broadcast(rc, g, dt, count);
      check_all_to_all(rc, g, dt, count);
      check_send_recv(rc, g, dt, count);
      check_barrier(rc, g, ++round);
      if (rank_failures(rc) > 3)
        goto out;
    }
out:
  rc->comm->ops->group_free(g);
}

static void run_case(int world, void (*body)(struct rank_ctx *)) {
  struct run_opts o = {transport, 20000, 100, -1};
  char msg[8192];
  int bad = run_ranks(world, &o, body, NULL, msg, sizeof msg);
  for (char *p = msg; *p; p++) /* one line, for TAP */
    *p = *p == '\n' ? ';' : *p;
  msg[1000] = '\0'; /* Check's messages must stay short */
  ck_assert_msg(bad == 0, "%s", msg);
}

START_TEST(test_comm_matrix) {
  static const int sizes[] = {1, 2, 3, 4, 8};
  run_case(sizes[_i], matrix_body);
}
END_TEST

/* Two groups at once: the world (data) and pairs (model), operations on
 * both in flight together, started in different orders on different
 * ranks. */
static void two_groups_body(struct rank_ctx *rc) {
  make_tables();
  struct mr_comm_group *data = world_group(rc, "data");
  int pair[2] = {rc->rank & ~1, rc->rank | 1};
  struct mr_comm_group *model = NULL;
  if (rc->comm->ops->group_new(rc->comm, "model", pair, 2, &model) != 0) {
    rank_fail(rc, "group_new model: %s", mr_error_message());
    return;
  }
  size_t count = 100003;
  float *a = alloc(count, MR_F32), *b = alloc(count, MR_F32);
  fill(a, MR_F32, rc->rank, 0, count);
  fill(b, MR_F32, rc->rank, 0, count);
  for (int iter = 0; iter < 4; iter++) {
    struct mr_comm_req *ra = NULL, *rb = NULL;
    fill(a, MR_F32, rc->rank, 0, count);
    fill(b, MR_F32, rc->rank, 0, count);
    if (rc->rank % 2 == 0) {
      mr_comm_all_reduce(model, a, a, count, MR_F32, MR_RED_SUM, &ra);
      mr_comm_all_reduce(data, b, b, count, MR_F32, MR_RED_MAX, &rb);
    } else {
      mr_comm_all_reduce(data, b, b, count, MR_F32, MR_RED_MAX, &rb);
      mr_comm_all_reduce(model, a, a, count, MR_F32, MR_RED_SUM, &ra);
    }
    if (mr_comm_wait(rb) != 0 || mr_comm_wait(ra) != 0) {
      rank_fail(rc, "two groups: %s", mr_error_message());
      break;
    }
    for (size_t i = 0; i < count; i++) {
      float x0 = as_float(MR_F32, in_bits(MR_F32, pair[0], i));
      float x1 = as_float(MR_F32, in_bits(MR_F32, pair[1], i));
      float want = x0 + x1;
      if (memcmp(&a[i], &want, 4) != 0) {
        rank_fail(rc, "model AllReduce element %zu: %g, expected %g", i,
                  (double)a[i], (double)want);
        break;
      }
      uint64_t wb = ref_bits(MR_F32, MR_RED_MAX, rc->world, i);
      if (get(b, MR_F32, i) != wb) {
        rank_fail(rc, "data AllReduce(max) element %zu wrong", i);
        break;
      }
    }
  }
  free(a);
  free(b);
  rc->comm->ops->group_free(model);
  rc->comm->ops->group_free(data);
}

START_TEST(test_comm_two_groups) { run_case(4, two_groups_body); }
END_TEST

/* Overlapping asynchronous operations on one group, waited on in reverse
 * order, with test() polled in between; then the progress thread alone
 * completes an operation while this thread sleeps. */
static void async_body(struct rank_ctx *rc) {
  make_tables();
  struct mr_comm_group *g = world_group(rc, "model");
  if (g == NULL)
    return;
  int n = rc->world, me = rc->rank;
  enum { K = 6 };
  size_t count = 300001;
  void *in[K], *out[K];
  struct mr_comm_req *req[K];
  for (int k = 0; k < K; k++) {
    in[k] = alloc(count * (size_t)n, MR_BF16);
    out[k] = alloc(count * (size_t)n, MR_BF16);
    fill(in[k], MR_BF16, me, 0, count * (size_t)n);
    int r = k % 3 == 0   ? mr_comm_all_reduce(g, in[k], out[k], count, MR_BF16,
                                              MR_RED_SUM, &req[k])
            : k % 3 == 1 ? mr_comm_all_gather(g, in[k], out[k], count, NULL,
                                              MR_BF16, &req[k])
                         : mr_comm_reduce_scatter(g, in[k], out[k], count,
                                                  MR_BF16, MR_RED_AVG, &req[k]);
    if (r != 0)
      rank_fail(rc, "start %d: %s", k, mr_error_message());
  }
  int done = 0;
  for (int spin = 0; spin < 1000000 && !done; spin++)
    mr_comm_test(req[K - 1], &done);
  for (int k = K - 1; k >= 0; k--) {
    if (mr_comm_wait(req[k]) != 0) {
      rank_fail(rc, "wait %d: %s", k, mr_error_message());
      continue;
    }
    size_t len = k % 3 == 1 ? count * (size_t)n : count;
    for (size_t i = 0; i < len; i++) {
      uint64_t want =
          k % 3 == 0   ? ref_bits(MR_BF16, MR_RED_SUM, n, i)
          : k % 3 == 1 ? in_bits(MR_BF16, (int)(i / count), i % count)
                       : ref_bits(MR_BF16, MR_RED_AVG, n, (size_t)me * count + i);
      if (get(out[k], MR_BF16, i) != want) {
        FAIL_AT(rc, "async op", MR_BF16, count, i, get(out[k], MR_BF16, i),
                want);
        break;
      }
    }
  }
  /* progress without this thread: after a barrier (so every rank starts
   * together), start, then only sleep and look at the result, which only the
   * progress thread can have put there */
  struct mr_comm_req *r1;
  mr_comm_barrier(g, &r1);
  if (mr_comm_wait(r1) != 0)
    rank_fail(rc, "barrier: %s", mr_error_message());
  fill(in[0], MR_F32, me, 0, count);
  mr_comm_all_reduce(g, in[0], out[0], count, MR_F32, MR_RED_SUM, &r1);
  size_t wrong = count;
  for (int t = 0; t < 200 && wrong > 0; t++) {
    usleep(50000);
    wrong = 0;
    for (size_t i = 0; i < count; i++)
      wrong += get(out[0], MR_F32, i) != ref_bits(MR_F32, MR_RED_SUM, n, i);
  }
  if (wrong > 0)
    rank_fail(rc, "10 s after start without a wait, %zu of %zu elements "
              "were not reduced: the progress thread did not move them",
              wrong, count);
  if (mr_comm_wait(r1) != 0)
    rank_fail(rc, "progress-thread AllReduce: %s", mr_error_message());
  for (size_t i = 0; i < count; i++)
    if (get(out[0], MR_F32, i) != ref_bits(MR_F32, MR_RED_SUM, n, i)) {
      FAIL_AT(rc, "progress-thread AllReduce", MR_F32, count, i,
              get(out[0], MR_F32, i), ref_bits(MR_F32, MR_RED_SUM, n, i));
      break;
    }
  for (int k = 0; k < K; k++) {
    free(in[k]);
    free(out[k]);
  }
  rc->comm->ops->group_free(g);
}

START_TEST(test_comm_async_overlap) { run_case(3, async_body); }
END_TEST

Suite *comm_cases_suite(const char *name, const char *tp) {
  transport = tp;
#ifdef SHM_CHUNK
  setenv("MESHRUN_COMM_SHM_CHUNK_BYTES", SHM_CHUNK, 0);
#endif
  Suite *s = suite_create(name);
  TCase *tc = tcase_create("matrix");
  tcase_set_timeout(tc, 200);
  tcase_add_loop_test(tc, test_comm_matrix, 0, 5);
  suite_add_tcase(s, tc);
  tc = tcase_create("groups");
  tcase_set_timeout(tc, 100);
  tcase_add_test(tc, test_comm_two_groups);
  tcase_add_test(tc, test_comm_async_overlap);
  suite_add_tcase(s, tc);
  return s;
}
