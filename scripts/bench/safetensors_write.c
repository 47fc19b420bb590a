/* safetensors_write.c - times mr_st_writer on one checkpoint-like file:
 * MiB_TOTAL of F32 tensors in 16 MiB pieces plus 200 small ones (norm-sized,
 * 4 KiB), written with fsync; and the same tensors stored as BF16
 * (converted while streaming).  The peer, alternated with it in the same
 * run: the same bytes from the same memory written by a bare loop of 16 MiB
 * write(2) calls plus fsync, the fastest a writer of that memory can be.
 * Prints each trial and the median ratio per case.
 *   safetensors_write PATH MiB_TOTAL ROUNDS */
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#include "common/clock.h"
#include "common/error.h"
#include "common/safetensors.h"

static int write_file(const char *path, int n_big, float *big, float *small,
                      enum mr_dtype file_dtype, double *bytes) {
  struct mr_st_writer *w;
  char name[64];
  if (mr_st_writer_new(path, MR_ST_WRITE_FSYNC, &w) != 0)
    return -1;
  for (int i = 0; i < n_big; i++) {
    snprintf(name, sizeof name, "model.layers.%d.mlp.up_proj.weight", i);
    if (mr_st_writer_add_converted(w, name, file_dtype, 2,
                                   (int64_t[]){1024, 4096}, MR_F32,
                                   big + (size_t)i * 1024 * 4096) != 0)
      return -1;
  }
  for (int i = 0; i < 200; i++) {
    snprintf(name, sizeof name, "model.layers.%d.input_layernorm.weight", i);
    if (mr_st_writer_add_converted(w, name, file_dtype, 1, (int64_t[]){1024},
                                   MR_F32, small) != 0)
      return -1;
  }
  *bytes = (double)mr_st_writer_data_bytes(w);
  int rc = mr_st_writer_finish(w);
  mr_st_writer_free(w);
  return rc;
}

static double raw_write(const char *path, const void *buf, size_t bytes) {
  double t0 = mr_clock_s();
  int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC, 0644);
  if (fd < 0)
    return -1;
  const size_t chunk = 16u << 20;
  for (size_t off = 0; off < bytes; off += chunk) {
    size_t n = bytes - off < chunk ? bytes - off : chunk;
    if (write(fd, (const char *)buf + off, n) != (ssize_t)n)
      return -1;
  }
  fsync(fd);
  close(fd);
  double dt = mr_clock_s() - t0;
  remove(path);
  return dt;
}

static int cmp_double(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return x < y ? -1 : x > y;
}

int main(int argc, char **argv) {
  if (argc != 4) {
    fprintf(stderr, "usage: safetensors_write PATH MiB_TOTAL ROUNDS\n");
    return 2;
  }
  int n_big = atoi(argv[2]) / 16, rounds = atoi(argv[3]);
  float *big = malloc((size_t)n_big * 1024 * 4096 * sizeof(float));
  float small[1024];
  if (big == NULL || n_big <= 0 || rounds <= 0 || rounds > 64)
    return 1;
  for (size_t i = 0; i < (size_t)n_big * 1024 * 4096; i++)
    big[i] = (float)(i % 4099) * 0.001f; /* touched: no page faults timed */
  for (int i = 0; i < 1024; i++)
    small[i] = 1.0f;
  const enum mr_dtype kinds[2] = {MR_F32, MR_BF16};
  for (int k = 0; k < 2; k++) {
    double ratio[64];
    for (int r = 0; r < rounds; r++) {
      /* odd rounds time the peer first, so neither side always follows the
       * other's unlink and writeback */
      size_t es = mr_dtype_size(kinds[k]);
      double bytes = ((double)n_big * 1024 * 4096 + 200 * 1024) * (double)es;
      double peer = 0, written = 0;
      if (r % 2 == 1 && (peer = raw_write(argv[1], big, (size_t)bytes)) < 0)
        return 1;
      double t0 = mr_clock_s();
      if (write_file(argv[1], n_big, big, small, kinds[k], &written) != 0) {
        fprintf(stderr, "%s\n", mr_error_message());
        return 1;
      }
      double dt = mr_clock_s() - t0;
      remove(argv[1]);
      if (written != bytes)
        return 1;
      if (r % 2 == 0 && (peer = raw_write(argv[1], big, (size_t)bytes)) < 0)
        return 1;
      ratio[r] = (bytes / dt) / (bytes / peer);
      printf("%-4s %5.0f MiB  mr_st_writer %5.2f s %5.2f GB/s | "
             "write(2) loop %5.2f s %5.2f GB/s | ratio %.2f\n",
             mr_dtype_safetensors_name(kinds[k]), bytes / 1048576, dt,
             bytes / dt / 1e9, peer, bytes / peer / 1e9, ratio[r]);
    }
    qsort(ratio, (size_t)rounds, sizeof ratio[0], cmp_double);
    printf("%-4s median ratio writer / write(2) loop: %.2f\n",
           mr_dtype_safetensors_name(kinds[k]), ratio[rounds / 2]);
  }
  free(big);
  return 0;
}
