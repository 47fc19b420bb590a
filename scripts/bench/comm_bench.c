/* comm_bench.c - AllReduce latency and bus bandwidth of meshrun's CPU comm
 * backend, 2 ranks (forked, one core each), 4 KiB ... 256 MiB of float32.
 *
 * usage: comm_bench MODE [max_bytes [OP]]
 *   MODE: shm (ordinary buffers), shm-zc (buffers from mem_alloc, so the
 *   reduction reads the peer's buffer in place), tcp.
 *   OP: allreduce (default), reducescatter, allgather; bytes is the whole
 *   message (the AllGather output, the ReduceScatter input).
 * Prints one line per size: "MODE-OP bytes time_us algbw_GBps busbw_GBps",
 * with busbw = algbw * 2(n-1)/n for AllReduce and * (n-1)/n for the others
 * (nccl-tests).  Built and run by scripts/bench/comm. */
#define _GNU_SOURCE
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "common/clock.h"
#include "common/error.h"
#include "common/tunable.h"
#include "worker/comm/comm.h"

static int iters_for(size_t bytes) {
  size_t it = (size_t)(2u << 30) / (bytes ? bytes : 1);
  return it < 5 ? 5 : it > 20000 ? 20000 : (int)it;
}

static int start(struct mr_comm_group *g, const char *op, float *send,
                 float *recv, size_t count, struct mr_comm_req **req) {
  if (strcmp(op, "reducescatter") == 0)
    return mr_comm_reduce_scatter(g, send, recv, count / 2, MR_F32,
                                  MR_RED_SUM, req);
  if (strcmp(op, "allgather") == 0)
    return mr_comm_all_gather(g, send, recv, count / 2, NULL, MR_F32, req);
  return mr_comm_all_reduce(g, send, recv, count, MR_F32, MR_RED_SUM, req);
}

static int rank_main(int rank, struct mr_bootstrap_local *bl, const char *mode,
                     size_t max_bytes, const char *op) {
  cpu_set_t set;
  CPU_ZERO(&set);
  CPU_SET(rank, &set);
  sched_setaffinity(0, sizeof set, &set);
  int zc = strcmp(mode, "shm-zc") == 0;
  mr_tunable_override(MR_TUNABLE_COMM_TRANSPORT,
                      strcmp(mode, "tcp") == 0 ? "tcp" : "shm");
  if (zc) {
    char heap[32];
    snprintf(heap, sizeof heap, "%zu", 2 * max_bytes + (1u << 20));
    mr_tunable_override(MR_TUNABLE_COMM_SHM_HEAP_BYTES, heap);
  }
  char job[32];
  snprintf(job, sizeof job, "bench%d", (int)getppid());
  struct mr_bootstrap bs;
  mr_bootstrap_local_rank(bl, rank, "host0", job, 60000, &bs);
  const struct mr_comm_ops *ops = mr_comm_cpu_ops();
  struct mr_comm *c;
  struct mr_comm_group *g;
  int ranks[2] = {0, 1};
  if (ops->open(&bs, &c) != 0 || ops->group_new(c, "bench", ranks, 2, &g)) {
    fprintf(stderr, "comm_bench: %s\n", mr_error_message());
    return 1;
  }
  float *send, *recv;
  ops->mem_alloc(g, max_bytes, (void **)&send);
  ops->mem_alloc(g, max_bytes, (void **)&recv);
  if (!zc) { /* ordinary memory, like the MPI peer's */
    ops->mem_free(g, send);
    ops->mem_free(g, recv);
    send = malloc(max_bytes);
    recv = malloc(max_bytes);
  }
  for (size_t i = 0; i < max_bytes / 4; i++)
    send[i] = (float)(i % 1000) * 0.5f + (float)rank;
  memset(recv, 0, max_bytes);
  struct mr_comm_req *req;
  for (size_t bytes = 4096; bytes <= max_bytes; bytes *= 4) {
    size_t count = bytes / 4;
    int iters = iters_for(bytes), warm = iters / 10 + 2;
    for (int i = 0; i < warm; i++) {
      start(g, op, send, recv, count, &req);
      if (mr_comm_wait(req) != 0) {
        fprintf(stderr, "comm_bench: %s\n", mr_error_message());
        return 1;
      }
    }
    mr_comm_barrier(g, &req);
    mr_comm_wait(req);
    double t0 = mr_clock_s();
    for (int i = 0; i < iters; i++) {
      start(g, op, send, recv, count, &req);
      mr_comm_wait(req);
    }
    double t = (mr_clock_s() - t0) / iters;
    int ar = strcmp(op, "allreduce") == 0;
    float want = strcmp(op, "allgather") == 0 ? 3.5f
                 : (float)((7 + (ar ? 0 : rank * count / 2)) % 1000) * 0.5f *
                           2 + 1.0f;
    if (count > 7 && recv[7] != want) {
      fprintf(stderr, "comm_bench: wrong result %g, expected %g\n",
              (double)recv[7], (double)want);
      return 1;
    }
    if (rank == 0) {
      double algbw = (double)bytes / t / 1e9;
      printf("%s-%s %zu %.2f %.3f %.3f\n", mode, op, bytes, t * 1e6, algbw,
             algbw * (ar ? 2.0 : 1.0) * (2 - 1) / 2);
      fflush(stdout);
    }
  }
  if (zc) {
    ops->mem_free(g, send);
    ops->mem_free(g, recv);
  } else {
    free(send);
    free(recv);
  }
  ops->group_free(g);
  ops->close(c);
  return 0;
}

int main(int argc, char **argv) {
  if (argc < 2) {
    fprintf(stderr, "usage: comm_bench shm|shm-zc|tcp [max_bytes]\n");
    return 2;
  }
  size_t max_bytes = argc > 2 ? strtoull(argv[2], NULL, 0) : (256u << 20);
  const char *op = argc > 3 ? argv[3] : "allreduce";
  struct mr_bootstrap_local *bl = mr_bootstrap_local_new(2, 512);
  pid_t pids[2];
  for (int r = 0; r < 2; r++)
    if ((pids[r] = fork()) == 0)
      _exit(rank_main(r, bl, argv[1], max_bytes, op));
  int bad = 0;
  for (int r = 0; r < 2; r++) {
    int st;
    waitpid(pids[r], &st, 0);
    bad |= !WIFEXITED(st) || WEXITSTATUS(st) != 0;
  }
  mr_bootstrap_local_free(bl);
  return bad;
}
