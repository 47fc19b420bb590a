/* test_kernels_optim.c - AdamW against torch.optim.AdamW's update written
 * out here in double, the gradient sum of squares against a serial double
 * sum, the fp16/bf16 bulk conversions and overflow checks, the thread pool
 * and the CPU device backend table. */
#include "check_main.h"
#include "kernels_ref.h"

#include <stdatomic.h>

#include "common/dtype.h"
#include "common/error.h"
#include "common/tunable.h"
#include "worker/backend/cpu/cpu_backend.h"

START_TEST(test_kernels_adamw_matches_torch_formula) {
  struct mr_pool *p1 = ref_pool(1), *p3 = ref_pool(3);
  struct mr_adamw h = mr_adamw_defaults();
  ck_assert_float_eq(h.lr, 1e-3f);
  ck_assert_float_eq(h.beta1, 0.9f);
  ck_assert_float_eq(h.beta2, 0.999f);
  ck_assert_float_eq(h.eps, 1e-8f);
  ck_assert_float_eq(h.weight_decay, 0.01f);
  h.lr = 0.05f; /* big enough that the decay and bias correction show */
  h.weight_decay = 0.1f;
  h.grad_scale = 0.5f;
  uint64_t seed = 11;
  size_t n = 50001;
  float *param = ref_randf(n, &seed, 1), *m = calloc(n, 4), *v = calloc(n, 4);
  float *param3 = ref_copyf(param, n), *m3 = calloc(n, 4), *v3 = calloc(n, 4);
  double *P = ref_tod(param, n), *Md = calloc(n, 8), *Vd = calloc(n, 8);
  for (int t = 1; t <= 5; t++) {
    float *g = ref_randf(n, &seed, t == 3 ? 1e-6 : 2); /* tiny grads: eps matters */
    ck_assert_int_eq(mr_cpu_adamw_step(p1, param, g, m, v, n, &h, t), 0);
    ck_assert_int_eq(mr_cpu_adamw_step(p3, param3, g, m3, v3, n, &h, t), 0);
    /* torch.optim.AdamW, _single_tensor_adamw */
    double lr = 0.05, wd = 0.1, b1 = 0.9, b2 = 0.999, eps = 1e-8;
    double bc1 = 1 - pow(b1, t), bc2 = 1 - pow(b2, t);
    for (size_t i = 0; i < n; i++) {
      double gi = 0.5 * g[i];
      P[i] *= 1 - lr * wd;
      Md[i] = b1 * Md[i] + (1 - b1) * gi;
      Vd[i] = b2 * Vd[i] + (1 - b2) * gi * gi;
      P[i] -= lr / bc1 * Md[i] / (sqrt(Vd[i]) / sqrt(bc2) + eps);
    }
    free(g);
  }
  ck_assert(memcmp(param, param3, n * 4) == 0);
  ref_close("adamw p", param, P, n, 2e-6, 1e-5);
  ref_close("adamw m", m, Md, n, 1e-7, 1e-5);
  ref_close("adamw v", v, Vd, n, 1e-9, 1e-4);
  ck_assert_int_eq(mr_cpu_adamw_step(p1, param, param, m, v, n, &h, 0), MR_EINVAL);
  free(param); free(m); free(v); free(param3); free(m3); free(v3); free(P); free(Md); free(Vd);
  mr_pool_free(p1); mr_pool_free(p3);
}
END_TEST

START_TEST(test_kernels_sumsq_serial_and_thread_independent) {
  struct mr_pool *p1 = ref_pool(1), *p2 = ref_pool(2), *p3 = ref_pool(3);
  uint64_t seed = 12;
  size_t sizes[] = {0, 1, 4095, 4097, 100003};
  for (size_t si = 0; si < MR_ARRAY_LEN(sizes); si++) {
    size_t n = sizes[si];
    float *x = ref_randf(n, &seed, 3);
    double want = 0;
    for (size_t i = 0; i < n; i++)
      want += (double)x[i] * x[i];
    double a = -1, b = -1, c = -1;
    ck_assert_int_eq(mr_cpu_sumsq(p1, &a, x, n), 0);
    ck_assert_int_eq(mr_cpu_sumsq(p2, &b, x, n), 0);
    ck_assert_int_eq(mr_cpu_sumsq(p3, &c, x, n), 0);
    ck_assert_double_eq_tol(a, want, 1e-6 * (want + 1));
    ck_assert(memcmp(&a, &b, sizeof a) == 0 && memcmp(&a, &c, sizeof a) == 0);
    free(x);
  }
  mr_pool_free(p1); mr_pool_free(p2); mr_pool_free(p3);
}
END_TEST

START_TEST(test_kernels_half_conversions_and_overflow_check) {
  struct mr_pool *p = ref_pool(3);
  uint64_t seed = 13;
  size_t n = 70001;
  float *x = ref_randf(n, &seed, 1000), *back = malloc(n * 4);
  uint16_t *h = malloc(n * 2);
  ck_assert_int_eq(mr_cpu_to_bf16(p, h, x, n), 0);
  for (size_t i = 0; i < n; i++)
    ck_assert_uint_eq(h[i], mr_f32_to_bf16(x[i]));
  ck_assert_int_eq(mr_cpu_from_bf16(p, back, h, n), 0);
  for (size_t i = 0; i < n; i++) /* bf16 keeps 8 bits of mantissa */
    ck_assert(fabsf(back[i] - x[i]) <= fabsf(x[i]) * 0x1p-8f);
  ck_assert_int_eq(mr_cpu_to_f16(p, h, x, n), 0);
  for (size_t i = 0; i < n; i++)
    ck_assert_uint_eq(h[i], mr_f32_to_f16(x[i]));
  ck_assert_int_eq(mr_cpu_from_f16(p, back, h, n), 0);
  for (size_t i = 0; i < n; i++)
    ck_assert(fabsf(back[i] - x[i]) <= fabsf(x[i]) * 0x1p-11f + 0x1p-24f);

  bool fin = false;
  ck_assert_int_eq(mr_cpu_all_finite(p, &fin, x, n), 0);
  ck_assert(fin);
  ck_assert_int_eq(mr_cpu_all_finite_h16(p, &fin, h, n, MR_F16), 0);
  ck_assert(fin);
  size_t where[] = {0, 16383, 16384, n - 1};
  for (size_t wi = 0; wi < MR_ARRAY_LEN(where); wi++) {
    float keep = x[where[wi]];
    x[where[wi]] = wi % 2 ? NAN : -INFINITY;
    ck_assert_int_eq(mr_cpu_all_finite(p, &fin, x, n), 0);
    ck_assert_msg(!fin, "missed a non-finite at %zu", where[wi]);
    x[where[wi]] = keep;
  }
  x[5] = 70000.0f; /* finite in f32, overflows fp16, fits bf16 */
  ck_assert_int_eq(mr_cpu_to_f16(p, h, x, n), 0);
  ck_assert_int_eq(mr_cpu_all_finite_h16(p, &fin, h, n, MR_F16), 0);
  ck_assert(!fin);
  ck_assert_int_eq(mr_cpu_to_bf16(p, h, x, n), 0);
  ck_assert_int_eq(mr_cpu_all_finite_h16(p, &fin, h, n, MR_BF16), 0);
  ck_assert(fin);
  h[n - 1] = 0x7fc0; /* bf16 NaN */
  ck_assert_int_eq(mr_cpu_all_finite_h16(p, &fin, h, n, MR_BF16), 0);
  ck_assert(!fin);
  ck_assert_int_eq(mr_cpu_all_finite_h16(p, &fin, h, n, MR_F32), MR_EINVAL);
  free(x); free(back); free(h);
  mr_pool_free(p);
}
END_TEST

/* ---- the pool ---- */

struct count_arg {
  atomic_int *hits;
  int fail_at;
};

static int count_task(void *arg, int task, int thread) {
  struct count_arg *a = arg;
  atomic_fetch_add(&a->hits[task], 1);
  return task == a->fail_at ? MR_EIO : 0;
}

START_TEST(test_kernels_pool_runs_every_task_once) {
  struct mr_pool *p = ref_pool(4);
  ck_assert_int_eq(mr_pool_threads(p), 4);
  enum { NT = 1000 };
  static atomic_int hits[NT];
  for (int rep = 0; rep < 200; rep++) { /* many jobs back to back */
    for (int i = 0; i < NT; i++)
      atomic_store(&hits[i], 0);
    struct count_arg a = {hits, rep == 7 ? 123 : -1};
    int ntasks = 1 + (rep * 37) % NT;
    ck_assert_int_eq(mr_pool_run(p, ntasks, count_task, &a), rep == 7 ? MR_EIO : 0);
    for (int i = 0; i < NT; i++)
      ck_assert_int_eq(atomic_load(&hits[i]), i < ntasks ? 1 : 0);
  }
  void *s = mr_pool_scratch(p, 3, 1000);
  ck_assert_ptr_nonnull(s);
  ck_assert_uint_eq((uintptr_t)s % 64, 0);
  mr_pool_free(p);
  mr_pool_free(NULL);
  /* nthreads <= 0 reads MESHRUN_THREADS */
  mr_tunable_override(MR_TUNABLE_THREADS, "3");
  ck_assert_int_eq(mr_pool_new(0, &p), 0);
  ck_assert_int_eq(mr_pool_threads(p), 3);
  mr_pool_free(p);
  mr_tunable_override(MR_TUNABLE_THREADS, "-2");
  ck_assert_int_eq(mr_pool_new(0, &p), MR_EINVAL);
  ck_assert_ptr_null(p);
  ck_assert_ptr_nonnull(strstr(mr_error_message(), "MESHRUN_THREADS"));
}
END_TEST

/* ---- the device backend table ---- */

struct fill_args {
  float *x;
  size_t n;
  float value;
};

static int fill_kernel(void *kctx, const void *args) {
  const struct fill_args *a = args;
  struct mr_pool *pool = kctx; /* the CPU backend's kernel context */
  ck_assert_int_eq(mr_pool_threads(pool), 2);
  for (size_t i = 0; i < a->n; i++)
    a->x[i] = a->value;
  return mr_cpu_scale(pool, a->x, a->n, 2.0f);
}

START_TEST(test_kernels_cpu_backend_table) {
  struct mr_backend *be = NULL;
  ck_assert_int_eq(mr_cpu_backend_new(2, &be), 0);
  ck_assert_str_eq(be->ops->name, "cpu");
  ck_assert_ptr_eq(be->ops->kernel_ctx(be), mr_cpu_backend_pool(be));
  float *d = NULL, host[100];
  ck_assert_int_eq(be->ops->alloc(be, 100 * sizeof(float), (void **)&d), 0);
  ck_assert_uint_eq((uintptr_t)d % 64, 0);
  struct mr_stream *s = NULL;
  struct mr_event *ev = NULL;
  ck_assert_int_eq(be->ops->stream_new(be, &s), 0);
  ck_assert_int_eq(be->ops->event_new(be, &ev), 0);
  struct fill_args a = {d, 100, 1.5f};
  ck_assert_int_eq(be->ops->launch(be, s, fill_kernel, &a), 0);
  ck_assert_int_eq(be->ops->event_record(be, ev, s), 0);
  ck_assert_int_eq(be->ops->stream_wait(be, NULL, ev), 0);
  ck_assert_int_eq(be->ops->event_synchronize(be, ev), 0);
  ck_assert_int_eq(be->ops->event_query(be, ev), 1);
  ck_assert_int_eq(be->ops->copy(be, s, host, d, sizeof host, MR_COPY_DEVICE_TO_HOST), 0);
  ck_assert_int_eq(be->ops->synchronize(be, NULL), 0);
  for (int i = 0; i < 100; i++)
    ck_assert_float_eq(host[i], 3.0f);
  ck_assert_int_eq(be->ops->memset(be, s, d, 0, 100 * sizeof(float)), 0);
  ck_assert_float_eq(d[99], 0.0f);
  be->ops->event_free(be, ev);
  be->ops->stream_free(be, s);
  be->ops->free(be, d);
  be->ops->free(be, NULL);
  mr_backend_free(be);
  mr_backend_free(NULL);
}
END_TEST

static Suite *kernels_optim_suite(void) {
  Suite *s = suite_create("kernels_optim");
  TCase *tc = tcase_create("optim");
  tcase_set_timeout(tc, 60);
  tcase_add_test(tc, test_kernels_adamw_matches_torch_formula);
  tcase_add_test(tc, test_kernels_sumsq_serial_and_thread_independent);
  tcase_add_test(tc, test_kernels_half_conversions_and_overflow_check);
  tcase_add_test(tc, test_kernels_pool_runs_every_task_once);
  tcase_add_test(tc, test_kernels_cpu_backend_table);
  suite_add_tcase(s, tc);
  return s;
}

MR_TEST_MAIN(kernels_optim_suite)
