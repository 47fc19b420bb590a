/* test_reshard.c - every pair of DistAttrs, on 1-D and 2-D meshes and
 * across meshes, planned and run by the simulated executor against the
 * unsharded tensor; the collectives chosen for the textbook cases; costs
 * worked out by hand. */
#include <check.h>
#include <stdlib.h>
#include <string.h>

#include "common/error.h"
#include "compiler/mesh.h"
#include "common/rng.h"
#include "compiler/spmd/reshard.h"
#include "tests/check_main.h"
#include "tests/spmd_sim.h"

/* placement choice i of 6 for 2-d tensors */
static struct mr_placement choice(int i) {
  switch (i) {
  case 0: return mr_replicate();
  case 1: return mr_shard(0);
  case 2: return mr_shard(1);
  case 3: return mr_partial(MR_REDUCE_SUM);
  case 4: return mr_partial(MR_REDUCE_AVG);
  default: return mr_partial(MR_REDUCE_MAX);
  }
}

static int attr_of(int code, int ndim, struct mr_dist_attr *d) {
  *d = mr_dist_replicated(ndim);
  for (int i = 0; i < ndim; i++) {
    d->p[i] = choice(code % 6);
    code /= 6;
  }
  return mr_dist_check(d, 2) == 0;
}

static uint32_t lcg(uint32_t *s) {
  *s = *s * 1664525u + 1013904223u;
  return *s >> 8;
}

static float frand(uint32_t *s) { return (float)(lcg(s) % 20001) / 10000.0f - 1.0f; }

/* Builds a sharded tensor with global value out (random operands when
 * src is Partial, so the reduction is exercised). */
static void make_src(struct sim_tensor *t, const struct mr_mesh *m,
                     const struct mr_dist_attr *src, const int64_t *shape,
                     uint32_t *seed, float *global) {
  int n = mr_mesh_size(m);
  int64_t ne = shape[0] * shape[1];
  float *ops = malloc(sizeof(float) * (size_t)(ne * n));
  const float *opp[SIM_MAX_RANKS];
  int partial = 0;
  for (int i = 0; i < src->ndim; i++)
    partial |= src->p[i].kind == MR_PARTIAL;
  /* operands must agree across non-partial replicas: derive each from the
   * coordinate on the Partial dims only */
  for (int r = 0; r < n; r++) {
    int c[MR_MESH_MAX_DIMS], key = 0;
    mr_mesh_coord(m, r, c);
    for (int i = 0; i < src->ndim; i++)
      if (src->p[i].kind == MR_PARTIAL)
        key = key * m->shape[i] + c[i];
    uint32_t s2 = *seed + 7919u * (uint32_t)key;
    for (int64_t e = 0; e < ne; e++)
      ops[r * ne + e] = frand(&s2);
    opp[r] = ops + r * ne;
  }
  *seed += 104729u;
  sim_scatter(t, m, src, 2, shape, NULL, opp);
  (void)partial;
  ck_assert(sim_gather(t, 2, shape, global) == 0);
  free(ops);
}

static void check_pair(const struct mr_mesh *a, const struct mr_mesh *b,
                       const struct mr_dist_attr *src,
                       const struct mr_dist_attr *dst, const int64_t *shape,
                       uint32_t *seed) {
  int64_t ne = shape[0] * shape[1];
  float *want = malloc(sizeof(float) * (size_t)ne);
  float *got = malloc(sizeof(float) * (size_t)ne);
  struct sim_tensor t;
  make_src(&t, a, src, shape, seed, want);
  struct mr_reshard_plan p;
  int rc = a == b ? mr_reshard_plan(a, 2, shape, 4, src, dst, NULL, NULL, &p)
                  : mr_reshard_plan_cross(a, b, 2, shape, 4, src, dst, NULL,
                                          NULL, &p);
  char s1[96], s2[96];
  mr_dist_format(src, s1, sizeof s1);
  mr_dist_format(dst, s2, sizeof s2);
  ck_assert_msg(rc == 0, "%s -> %s: %s", s1, s2, mr_error_message());
  for (int i = 0; i < p.n_steps; i++) {
    const struct mr_mesh *on = p.steps[i].on_dst ? b : a;
    ck_assert_msg(sim_step(&t, &p.steps[i], on) == 0, "%s -> %s step %d", s1,
                  s2, i);
    /* every intermediate is a valid sharding of the same tensor */
    double w = sim_gather(&t, 2, shape, got);
    ck_assert_msg(w >= 0 && w < 1e-5, "%s -> %s: step %d (%s) leaves %g", s1,
                  s2, i, mr_reshard_kind_name(p.steps[i].kind), w);
    ck_assert_msg(sim_rel_err(got, want, ne) <= 1e-5, "%s -> %s: step %d (%s)",
                  s1, s2, i, mr_reshard_kind_name(p.steps[i].kind));
  }
  /* Replicate -> Partial(avg|max) moves nothing: the replicas read as
   * operands must still give the tensor */
  for (int i = 0; i < t.da.ndim && i < dst->ndim; i++)
    if (t.da.p[i].kind == MR_REPLICATE && dst->p[i].kind == MR_PARTIAL &&
        dst->p[i].reduce != MR_REDUCE_SUM)
      t.da.p[i] = dst->p[i];
  ck_assert_msg(mr_dist_eq(&t.da, dst), "%s -> %s: ends elsewhere", s1, s2);
  ck_assert(sim_gather(&t, 2, shape, got) >= 0);
  ck_assert_msg(sim_rel_err(got, want, ne) <= 1e-5, "%s -> %s: final", s1, s2);
  ck_assert(t.mesh == b);
  sim_tensor_free(&t);
  free(want);
  free(got);
}

static void all_pairs(const char *spec, uint32_t seed) {
  struct mr_mesh m;
  ck_assert_int_eq(mr_mesh_parse(spec, &m), 0);
  int codes = 1;
  for (int i = 0; i < m.ndim; i++)
    codes *= 6;
  int pairs = 0;
  for (int x = 0; x < codes; x++)
    for (int y = 0; y < codes; y++) {
      struct mr_dist_attr s, d;
      if (!attr_of(x, m.ndim, &s) || !attr_of(y, m.ndim, &d))
        continue;
      /* random shapes, uneven splits included */
      int64_t shape[2] = {1 + (int64_t)(lcg(&seed) % 13),
                          1 + (int64_t)(lcg(&seed) % 11)};
      check_pair(&m, &m, &s, &d, shape, &seed);
      pairs++;
    }
  ck_assert_int_gt(pairs, codes);
}

START_TEST(test_reshard_all_pairs_1d) {
  all_pairs("x=2", 1);
  all_pairs("x=3", 2);
  all_pairs("x=4", 3);
}
END_TEST

START_TEST(test_reshard_all_pairs_2d) {
  all_pairs("data=2,model=2", 4);
  all_pairs("data=2,model=3", 5);
  all_pairs("data=2,model=4", 6);
}
END_TEST

START_TEST(test_reshard_all_pairs_across_meshes) {
  struct mr_mesh full, s0, s1, flat;
  ck_assert_int_eq(mr_mesh_parse("pipe=2,data=2,model=2", &full), 0);
  ck_assert_int_eq(mr_mesh_slice(&full, 0, 0, &s0), 0);
  ck_assert_int_eq(mr_mesh_slice(&full, 0, 1, &s1), 0);
  ck_assert_int_eq(mr_mesh_parse("model=4", &flat), 0);
  uint32_t seed = 9;
  for (int x = 0; x < 36; x++)
    for (int y = 0; y < 36; y++) {
      struct mr_dist_attr s, d, d1;
      if (!attr_of(x, 2, &s) || !attr_of(y, 2, &d))
        continue;
      int64_t shape[2] = {1 + (int64_t)(lcg(&seed) % 9),
                          1 + (int64_t)(lcg(&seed) % 9)};
      check_pair(&s0, &s1, &s, &d, shape, &seed);
      if (attr_of(y % 6, 1, &d1))
        check_pair(&s0, &flat, &s, &d1, shape, &seed);
    }
}
END_TEST

static const struct mr_reshard_plan *plan1(const char *mesh, const char *src,
                                           const char *dst, int64_t r, int64_t c) {
  static struct mr_reshard_plan p;
  static struct mr_mesh m;
  struct mr_dist_attr s, d;
  ck_assert_int_eq(mr_mesh_parse(mesh, &m), 0);
  ck_assert_int_eq(mr_dist_parse(src, m.ndim, &s), 0);
  ck_assert_int_eq(mr_dist_parse(dst, m.ndim, &d), 0);
  int64_t shape[2] = {r, c};
  ck_assert_int_eq(mr_reshard_plan(&m, 2, shape, 4, &s, &d, NULL, NULL, &p), 0);
  return &p;
}

START_TEST(test_reshard_textbook_collectives) {
  const struct mr_reshard_plan *p;
  /* Partial -> Shard: one ReduceScatter, (k-1)/k of the tensor */
  p = plan1("m=4", "Partial()", "Shard(0)", 16, 8);
  ck_assert_int_eq(p->n_steps, 1);
  ck_assert_int_eq(p->steps[0].kind, MR_RS_REDUCE_SCATTER);
  ck_assert_int_eq(p->bytes, 3 * 16 * 8 * 4 / 4);
  /* Partial -> Replicate: one AllReduce, 2(k-1)/k */
  p = plan1("m=4", "Partial()", "Replicate()", 16, 8);
  ck_assert_int_eq(p->n_steps, 1);
  ck_assert_int_eq(p->steps[0].kind, MR_RS_ALL_REDUCE);
  ck_assert_int_eq(p->bytes, 2 * 3 * 16 * 8 * 4 / 4);
  /* Shard(0) -> Shard(1): one AllToAll of the local piece */
  p = plan1("m=4", "Shard(0)", "Shard(1)", 16, 8);
  ck_assert_int_eq(p->n_steps, 1);
  ck_assert_int_eq(p->steps[0].kind, MR_RS_ALL_TO_ALL);
  ck_assert_int_eq(p->bytes, 3 * (4 * 8 * 4) / 4);
  /* Replicate -> Shard: a local slice, nothing on the wire */
  p = plan1("m=4", "Replicate()", "Shard(1)", 16, 8);
  ck_assert_int_eq(p->n_steps, 1);
  ck_assert_int_eq(p->steps[0].kind, MR_RS_SLICE);
  ck_assert_int_eq(p->bytes, 0);
  /* Shard -> Replicate: AllGather, each rank receives (k-1) pieces */
  p = plan1("m=4", "Shard(0)", "Replicate()", 16, 8);
  ck_assert_int_eq(p->steps[0].kind, MR_RS_ALL_GATHER);
  ck_assert_int_eq(p->bytes, 3 * 4 * 8 * 4);
  /* same placement: nothing */
  p = plan1("a=2,b=2", "[Shard(0), Partial()]", "[Shard(0), Partial()]", 4, 4);
  ck_assert_int_eq(p->n_steps, 0);
  /* only the mesh dim that differs communicates */
  p = plan1("a=2,b=4", "[Shard(0), Partial()]", "[Shard(0), Replicate()]", 8, 8);
  ck_assert_int_eq(p->n_steps, 1);
  ck_assert_int_eq(p->steps[0].mesh_dim, 1);
  ck_assert_int_eq(p->steps[0].group_size, 4);
  ck_assert_int_eq(p->bytes, 2 * 3 * (4 * 8 * 4) / 4);
}
END_TEST

static double slow_p2p(void *ctx, const struct mr_reshard_step *s) {
  (void)ctx;
  return (double)s->bytes * (s->kind == MR_RS_SEND_RECV ? 8.0 : 1.0);
}

START_TEST(test_reshard_stage_boundary_scatter_gather) {
  struct mr_mesh full, a, b;
  ck_assert_int_eq(mr_mesh_parse("pipe=2,model=4", &full), 0);
  ck_assert_int_eq(mr_mesh_slice(&full, 0, 0, &a), 0);
  ck_assert_int_eq(mr_mesh_slice(&full, 0, 1, &b), 0);
  struct mr_dist_attr r = mr_dist_replicated(1);
  int64_t shape[2] = {32, 16};
  struct mr_reshard_plan p;
  /* bytes only: the direct send (whole tensor) is as cheap as any */
  ck_assert_int_eq(mr_reshard_plan_cross(&a, &b, 2, shape, 4, &r, &r, NULL,
                                         NULL, &p), 0);
  ck_assert_int_eq(p.n_steps, 1);
  ck_assert_int_eq(p.steps[0].kind, MR_RS_SEND_RECV);
  ck_assert_int_eq(p.bytes, 32 * 16 * 4);
  /* a slow stage link: slice, send a quarter, AllGather on the next stage */
  ck_assert_int_eq(mr_reshard_plan_cross(&a, &b, 2, shape, 4, &r, &r, slow_p2p,
                                         NULL, &p), 0);
  ck_assert_int_eq(p.n_steps, 3);
  ck_assert_int_eq(p.steps[0].kind, MR_RS_SLICE);
  ck_assert_int_eq(p.steps[1].kind, MR_RS_SEND_RECV);
  ck_assert_int_eq(p.steps[1].bytes, 32 * 16 * 4 / 4);
  ck_assert_int_eq(p.steps[2].kind, MR_RS_ALL_GATHER);
  ck_assert_int_eq(p.steps[2].on_dst, 1);
  /* 8 * (N/4) + 3 * N/4 = 2.75 N against 8 N */
  ck_assert(p.cost == 8.0 * 512 + 3.0 * 512);
}
END_TEST

START_TEST(test_reshard_rejects_bad_attrs) {
  struct mr_mesh m;
  ck_assert_int_eq(mr_mesh_parse("m=2", &m), 0);
  struct mr_dist_attr s = mr_dist_replicated(1), d = mr_dist_replicated(2);
  int64_t shape[2] = {4, 4};
  struct mr_reshard_plan p;
  ck_assert_int_eq(mr_reshard_plan(&m, 2, shape, 4, &s, &d, NULL, NULL, &p),
                   MR_EINVAL);
  d = mr_dist_replicated(1);
  d.p[0] = mr_shard(3);
  ck_assert_int_eq(mr_reshard_plan(&m, 2, shape, 4, &s, &d, NULL, NULL, &p),
                   MR_EINVAL);
}
END_TEST

static Suite *reshard_suite(void) {
  Suite *s = suite_create("reshard");
  TCase *tc = tcase_create("core");
  tcase_set_timeout(tc, 60);
  tcase_add_test(tc, test_reshard_all_pairs_1d);
  tcase_add_test(tc, test_reshard_all_pairs_2d);
  tcase_add_test(tc, test_reshard_all_pairs_across_meshes);
  tcase_add_test(tc, test_reshard_textbook_collectives);
  tcase_add_test(tc, test_reshard_stage_boundary_scatter_gather);
  tcase_add_test(tc, test_reshard_rejects_bad_attrs);
  suite_add_tcase(s, tc);
  return s;
}

MR_TEST_MAIN(reshard_suite)
