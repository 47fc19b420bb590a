/* comm_mpi.c - the peer measured beside meshrun's comm backend: Open MPI's
 * MPI_Allreduce of float32 sums (or MPI_Reduce_scatter_block,
 * MPI_Allgather: argument 2 "reducescatter" / "allgather"), same sizes,
 * iteration counts and output format as comm_bench.c.  Compiled with mpicc
 * by scripts/bench/comm. */
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int iters_for(size_t bytes) {
  size_t it = (size_t)(2u << 30) / (bytes ? bytes : 1);
  return it < 5 ? 5 : it > 20000 ? 20000 : (int)it;
}

int main(int argc, char **argv) {
  MPI_Init(&argc, &argv);
  int rank, n;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &n);
  size_t max_bytes = argc > 1 ? strtoull(argv[1], NULL, 0) : (256u << 20);
  const char *op = argc > 2 ? argv[2] : "allreduce";
  int rs = strcmp(op, "reducescatter") == 0, ag = strcmp(op, "allgather") == 0;
  float *send = malloc(max_bytes), *recv = malloc(max_bytes);
  for (size_t i = 0; i < max_bytes / 4; i++)
    send[i] = (float)(i % 1000) * 0.5f + (float)rank;
  memset(recv, 0, max_bytes);
  for (size_t bytes = 4096; bytes <= max_bytes; bytes *= 4) {
    int count = (int)(bytes / 4), iters = iters_for(bytes);
    double t0 = 0;
    for (int i = 0; i < iters / 10 + 2 + iters; i++) {
      if (i == iters / 10 + 2) {
        MPI_Barrier(MPI_COMM_WORLD);
        t0 = MPI_Wtime();
      }
      if (rs)
        MPI_Reduce_scatter_block(send, recv, count / n, MPI_FLOAT, MPI_SUM,
                                 MPI_COMM_WORLD);
      else if (ag)
        MPI_Allgather(send, count / n, MPI_FLOAT, recv, count / n, MPI_FLOAT,
                      MPI_COMM_WORLD);
      else
        MPI_Allreduce(send, recv, count, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
    }
    double t = (MPI_Wtime() - t0) / iters;
    if (rank == 0) {
      double algbw = (double)bytes / t / 1e9;
      printf("mpi-%s %zu %.2f %.3f %.3f\n", op, bytes, t * 1e6, algbw,
             algbw * (rs || ag ? 1.0 : 2.0) * (n - 1) / n);
      fflush(stdout);
    }
  }
  free(send);
  free(recv);
  MPI_Finalize();
  return 0;
}
