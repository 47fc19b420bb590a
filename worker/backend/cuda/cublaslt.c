/* cublaslt.c - matmuls through cuBLASLt, with a cache of plans (descriptor,
 * layouts, chosen algorithm) per shape and alignment, and the module's own
 * GEMM where cuBLASLt has no algorithm for a shape.
 *
 * Row-major C = op(A) op(B) is computed as the column-major C^T = op(B)^T
 * op(A)^T: cuBLASLt's first operand is our B, its second our A. */
#include <cublasLt.h>
#include <stdlib.h>
#include <string.h>

#include "common/error.h"
#include "common/log.h"
#include "worker/backend/cuda/cuda_internal.h"

#define LT_PLANS 64
#define LT_WORKSPACE ((size_t)32 << 20)

struct lt_plan {
  int used;
  int ta, tb, dtype;
  int64_t M, N, K, lda, ldb, ldc;
  uint32_t align_a, align_b, align_c;
  uint64_t last;
  int have_algo;
  cublasLtMatmulDesc_t desc;
  cublasLtMatrixLayout_t la, lb, lc; // la: our B, lb: our A, lc: C
  cublasLtMatmulAlgo_t algo;
};

struct mr__cuda_lt {
  cublasLtHandle_t h;
  void *ws;
  size_t ws_bytes;
  uint64_t tick;
  int warned;
  struct lt_plan plans[LT_PLANS];
};

static int lt_check(cublasStatus_t st, const char *call) {
  if (st == CUBLAS_STATUS_SUCCESS)
    return 0;
  return mr_error_set(st == CUBLAS_STATUS_ALLOC_FAILED ? MR_ENOMEM : MR_EIO,
                      "cublasLt: %s: %s (%s)", call, cublasLtGetStatusName(st),
                      cublasLtGetStatusString(st));
}

#define LT_TRY(call) MR_TRY(lt_check((call), #call))

int mr__cuda_lt_new(struct mr__cuda_ctx *c, struct mr__cuda_lt **out) {
  *out = NULL;
  struct mr__cuda_lt *lt = calloc(1, sizeof *lt);
  if (lt == NULL)
    return mr_error_set(MR_ENOMEM, "cublasLt: out of host memory");
  int rc = lt_check(cublasLtCreate(&lt->h), "cublasLtCreate");
  if (rc == 0)
    rc = mr__cuda_pool_alloc(&c->be->pool, LT_WORKSPACE, &lt->ws);
  if (rc < 0) {
    if (lt->h != NULL)
      cublasLtDestroy(lt->h);
    free(lt);
    return rc;
  }
  lt->ws_bytes = LT_WORKSPACE;
  *out = lt;
  return 0;
}

static void plan_drop(struct lt_plan *p) {
  if (!p->used)
    return;
  if (p->la != NULL)
    cublasLtMatrixLayoutDestroy(p->la);
  if (p->lb != NULL)
    cublasLtMatrixLayoutDestroy(p->lb);
  if (p->lc != NULL)
    cublasLtMatrixLayoutDestroy(p->lc);
  if (p->desc != NULL)
    cublasLtMatmulDescDestroy(p->desc);
  memset(p, 0, sizeof *p);
}

void mr__cuda_lt_free(struct mr__cuda_ctx *c, struct mr__cuda_lt *lt) {
  if (lt == NULL)
    return;
  for (int i = 0; i < LT_PLANS; i++)
    plan_drop(&lt->plans[i]);
  mr__cuda_pool_free(&c->be->pool, lt->ws);
  cublasLtDestroy(lt->h);
  free(lt);
}

/* the largest power of two (<= 256) dividing the address */
static uint32_t alignment(const void *p) {
  uintptr_t u = (uintptr_t)p;
  uint32_t a = 256;
  while (a > 1 && (u % a) != 0)
    a >>= 1;
  return a;
}

static const cudaDataType_t lt_types[3] = {CUDA_R_32F, CUDA_R_16BF, CUDA_R_16F};

static int plan_build(struct mr__cuda_lt *lt, struct lt_plan *p) {
  cudaDataType_t t = lt_types[p->dtype];
  cublasOperation_t opa = p->tb ? CUBLAS_OP_T : CUBLAS_OP_N; /* on our B */
  cublasOperation_t opb = p->ta ? CUBLAS_OP_T : CUBLAS_OP_N; /* on our A */
  /* true fp32 for fp32 operands (CUBLAS_COMPUTE_32F never uses TF32);
   * 16-bit operands accumulate in fp32 */
  LT_TRY(cublasLtMatmulDescCreate(&p->desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  LT_TRY(cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_TRANSA, &opa,
                                        sizeof opa));
  LT_TRY(cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_TRANSB, &opb,
                                        sizeof opb));
  /* column-major views: our row-major B [rows, cols] is cols x rows */
  uint64_t b_rows = (uint64_t)(p->tb ? p->K : p->N), b_cols = (uint64_t)(p->tb ? p->N : p->K);
  uint64_t a_rows = (uint64_t)(p->ta ? p->M : p->K), a_cols = (uint64_t)(p->ta ? p->K : p->M);
  LT_TRY(cublasLtMatrixLayoutCreate(&p->la, t, b_rows, b_cols, p->ldb));
  LT_TRY(cublasLtMatrixLayoutCreate(&p->lb, t, a_rows, a_cols, p->lda));
  LT_TRY(cublasLtMatrixLayoutCreate(&p->lc, CUDA_R_32F, (uint64_t)p->N, (uint64_t)p->M,
                                    p->ldc));
  cublasLtMatmulPreference_t pref = NULL;
  LT_TRY(cublasLtMatmulPreferenceCreate(&pref));
  int rc = lt_check(cublasLtMatmulPreferenceSetAttribute(
                        pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &lt->ws_bytes,
                        sizeof lt->ws_bytes),
                    "cublasLtMatmulPreferenceSetAttribute");
  const struct {
    cublasLtMatmulPreferenceAttributes_t attr;
    uint32_t v;
  } aligns[] = {
      {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, p->align_b},
      {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, p->align_a},
      {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, p->align_c},
      {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, p->align_c},
  };
  for (size_t i = 0; i < MR_ARRAY_LEN(aligns) && rc == 0; i++)
    rc = lt_check(cublasLtMatmulPreferenceSetAttribute(pref, aligns[i].attr,
                                                       &aligns[i].v, sizeof aligns[i].v),
                  "cublasLtMatmulPreferenceSetAttribute");
  cublasLtMatmulHeuristicResult_t res;
  int found = 0;
  memset(&res, 0, sizeof res);
  if (rc == 0) {
    cublasStatus_t st = cublasLtMatmulAlgoGetHeuristic(lt->h, p->desc, p->la, p->lb,
                                                       p->lc, p->lc, pref, 1, &res,
                                                       &found);
    if (st != CUBLAS_STATUS_SUCCESS)
      found = 0; /* no algorithm for this shape: use the fallback */
  }
  cublasLtMatmulPreferenceDestroy(pref);
  MR_TRY(rc);
  p->have_algo = found > 0 && res.state == CUBLAS_STATUS_SUCCESS;
  if (p->have_algo)
    p->algo = res.algo;
  return 0;
}

static struct lt_plan *plan_get(struct mr__cuda_lt *lt, int ta, int tb, int64_t M,
                                int64_t N, int64_t K, int64_t lda, int64_t ldb,
                                int64_t ldc, int dtype, uint32_t al_a, uint32_t al_b,
                                uint32_t al_c, int *rc) {
  struct lt_plan *victim = &lt->plans[0];
  lt->tick++;
  for (int i = 0; i < LT_PLANS; i++) {
    struct lt_plan *p = &lt->plans[i];
    if (p->used && p->ta == ta && p->tb == tb && p->M == M && p->N == N &&
        p->K == K && p->lda == lda && p->ldb == ldb && p->ldc == ldc &&
        p->dtype == dtype && p->align_a == al_a && p->align_b == al_b &&
        p->align_c == al_c) {
      p->last = lt->tick;
      return p;
    }
    if (!p->used || (victim->used && p->last < victim->last))
      victim = p;
  }
  plan_drop(victim);
  struct lt_plan *p = victim;
  p->used = 1;
  p->ta = ta;
  p->tb = tb;
  p->M = M;
  p->N = N;
  p->K = K;
  p->lda = lda;
  p->ldb = ldb;
  p->ldc = ldc;
  p->dtype = dtype;
  p->align_a = al_a;
  p->align_b = al_b;
  p->align_c = al_c;
  p->last = lt->tick;
  *rc = plan_build(lt, p);
  if (*rc < 0) {
    plan_drop(p);
    return NULL;
  }
  return p;
}

int mr__cuda_matmul(struct mr__cuda_ctx *c, int ta, int tb, int64_t M, int64_t N,
                    int64_t K, const void *A, int64_t lda, const void *B,
                    int64_t ldb, float *C, int64_t ldc, int dtype, int accum) {
  cudaStream_t s = c->cur->s;
  if (M <= 0 || N <= 0)
    return 0;
  if (K <= 0) {
    for (int64_t r = 0; r < M && !accum; r++)
      MR_CUDA_TRY(cudaMemsetAsync(C + r * ldc, 0, (size_t)N * sizeof(float), s));
    return 0;
  }
  if (dtype < 0 || dtype > 2)
    return mr_error_set(MR_EINVAL, "matmul: dtype %d", dtype);
  struct mr__cuda_lt *lt = c->lt;
  int rc = 0;
  struct lt_plan *p = plan_get(lt, ta, tb, M, N, K, lda, ldb, ldc, dtype,
                               alignment(A), alignment(B), alignment(C), &rc);
  if (p == NULL)
    return rc;
  if (p->have_algo) {
    const float one = 1.0f, beta = accum ? 1.0f : 0.0f;
    cublasStatus_t st = cublasLtMatmul(lt->h, p->desc, &one, B, p->la, A, p->lb, &beta,
                                       C, p->lc, C, p->lc, &p->algo, lt->ws,
                                       lt->ws_bytes, s);
    if (st == CUBLAS_STATUS_SUCCESS)
      return 0;
    if (!lt->warned) {
      lt->warned = 1;
      MR_WARN("cuda", "cublasLtMatmul (%lldx%lldx%lld, dtype %d): %s; using the "
              "fallback GEMM for this shape", (long long)M, (long long)N,
              (long long)K, dtype, cublasLtGetStatusName(st));
    }
    p->have_algo = 0;
  }
  MR_CUDA_TRY(mr__k_gemm_fallback(s, ta, tb, M, N, K, A, lda, B, ldb, C, ldc, dtype, accum));
  return 0;
}
