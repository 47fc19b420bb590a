/* test_gpu_runtime.c - the CUDA backend table against the CPU one: axpby,
 * the chunked sum of squares (bit for bit, and inf / NaN for the fp16
 * overflow check), AdamW, copy2d, memory, streams, events, page-locked
 * host buffers and launch.  Skips (77) where there is no GPU. */
#include "check_main.h"
#include "kernels_ref.h"
#include "test_gpu_common.h"

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "common/error.h"
#include "compiler/graph.h"
#include "compiler/ops.h"
#include "worker/backend/backend.h"
#include "worker/backend/cpu/kernels.h"
#include "worker/device.h"

struct pair {
  struct mr_backend *cpu, *gpu;
};

static struct pair open_pair(void) {
  struct pair p;
  ck_assert_int_eq(mr_device_open("cpu", 0, 2, 0, &p.cpu), 0);
  int rc = mr_device_open("cuda", 0, 0, 0, &p.gpu);
  ck_assert_msg(rc == 0, "cuda: %s", mr_error_message());
  ck_assert_str_eq(p.gpu->ops->name, "cuda");
  return p;
}

static void close_pair(struct pair *p) {
  mr_backend_free(p->cpu);
  mr_backend_free(p->gpu);
}

static void *upload(struct mr_backend *be, const void *src, size_t bytes) {
  void *d = NULL;
  ck_assert_int_eq(be->ops->alloc(be, bytes, &d), 0);
  ck_assert_int_eq(be->ops->copy(be, NULL, d, src, bytes, MR_COPY_HOST_TO_DEVICE), 0);
  return d;
}

static void download(struct mr_backend *be, void *dst, const void *src, size_t bytes) {
  ck_assert_int_eq(be->ops->copy(be, NULL, dst, src, bytes, MR_COPY_DEVICE_TO_HOST), 0);
}

static void assert_close(const char *what, const float *got, const float *want,
                         size_t n, double tol) {
  for (size_t i = 0; i < n; i++)
    ck_assert_msg(fabs((double)got[i] - want[i]) <= tol * (1.0 + fabs(want[i])),
                  "%s [%zu]: cuda %.9g cpu %.9g", what, i, (double)got[i],
                  (double)want[i]);
}

START_TEST(test_gpu_axpby_matches_cpu) {
  struct pair p = open_pair();
  uint64_t seed = 1;
  size_t n = 100003;
  const float ab[][2] = {{1.0f, 0.5f}, {0.0f, -2.0f}, {0.9f, 0.1f}};
  for (size_t k = 0; k < 3; k++) {
    float *y = ref_randf(n, &seed, 1), *x = ref_randf(n, &seed, 1);
    float *dy = upload(p.gpu, y, n * 4), *dx = upload(p.gpu, x, n * 4);
    ck_assert_int_eq(p.gpu->ops->axpby(p.gpu, dy, dx, ab[k][0], ab[k][1], n), 0);
    ck_assert_int_eq(p.cpu->ops->axpby(p.cpu, y, x, ab[k][0], ab[k][1], n), 0);
    float *got = malloc(n * 4);
    download(p.gpu, got, dy, n * 4);
    assert_close("axpby", got, y, n, 1e-6);
    p.gpu->ops->free(p.gpu, dy);
    p.gpu->ops->free(p.gpu, dx);
    free(y);
    free(x);
    free(got);
  }
  close_pair(&p);
}
END_TEST

START_TEST(test_gpu_sumsq_fixed_chunks_and_overflow) {
  struct pair p = open_pair();
  uint64_t seed = 2;
  size_t sizes[] = {0, 1, 7, 4095, 4097, 100003, 3000001};
  for (size_t k = 0; k < MR_ARRAY_LEN(sizes); k++) {
    size_t n = sizes[k];
    float *x = ref_randf(n, &seed, 3);
    float *dx = upload(p.gpu, x, n * 4 + 4);
    double g = -1, c = -1;
    ck_assert_int_eq(p.gpu->ops->sumsq(p.gpu, dx, n, &g), 0);
    ck_assert_int_eq(p.cpu->ops->sumsq(p.cpu, x, n, &c), 0);
    ck_assert_msg(fabs(g - c) <= 1e-7 * (c + 1), "sumsq n=%zu: cuda %.17g cpu %.17g", n,
                  g, c);
    if (n > 10) { /* the fp16 loss-scale check: inf or NaN shows */
      float bad[2] = {INFINITY, NAN};
      for (int b = 0; b < 2; b++) {
        ck_assert_int_eq(p.gpu->ops->copy(p.gpu, NULL, dx + n / 2, &bad[b], 4,
                                          MR_COPY_HOST_TO_DEVICE), 0);
        ck_assert_int_eq(p.gpu->ops->sumsq(p.gpu, dx, n, &g), 0);
        ck_assert(!isfinite(g));
      }
    }
    p.gpu->ops->free(p.gpu, dx);
    free(x);
  }
  close_pair(&p);
}
END_TEST

START_TEST(test_gpu_adamw_matches_cpu) {
  struct pair p = open_pair();
  uint64_t seed = 3;
  size_t n = 50001;
  struct mr_adamw h = mr_adamw_defaults();
  h.lr = 0.05f;
  h.weight_decay = 0.1f;
  h.grad_scale = 0.5f;
  float *w = ref_randf(n, &seed, 1), *m = calloc(n, 4), *v = calloc(n, 4);
  float *dw = upload(p.gpu, w, n * 4), *dm = upload(p.gpu, m, n * 4),
        *dv = upload(p.gpu, v, n * 4);
  for (int t = 1; t <= 5; t++) {
    float *gr = ref_randf(n, &seed, t == 3 ? 1e-6 : 2);
    float *dg = upload(p.gpu, gr, n * 4);
    ck_assert_int_eq(p.gpu->ops->adamw(p.gpu, dw, dg, dm, dv, n, &h, t), 0);
    ck_assert_int_eq(p.cpu->ops->adamw(p.cpu, w, gr, m, v, n, &h, t), 0);
    p.gpu->ops->free(p.gpu, dg);
    free(gr);
  }
  float *got = malloc(n * 4);
  download(p.gpu, got, dw, n * 4);
  assert_close("adamw p", got, w, n, 1e-5);
  download(p.gpu, got, dm, n * 4);
  assert_close("adamw m", got, m, n, 1e-5);
  download(p.gpu, got, dv, n * 4);
  assert_close("adamw v", got, v, n, 1e-5);
  ck_assert_int_eq(p.gpu->ops->adamw(p.gpu, dw, dw, dm, dv, n, &h, 0), MR_EINVAL);
  p.gpu->ops->free(p.gpu, dw);
  p.gpu->ops->free(p.gpu, dm);
  p.gpu->ops->free(p.gpu, dv);
  free(w);
  free(m);
  free(v);
  free(got);
  close_pair(&p);
}
END_TEST

START_TEST(test_gpu_copy2d_packs_a_block) {
  struct pair p = open_pair();
  uint64_t seed = 4;
  size_t rows = 37, cols = 53, w = 19, off = 7;
  float *x = ref_randf(rows * cols, &seed, 1);
  float *dx = upload(p.gpu, x, rows * cols * 4), *dy = NULL;
  ck_assert_int_eq(p.gpu->ops->alloc(p.gpu, rows * w * 4, (void **)&dy), 0);
  ck_assert_int_eq(p.gpu->ops->copy2d(p.gpu, dy, w * 4, dx + off, cols * 4, w * 4, rows), 0);
  float *got = malloc(rows * w * 4), *want = malloc(rows * w * 4);
  ck_assert_int_eq(p.cpu->ops->copy2d(p.cpu, want, w * 4, x + off, cols * 4, w * 4, rows), 0);
  download(p.gpu, got, dy, rows * w * 4);
  ck_assert(memcmp(got, want, rows * w * 4) == 0);
  ck_assert_int_eq(p.gpu->ops->copy2d(p.gpu, dy, w * 4, dx, cols * 4, 0, rows), 0);
  p.gpu->ops->free(p.gpu, dx);
  p.gpu->ops->free(p.gpu, dy);
  free(x);
  free(got);
  free(want);
  close_pair(&p);
}
END_TEST

struct launch_args {
  const struct mr_graph *g;
  const struct mr_op *op;
  void *const *bufs;
};

/* a launched function: queues the registry's add kernel on the stream
 * launch was given */
static int launched_add(void *kctx, const void *args) {
  const struct launch_args *a = args;
  return mr_op_kernel(MR_OP_ADD, MR_BACKEND_CUDA)(kctx, a->g, a->op, a->bufs);
}

START_TEST(test_gpu_memory_streams_events_pinned) {
  struct pair p = open_pair();
  struct mr_backend *be = p.gpu;
  void *z = NULL;
  ck_assert_int_eq(be->ops->alloc(be, 0, &z), 0);
  ck_assert_ptr_nonnull(z);
  ck_assert_int_eq((uintptr_t)z % 64, 0);
  be->ops->free(be, z);
  be->ops->free(be, NULL);
  /* many sizes, freed and taken again from the cache */
  void *blocks[64];
  for (int r = 0; r < 2; r++) {
    for (int i = 0; i < 64; i++)
      ck_assert_int_eq(be->ops->alloc(be, (size_t)(i * 7919 % 5000000 + 1), &blocks[i]), 0);
    for (int i = 0; i < 64; i++)
      be->ops->free(be, blocks[i]);
  }
  /* pinned buffer -> device on a side stream, event, back on the compute
   * stream after waiting on it */
  size_t n = 1 << 20;
  ck_assert(be->ops->host_alloc != NULL);
  float *h = NULL, *back = NULL, *d = NULL;
  ck_assert_int_eq(be->ops->host_alloc(be, n * 4, (void **)&h), 0);
  ck_assert_int_eq(be->ops->host_alloc(be, n * 4, (void **)&back), 0);
  for (size_t i = 0; i < n; i++)
    h[i] = (float)i;
  ck_assert_int_eq(be->ops->alloc(be, n * 4, (void **)&d), 0);
  struct mr_stream *s = NULL;
  struct mr_event *ev = NULL;
  ck_assert_int_eq(be->ops->stream_new(be, &s), 0);
  ck_assert_int_eq(be->ops->event_new(be, &ev), 0);
  ck_assert_int_eq(be->ops->copy(be, s, d, h, n * 4, MR_COPY_HOST_TO_DEVICE), 0);
  ck_assert_int_eq(be->ops->event_record(be, ev, s), 0);
  ck_assert_int_eq(be->ops->stream_wait(be, NULL, ev), 0);
  ck_assert_int_eq(be->ops->memset(be, NULL, d, 0, 4), 0);
  ck_assert_int_eq(be->ops->copy(be, NULL, back, d, n * 4, MR_COPY_DEVICE_TO_HOST), 0);
  ck_assert_int_eq(be->ops->synchronize(be, NULL), 0);
  ck_assert_int_eq(be->ops->event_synchronize(be, ev), 0);
  ck_assert_int_eq(be->ops->event_query(be, ev), 1);
  ck_assert(back[0] == 0.0f && back[1] == 1.0f && back[n - 1] == (float)(n - 1));
  /* launch on the side stream: d = d + d */
  struct mr_graph g;
  mr_graph_init(&g);
  int64_t shape[1] = {(int64_t)n};
  int x = mr_graph_tensor(&g, "x", MR_F32, MR_ROLE_INPUT, 1, shape);
  int in[2] = {x, x};
  int id = mr_graph_op(&g, MR_OP_ADD, "y", in, 2, NULL, NULL);
  ck_assert_int_ge(id, 0);
  void *bufs[3] = {d, d, d};
  struct launch_args a = {&g, &g.ops[id], bufs};
  ck_assert_int_eq(be->ops->launch(be, s, launched_add, &a), 0);
  ck_assert_int_eq(be->ops->synchronize(be, s), 0);
  ck_assert_int_eq(be->ops->copy(be, NULL, back, d, n * 4, MR_COPY_DEVICE_TO_HOST), 0);
  ck_assert_int_eq(be->ops->synchronize(be, NULL), 0);
  ck_assert(back[0] == 0.0f && back[3] == 6.0f && back[n - 1] == (float)(2 * (n - 1)));
  mr_graph_close(&g);
  be->ops->event_free(be, ev);
  be->ops->stream_free(be, s);
  be->ops->free(be, d);
  be->ops->host_free(be, h);
  be->ops->host_free(be, back);
  /* far more than the device has: a clean MR_ENOMEM naming cudaMalloc */
  void *huge = NULL;
  ck_assert_int_eq(be->ops->alloc(be, (size_t)1 << 50, &huge), MR_ENOMEM);
  ck_assert(strstr(mr_error_message(), "cudaMalloc") != NULL);
  void *ok = NULL;
  ck_assert_int_eq(be->ops->alloc(be, 1024, &ok), 0);
  be->ops->free(be, ok);
  close_pair(&p);
}
END_TEST

START_TEST(test_gpu_bad_device_and_amp) {
  struct mr_backend *be = NULL;
  ck_assert_int_eq(mr_device_open("cuda", gpu_count() + 3, 0, 0, &be), MR_ENOENT);
  ck_assert_ptr_null(be);
  ck_assert_int_eq(mr_device_open("cuda", 0, 0, 7, &be), MR_EINVAL);
}
END_TEST

static Suite *gpu_runtime_suite(void) {
  Suite *s = suite_create("gpu_runtime");
  TCase *tc = tcase_create("runtime");
  tcase_set_timeout(tc, 120);
  tcase_add_test(tc, test_gpu_axpby_matches_cpu);
  tcase_add_test(tc, test_gpu_sumsq_fixed_chunks_and_overflow);
  tcase_add_test(tc, test_gpu_adamw_matches_cpu);
  tcase_add_test(tc, test_gpu_copy2d_packs_a_block);
  tcase_add_test(tc, test_gpu_memory_streams_events_pinned);
  tcase_add_test(tc, test_gpu_bad_device_and_amp);
  suite_add_tcase(s, tc);
  return s;
}

MR_GPU_TEST_MAIN(gpu_runtime_suite)
