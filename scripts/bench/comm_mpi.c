/* comm_mpi.c - the peer measured beside meshrun's comm backend: Open MPI's
 * MPI_Allreduce of float32 sums, same sizes, iteration counts and output
 * format as comm_bench.c.  Compiled with mpicc by scripts/bench/comm. */
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
  float *send = malloc(max_bytes), *recv = malloc(max_bytes);
  for (size_t i = 0; i < max_bytes / 4; i++)
    send[i] = (float)(i % 1000) * 0.5f + (float)rank;
  memset(recv, 0, max_bytes);
  for (size_t bytes = 4096; bytes <= max_bytes; bytes *= 4) {
    int count = (int)(bytes / 4), iters = iters_for(bytes);
    for (int i = 0; i < iters / 10 + 2; i++)
      MPI_Allreduce(send, recv, count, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
    MPI_Barrier(MPI_COMM_WORLD);
    double t0 = MPI_Wtime();
    for (int i = 0; i < iters; i++)
      MPI_Allreduce(send, recv, count, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
    double t = (MPI_Wtime() - t0) / iters;
    if (rank == 0) {
      double algbw = (double)bytes / t / 1e9;
      printf("mpi %zu %.2f %.3f %.3f\n", bytes, t * 1e6, algbw,
             algbw * 2 * (n - 1) / n);
      fflush(stdout);
    }
  }
  free(send);
  free(recv);
  MPI_Finalize();
  return 0;
}
