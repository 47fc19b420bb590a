/* test_ckpt.c - checkpoints and recovery end to end: ranks killed at random
 * moments (during a checkpoint write too) and the job's final weights
 * bitwise those of an uninterrupted run; corrupt and half-written
 * checkpoints never loaded; SIGTERM preemption; resume on another world
 * size. */
#include <check.h>
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cjson/cJSON.h>

#include "check_main.h"
#include "common/checksum.h"
#include "common/ckpt.h"
#include "common/ckpt_read.h"
#include "common/error.h"
#include "common/jsonv.h"
#include "common/safetensors.h"
#include "testutil.h"

static int tie_embeddings; /* the next jobs' model ties its embeddings */
static int gpt2;           /* the next jobs' model is a GPT-2 */

static void write_job_s(const char *dir, const char *name, int steps, int every,
                        const char *ckpt, const char *strategy) {
  char path[200];
  snprintf(path, sizeof path, "%s/%s", dir, name);
  FILE *f = fopen(path, "w");
  fprintf(f, "{\"model\": %s%s},",
          gpt2 ? "{\"model_type\": \"gpt2\", \"vocab_size\": 128, \"n_embd\": 64, \"n_layer\": 2,"
                 " \"n_head\": 4, \"n_positions\": 64"
               : "{\"model_type\": \"llama\", \"vocab_size\": 128, \"hidden_size\": 64,"
                 " \"intermediate_size\": 128, \"num_hidden_layers\": 2, \"num_attention_heads\": 4,"
                 " \"num_key_value_heads\": 2, \"max_position_embeddings\": 64",
          tie_embeddings ? ", \"tie_word_embeddings\": true" : "");
  fprintf(f,
          " \"data\": {\"train\": \"train.bin\"},"
          " \"train\": {\"steps\": %d, \"global_batch\": 4, \"seq_len\": 32, \"lr\": 0.01, \"seed\": 5},"
          " \"checkpoint\": {\"dir\": \"%s\", \"save_interval_steps\": %d, \"keep_last\": 2},"
          " \"strategy\": {%s}}\n",
          steps, ckpt, every, strategy);
  fclose(f);
}

static void write_job(const char *dir, const char *name, int steps, int every,
                      const char *ckpt) {
  write_job_s(dir, name, steps, every, ckpt, "");
}

static void start(struct mr_tproc *p, const char *dir, const char *job, const char *run,
                  int nproc, int restarts, char *const env[]) {
  static char jobp[200], logdir[200], n[8], r[8];
  snprintf(jobp, sizeof jobp, "%s/%s", dir, job);
  snprintf(logdir, sizeof logdir, "%s/%s", dir, run);
  snprintf(n, sizeof n, "%d", nproc);
  snprintf(r, sizeof r, "%d", restarts);
  char *argv[] = {(char *)mr_t_meshrun(), "launch", "--nproc", n, "--threads", "1",
                  "--max-restarts", r, "--log-dir", logdir, jobp, NULL};
  mr_t_spawn(p, dir, argv, env);
}

static int run_to_end(const char *dir, const char *job, const char *run, int nproc) {
  struct mr_tproc p;
  start(&p, dir, job, run, nproc, 0, NULL);
  int code = mr_t_wait(&p, 120);
  if (code != 0) {
    char *err = mr_t_slurp(p.err_path);
    fprintf(stderr, "%s failed (%d):\n%s\n", run, code, err);
    free(err);
  }
  return code;
}

static void setup(char *dir, size_t n) {
  mr_t_tmpdir(dir, n);
  char data[160];
  snprintf(data, sizeof data, "%s/train.bin", dir);
  mr_t_write_tokens(data, 40000);
}

START_TEST(test_ckpt_killed_ranks_resume_bitwise) {
  char dir[64];
  setup(dir, sizeof dir);
  write_job(dir, "ref.json", 24, 3, "ck-ref");
  write_job(dir, "faulty.json", 24, 3, "ck-faulty");
  ck_assert_int_eq(run_to_end(dir, "ref.json", "ref", 2), 0);

  /* five kills of a random rank at random moments; the third lands while a
   * checkpoint write is paused half way (rank 0 writes the files) */
  static char delay[] = "MESHRUN_TEST_CKPT_DELAY_MS=150";
  char *env[] = {delay, NULL};
  struct mr_tproc p;
  start(&p, dir, "faulty.json", "faulty", 2, 10, env);
  srand(12345);
  int kills = 0;
  char ckroot[160];
  snprintf(ckroot, sizeof ckroot, "%s/ck-faulty", dir);
  char metrics[200];
  snprintf(metrics, sizeof metrics, "%s/faulty/metrics.jsonl", dir);
  int64_t at_step = 1;
  while (kills < 5) {
    /* let the restarted group make progress first: a random step ahead */
    at_step += 2 + rand() % 4;
    if (at_step > 22)
      break;
    char want[64];
    snprintf(want, sizeof want, "\"step\": %lld, ", (long long)at_step);
    char tag[32];
    snprintf(tag, sizeof tag, "\"restart\": %d}", kills);
    int reached = 0;
    for (double end = mr_t_now() + 60; !reached && mr_t_now() < end;) {
      char *m = mr_t_slurp(metrics);
      for (char *line = strstr(m, want); line != NULL && !reached; line = strstr(line + 1, want)) {
        char *eol = strchr(line, '\n');
        char *t = strstr(line, tag);
        reached = t != NULL && (eol == NULL || t < eol);
      }
      free(m);
      if (!reached)
        usleep(2000);
    }
    ck_assert_msg(reached, "step %lld of restart %d never came", (long long)at_step, kills);
    usleep((useconds_t)(1000 * (rand() % 40)));
    pid_t kids[8];
    int n = mr_t_children(p.pid, kids, 8);
    if (n < 1)
      break;
    if (kills == 2) {
      /* wait for a step folder with rank 0's file but no marker yet */
      int caught = 0;
      for (int tries = 0; tries < 3000 && !caught; tries++) {
        for (int st = 3; st <= 24 && !caught; st += 3) {
          char d[200], f[260], mk[260];
          mr_ckpt_step_dir(ckroot, st, d, sizeof d);
          snprintf(f, sizeof f, "%s/rank-0.safetensors", d);
          snprintf(mk, sizeof mk, "%s/COMPLETE", d);
          caught = access(f, F_OK) == 0 && access(mk, F_OK) != 0;
        }
        if (!caught)
          usleep(1000);
      }
      ck_assert_msg(caught, "never saw a checkpoint half written");
      n = mr_t_children(p.pid, kids, 8);
      ck_assert_int_ge(n, 1);
      kill(kids[0], SIGKILL);
    } else {
      kill(kids[rand() % n], SIGKILL);
    }
    kills++;
  }
  int code = mr_t_wait(&p, 120);
  char *err = mr_t_slurp(p.err_path);
  ck_assert_msg(code == 0, "the faulty run failed (%d):\n%s", code, err);
  ck_assert_msg(kills == 5, "only %d kills landed", kills);
  ck_assert_ptr_nonnull(strstr(err, "restarting the group"));
  ck_assert_ptr_nonnull(strstr(err, "resuming from"));
  free(err);
  char a[200], b[200];
  snprintf(a, sizeof a, "%s/ref/model.safetensors", dir);
  snprintf(b, sizeof b, "%s/faulty/model.safetensors", dir);
  ck_assert_msg(mr_t_same_file(a, b), "final weights differ from the uninterrupted run");
}
END_TEST

#ifndef __SANITIZE_ADDRESS__ /* a minute of restarts there; the kills' paths are
                              * test_ckpt_killed_ranks_resume_bitwise's */
/* Each step's loss record of metrics file `path` (as printed: %.9g, so a
 * float's every bit) into loss[step] (1..max); returns the number of
 * records, and fails the test where one step's records differ. */
static int step_losses(const char *path, char loss[][32], int max) {
  char *m = mr_t_slurp(path);
  int n = 0;
  char *save = NULL;
  for (char *line = strtok_r(m, "\n", &save); line != NULL; line = strtok_r(NULL, "\n", &save)) {
    char *st = strstr(line, "\"step\": "), *l = strstr(line, "\"loss\": ");
    if (st == NULL || l == NULL)
      continue;
    int step = atoi(st + 8);
    ck_assert_int_ge(step, 1);
    ck_assert_int_le(step, max);
    char v[32];
    snprintf(v, sizeof v, "%.*s", (int)strcspn(l + 8, ",}"), l + 8);
    if (loss[step][0] == '\0')
      snprintf(loss[step], sizeof loss[step], "%s", v);
    ck_assert_msg(strcmp(loss[step], v) == 0, "%s: step %d's loss %s, and %s before", path,
                  step, v, loss[step]);
    n++;
  }
  free(m);
  return n;
}

/* Waits up to a minute for a step record of group restart `restart`
 * past the first `from` bytes of the metrics (the group running again);
 * returns the size read. */
static long metrics_grown(const char *path, long from, int restart) {
  char tag[32];
  snprintf(tag, sizeof tag, "\"restart\": %d}", restart);
  for (double end = mr_t_now() + 60; mr_t_now() < end; usleep(2000)) {
    char *m = mr_t_slurp(path);
    long n = (long)strlen(m);
    int found = n > from && strstr(m + from, tag) != NULL;
    free(m);
    if (found)
      return n;
  }
  ck_abort_msg("%s: no step of restart %d within 60 s", path, restart);
  return -1;
}

/* Waits for a checkpoint being written: a step folder with a rank's file
 * and no COMPLETE yet; returns whether it saw one. */
static int save_in_flight(const char *ckroot, int steps, int every) {
  for (int tries = 0; tries < 3000; tries++, usleep(1000))
    for (int st = every; st <= steps; st += every) {
      char d[200], f[260], mk[260];
      mr_ckpt_step_dir(ckroot, st, d, sizeof d);
      snprintf(f, sizeof f, "%s/rank-0.safetensors", d);
      snprintf(mk, sizeof mk, "%s/COMPLETE", d);
      if (access(f, F_OK) == 0 && access(mk, F_OK) != 0)
        return 1;
    }
  return 0;
}

/* Chaos, bounded: twelve SIGKILLs of one to three of the four ranks of a
 * dp2 x tp2 job at random moments, every third while a checkpoint is
 * being written, and, half way, of the launcher itself, followed by the
 * same command again.  Every loss any run logged is bitwise the
 * uninterrupted run's for that step, and so are the final weights. */
START_TEST(test_ckpt_chaos_kills_resume_bitwise) {
  enum { STEPS = 60, EVERY = 3, KILLS = 12 };
  const char *s = "\"auto_mode\": \"manual\", \"data_parallel\": {\"degree\": 2}, "
                  "\"tensor_parallel\": {\"degree\": 2}";
  char dir[64];
  setup(dir, sizeof dir);
  write_job_s(dir, "ref.json", STEPS, EVERY, "ck-ref", s);
  write_job_s(dir, "chaos.json", STEPS, EVERY, "ck-chaos", s);
  ck_assert_int_eq(run_to_end(dir, "ref.json", "ref", 4), 0);
  static char delay[] = "MESHRUN_TEST_CKPT_DELAY_MS=40"; /* saves in flight for a while */
  char *env[] = {delay, NULL};
  char metrics[200], ckroot[160];
  snprintf(metrics, sizeof metrics, "%s/chaos/metrics.jsonl", dir);
  snprintf(ckroot, sizeof ckroot, "%s/ck-chaos", dir);
  struct mr_tproc p;
  start(&p, dir, "chaos.json", "chaos", 4, 3 * KILLS, env);
  srand(4242);
  int kills = 0, ranks_killed = 0, during_saves = 0, launcher_killed = 0, restart = 0;
  long seen = metrics_grown(metrics, 0, 0);
  while (kills < KILLS) {
    usleep((useconds_t)(1000 * (rand() % 30)));
    if (kills % 3 == 2)
      during_saves += save_in_flight(ckroot, STEPS, EVERY);
    pid_t kids[8];
    int n = mr_t_children(p.pid, kids, 8);
    if (n < 4)
      break; /* the job ended (or is between groups): no kill to land */
    if (kills == KILLS / 2 && !launcher_killed) {
      kill(p.pid, SIGKILL);
      mr_t_wait(&p, 30);
      for (int i = 0; i < n; i++) { /* its workers end with it */
        for (double end = mr_t_now() + 5; !mr_t_gone(kids[i]) && mr_t_now() < end;)
          usleep(2000);
        ck_assert_msg(mr_t_gone(kids[i]), "worker %d outlived its launcher", kids[i]);
      }
      launcher_killed = 1;
      restart = -1; /* the same command again: its first group is restart 0 */
      start(&p, dir, "chaos.json", "chaos", 4, 3 * KILLS, env);
    } else {
      int k = 1 + rand() % 3;
      for (int i = 0; i < k; i++) { /* k distinct ranks */
        int j = i + rand() % (n - i);
        pid_t t = kids[i];
        kids[i] = kids[j], kids[j] = t;
        kill(kids[i], SIGKILL);
      }
      ranks_killed += k;
    }
    kills++;
    seen = metrics_grown(metrics, seen, ++restart);
  }
  int code = mr_t_wait(&p, 180);
  char *err = mr_t_slurp(p.err_path);
  ck_assert_msg(code == 0, "the chaos run failed (%d):\n%s", code, err);
  free(err);
  ck_assert_msg(kills == KILLS && launcher_killed && during_saves >= 2,
                "only %d kills (%d during saves, launcher %d) landed", kills, during_saves,
                launcher_killed);
  char ref[STEPS + 1][32], got[STEPS + 1][32];
  memset(ref, 0, sizeof ref);
  char rm[200];
  snprintf(rm, sizeof rm, "%s/ref/metrics.jsonl", dir);
  ck_assert_int_eq(step_losses(rm, ref, STEPS), STEPS);
  /* the chaos run's records, steps trained again after each restart
   * included, against the reference's: one table for both */
  memcpy(got, ref, sizeof got);
  int records = step_losses(metrics, got, STEPS);
  ck_assert_int_gt(records, STEPS); /* steps were trained again */
  char a[200], b[200];
  snprintf(a, sizeof a, "%s/ref/model.safetensors", dir);
  snprintf(b, sizeof b, "%s/chaos/model.safetensors", dir);
  ck_assert_msg(mr_t_same_file(a, b), "final weights differ from the uninterrupted run");
  fprintf(stderr, "# chaos: %d kills (%d ranks, %d during a save, the launcher once), %d loss "
          "records, every one the uninterrupted run's\n", kills, ranks_killed, during_saves,
          records);
}
END_TEST
#endif

/* A rank killed mid-run leaves its peers blocked in a collective on it:
 * the launcher's stop breaks their waits off, so the group stops at once
 * instead of after the 3 s stop grace (and a SIGKILL), and restarts from
 * its checkpoint to the end.  The goal is 0.5 s; 1 s leaves room for the
 * sanitizers on a busy machine. */
START_TEST(test_ckpt_killed_rank_group_stops_at_once) {
  char dir[64];
  setup(dir, sizeof dir);
  write_job(dir, "job.json", 400, 4, "ck");
  struct mr_tproc p;
  start(&p, dir, "job.json", "run", 4, 1, NULL);
  char metrics[200];
  snprintf(metrics, sizeof metrics, "%s/run/metrics.jsonl", dir);
  ck_assert_msg(mr_t_wait_for_text(metrics, "\"step\": 10, ", 60) >= 0, "step 10 never came");
  pid_t kids[8];
  ck_assert_int_eq(mr_t_children(p.pid, kids, 8), 4);
  kill(kids[2], SIGKILL);
  int code = mr_t_wait(&p, 120);
  char *err = mr_t_slurp(p.err_path);
  ck_assert_msg(code == 0, "exit %d:\n%s", code, err);
  const char *at = strstr(err, "it stopped in ");
  ck_assert_msg(at != NULL, "%s", err);
  double stop_s = strtod(at + strlen("it stopped in "), NULL);
  fprintf(stderr, "# the group stopped %.2f s after the launcher saw rank 2 killed\n", stop_s);
  ck_assert_msg(stop_s < 1.0, "the group took %.2f s to stop:\n%s", stop_s, err);
  ck_assert_msg(strstr(err, "workers still running after") == NULL, "%s", err);
  ck_assert_msg(strstr(err, "timed out") == NULL, "a stopped rank reported its wait:\n%s", err);
  free(err);
}
END_TEST

START_TEST(test_ckpt_corrupt_or_incomplete_checkpoint_skipped) {
  char dir[64];
  setup(dir, sizeof dir);
  write_job(dir, "a.json", 6, 2, "ck");
  ck_assert_int_eq(run_to_end(dir, "a.json", "a", 1), 0);
  char ck[160], d6[200], d4[200], f[260];
  snprintf(ck, sizeof ck, "%s/ck", dir);
  mr_ckpt_step_dir(ck, 6, d6, sizeof d6);
  mr_ckpt_step_dir(ck, 4, d4, sizeof d4);
  int64_t step;
  ck_assert_int_eq(mr_ckpt_verify(d6, &step), 0);
  ck_assert_int_eq(step, 6);
  /* flip one byte of the newest checkpoint's data */
  snprintf(f, sizeof f, "%s/rank-0.safetensors", d6);
  FILE *fp = fopen(f, "r+b");
  fseek(fp, -5, SEEK_END);
  int ch = fgetc(fp);
  fseek(fp, -5, SEEK_END);
  fputc(ch ^ 0x40, fp);
  fclose(fp);
  ck_assert_int_eq(mr_ckpt_verify(d6, &step), MR_EFORMAT);
  /* an incomplete one, newer still: files but no marker */
  char d8[200];
  mr_ckpt_step_dir(ck, 8, d8, sizeof d8);
  mkdir(d8, 0755);
  char junk[260];
  snprintf(junk, sizeof junk, "%s/rank-0.safetensors", d8);
  fclose(fopen(junk, "w"));
  write_job(dir, "b.json", 8, 0, "ck");
  struct mr_tproc p;
  start(&p, dir, "b.json", "b", 1, 0, NULL);
  ck_assert_int_eq(mr_t_wait(&p, 60), 0);
  char *err = mr_t_slurp(p.err_path);
  ck_assert_msg(strstr(err, "step-00000008: no completion marker") != NULL, "%s", err);
  ck_assert_msg(strstr(err, "checksum mismatch") != NULL, "%s", err);
  ck_assert_msg(strstr(err, "resuming from") != NULL && strstr(err, "step-00000004") != NULL,
                "%s", err);
  free(err);
  /* resumed from step 4: the log shows steps 5..8 only */
  char metrics[200];
  snprintf(metrics, sizeof metrics, "%s/b/metrics.jsonl", dir);
  double loss[16];
  ck_assert_int_eq(mr_t_read_losses(metrics, loss, 16), 4);
}
END_TEST

/* Every complete checkpoint corrupt: the launch refuses (exit 2, naming
 * the folder) before any rank starts, instead of training from step 1
 * over them; the checkpoints are left as they were. */
START_TEST(test_ckpt_all_corrupt_refused_before_any_rank) {
  char dir[64];
  setup(dir, sizeof dir);
  write_job(dir, "a.json", 4, 2, "ck");
  ck_assert_int_eq(run_to_end(dir, "a.json", "a", 1), 0);
  char ck[160];
  snprintf(ck, sizeof ck, "%s/ck", dir);
  for (int s = 2; s <= 4; s += 2) { /* one byte of each one's data flipped */
    char d[200], f[260];
    mr_ckpt_step_dir(ck, s, d, sizeof d);
    snprintf(f, sizeof f, "%s/rank-0.safetensors", d);
    FILE *fp = fopen(f, "r+b");
    ck_assert_ptr_nonnull(fp);
    fseek(fp, -5, SEEK_END);
    int ch = fgetc(fp);
    fseek(fp, -5, SEEK_END);
    fputc(ch ^ 0x40, fp);
    fclose(fp);
  }
  write_job(dir, "b.json", 8, 2, "ck");
  struct mr_tproc p;
  start(&p, dir, "b.json", "b", 1, 0, NULL);
  ck_assert_int_eq(mr_t_wait(&p, 60), 2);
  char *err = mr_t_slurp(p.err_path);
  ck_assert_msg(strstr(err, "none of its 2 complete checkpoints is intact") != NULL &&
                    strstr(err, "checksum mismatch") != NULL, "%s", err);
  free(err);
  char log[200];
  snprintf(log, sizeof log, "%s/b/rank-0.log", dir);
  ck_assert_msg(access(log, F_OK) != 0, "a rank started: %s exists", log);
  for (int s = 2; s <= 4; s += 2) {
    char d[200];
    int64_t step;
    mr_ckpt_step_dir(ck, s, d, sizeof d);
    ck_assert_int_eq(mr_ckpt_verify(d, &step), MR_EFORMAT); /* still there, as it was */
  }
}
END_TEST

/* A job launched again after it finished: it says it is complete at its
 * last step and exits 0 at once, no rank started. */
START_TEST(test_ckpt_finished_job_relaunched_exits_at_once) {
  char dir[64];
  setup(dir, sizeof dir);
  write_job(dir, "a.json", 4, 2, "ck");
  ck_assert_int_eq(run_to_end(dir, "a.json", "a", 2), 0);
  struct mr_tproc p;
  double t0 = mr_t_now();
  start(&p, dir, "a.json", "again", 2, 0, NULL);
  ck_assert_int_eq(mr_t_wait(&p, 60), 0);
  double took = mr_t_now() - t0;
  char *out = mr_t_slurp(p.out_path);
  ck_assert_msg(strstr(out, "the job is complete: ") != NULL &&
                    strstr(out, "step-00000004 is of step 4, and train.steps is 4") != NULL,
                "%s", out);
  free(out);
  char log[200];
  snprintf(log, sizeof log, "%s/again/rank-0.log", dir);
  ck_assert_msg(access(log, F_OK) != 0, "a rank started: %s exists", log);
  ck_assert_msg(took < 5, "the relaunch took %.1f s", took);
}
END_TEST

/* Launches dir/job.json with 3 restarts allowed: exit 2 before any rank
 * starts (no rank log), stderr holding want. */
static void refused_before_any_rank(const char *dir, const char *want) {
  struct mr_tproc p;
  char run[32];
  static int seq;
  snprintf(run, sizeof run, "bad%d", ++seq);
  start(&p, dir, "job.json", run, 2, 3, NULL);
  int code = mr_t_wait(&p, 60);
  char *err = mr_t_slurp(p.err_path);
  ck_assert_msg(code == 2 && strstr(err, want) != NULL, "exit %d, want \"%s\":\n%s", code,
                want, err);
  free(err);
  char log[200];
  snprintf(log, sizeof log, "%s/%s/rank-0.log", dir, run);
  ck_assert_msg(access(log, F_OK) != 0, "a rank started: %s exists", log);
}

/* Bad data is the launcher's to name, before any rank spends a restart
 * on it: a missing token file, one cut short of its header's count, one
 * with a token past the vocabulary (128). */
START_TEST(test_ckpt_bad_data_refused_before_any_rank) {
  char dir[64], data[160];
  mr_t_tmpdir(dir, sizeof dir);
  write_job(dir, "job.json", 4, 0, "ck");
  refused_before_any_rank(dir, "job.json: data.train: ");
  snprintf(data, sizeof data, "%s/train.bin", dir);
  mr_t_write_tokens(data, 40000);
  ck_assert_int_eq(truncate(data, 1024 + 2 * 30000), 0);
  refused_before_any_rank(dir, "job.json: data.train: ");
  mr_t_write_tokens(data, 40000);
  FILE *f = fopen(data, "r+b");
  ck_assert_ptr_nonnull(f);
  uint16_t big = 200;
  fseek(f, 1024 + 2 * 12345, SEEK_SET);
  fwrite(&big, 2, 1, f);
  fclose(f);
  refused_before_any_rank(dir, "200");
}
END_TEST

/* A save that cannot be written (here: past the file-size limit, EFBIG; a
 * full disk is ENOSPC through the same path) fails its rank at once, naming
 * the file, not at the next save; the last complete checkpoint stays, and a
 * launch after it resumes from there to the uninterrupted run's weights. */
START_TEST(test_ckpt_failed_save_fails_at_once_and_keeps_the_last) {
  char dir[64];
  setup(dir, sizeof dir);
  write_job(dir, "ref.json", 40, 0, "ck-ref");
  write_job(dir, "ten.json", 10, 10, "ck");
  write_job(dir, "all.json", 40, 10, "ck");
  ck_assert_int_eq(run_to_end(dir, "ref.json", "ref", 2), 0);
  ck_assert_int_eq(run_to_end(dir, "ten.json", "ten", 2), 0);

  /* every rank's shard is larger than the limit, the logs are not (the
   * limit applies to shared-memory segments too: the ranks talk over TCP) */
  static char slow[] = "MESHRUN_TEST_SLOW=0:20", tcp[] = "MESHRUN_COMM_TRANSPORT=tcp";
  char *env[] = {slow, tcp, NULL};
  struct rlimit old, lim;
  ck_assert_int_eq(getrlimit(RLIMIT_FSIZE, &old), 0);
  lim = old;
  lim.rlim_cur = 128 * 1024;
  ck_assert_int_eq(setrlimit(RLIMIT_FSIZE, &lim), 0);
  struct mr_tproc p;
  start(&p, dir, "all.json", "full", 2, 0, env);
  ck_assert_int_eq(setrlimit(RLIMIT_FSIZE, &old), 0);
  int code = mr_t_wait(&p, 120);
  char *err = mr_t_slurp(p.err_path);
  ck_assert_msg(code == 1, "exit %d:\n%s", code, err);
  ck_assert_msg(strstr(err, "checkpoint of step 20") != NULL &&
                    strstr(err, "step-00000020/rank-") != NULL &&
                    strstr(err, "File too large") != NULL,
                "%s", err);
  free(err);
  /* resumed at 11; failed within a few steps of the save at 20, long before
   * the next save (30) would have waited for it */
  char metrics[200];
  snprintf(metrics, sizeof metrics, "%s/full/metrics.jsonl", dir);
  double loss[64];
  int n = mr_t_read_losses(metrics, loss, 64);
  ck_assert_msg(n >= 10 && n < 15, "%d steps after step 10 (the save at 20 failed)", n);
  char ck[160], d10[200], d20[200], mk[260];
  snprintf(ck, sizeof ck, "%s/ck", dir);
  mr_ckpt_step_dir(ck, 10, d10, sizeof d10);
  mr_ckpt_step_dir(ck, 20, d20, sizeof d20);
  int64_t step;
  ck_assert_int_eq(mr_ckpt_verify(d10, &step), 0);
  ck_assert_int_eq(step, 10);
  snprintf(mk, sizeof mk, "%s/COMPLETE", d20);
  ck_assert_int_ne(access(mk, F_OK), 0);

  ck_assert_int_eq(run_to_end(dir, "all.json", "again", 2), 0);
  char a[200], b[200];
  snprintf(a, sizeof a, "%s/ref/model.safetensors", dir);
  snprintf(b, sizeof b, "%s/again/model.safetensors", dir);
  ck_assert_msg(mr_t_same_file(a, b), "final weights differ from the uninterrupted run");
}
END_TEST

/* A checkpoint folder that cannot be made or written is refused before
 * any rank starts (exit 2, the job file and field named), not at the
 * first save. */
START_TEST(test_ckpt_unwritable_dir_refused_at_launch) {
  char dir[64];
  setup(dir, sizeof dir);
  static const char *const bad[][2] = {{"/proc/meshrun-nope/ck", "No such file or directory"},
                                       {"train.bin/ck", "Not a directory"}};
  for (int i = 0; i < 2; i++) {
    char name[32], run[32];
    snprintf(name, sizeof name, "bad%d.json", i);
    snprintf(run, sizeof run, "bad%d", i);
    write_job(dir, name, 4, 2, bad[i][0]);
    struct mr_tproc p;
    start(&p, dir, name, run, 2, 0, NULL);
    int code = mr_t_wait(&p, 60);
    char *err = mr_t_slurp(p.err_path), want[300];
    snprintf(want, sizeof want, "%s: checkpoint.dir: mkdir ", name);
    ck_assert_msg(code == 2 && strstr(err, want) != NULL && strstr(err, bad[i][1]) != NULL,
                  "exit %d:\n%s", code, err);
    free(err);
    char log[300];
    snprintf(log, sizeof log, "%s/%s/rank-0.log", dir, run);
    ck_assert_msg(access(log, F_OK) != 0, "a rank started: %s", log);
  }
}
END_TEST

START_TEST(test_ckpt_sigterm_checkpoints_and_exits_143) {
  char dir[64];
  setup(dir, sizeof dir);
  write_job(dir, "long.json", 100000, 0, "ck");
  struct mr_tproc p;
  /* the bound is the optimized build's; a sanitized debug build on a busy
   * machine gets ten times the launcher's grace and the test's limit */
#ifdef __SANITIZE_ADDRESS__
  static char grace[] = "MESHRUN_PREEMPT_GRACE_MS=40000";
  char *env[] = {grace, NULL};
  const double limit = 50.0;
#else
  char **env = NULL;
  const double limit = 5.0;
#endif
  start(&p, dir, "long.json", "run", 2, 0, env);
  char metrics[200];
  snprintf(metrics, sizeof metrics, "%s/run/metrics.jsonl", dir);
  ck_assert(mr_t_wait_for_text(metrics, "\"step\": 3,", 60) >= 0);
  double t0 = mr_t_now();
  kill(p.pid, SIGTERM);
  int code = mr_t_wait(&p, limit + 30);
  double took = mr_t_now() - t0;
  char *err = mr_t_slurp(p.err_path);
  ck_assert_msg(code == 128 + SIGTERM, "exit %d:\n%s", code, err);
  ck_assert_msg(took < limit, "took %.2f s", took);
  ck_assert_ptr_nonnull(strstr(err, "stopping for preemption"));
  free(err);
  char ck[160], latest[4096];
  snprintf(ck, sizeof ck, "%s/ck", dir);
  int64_t step;
  ck_assert_int_eq(mr_ckpt_find_latest(ck, latest, sizeof latest, &step), 1);
  ck_assert_int_ge(step, 3);
  /* the relaunch continues from it */
  write_job(dir, "more.json", (int)step + 2, 0, "ck");
  start(&p, dir, "more.json", "run2", 2, 0, NULL);
  ck_assert_int_eq(mr_t_wait(&p, 60), 0);
  snprintf(metrics, sizeof metrics, "%s/run2/metrics.jsonl", dir);
  char want[32];
  snprintf(want, sizeof want, "\"step\": %lld,", (long long)step + 1);
  char *m = mr_t_slurp(metrics);
  ck_assert_msg(strstr(m, want) != NULL && strstr(m, "\"step\": 1,") == NULL, "%s", m);
  free(m);
}
END_TEST

/* SIGUSR1 (Slurm's --signal warning before a time limit), sent to the
 * launcher and every worker as a step's processes get it: a complete
 * checkpoint of a step no interval asked for, every rank alive and
 * training on past it; SIGTERM then stops the job at a later one. */
START_TEST(test_ckpt_sigusr1_checkpoints_and_goes_on) {
  char dir[64];
  setup(dir, sizeof dir);
  write_job(dir, "long.json", 100000, 0, "ck");
  struct mr_tproc p;
  start(&p, dir, "long.json", "run", 2, 0, NULL);
  char metrics[200], ck[160], latest[4096];
  snprintf(metrics, sizeof metrics, "%s/run/metrics.jsonl", dir);
  snprintf(ck, sizeof ck, "%s/ck", dir);
  ck_assert(mr_t_wait_for_text(metrics, "\"step\": 3,", 60) >= 0);
  pid_t kids[8];
  int n = mr_t_children(p.pid, kids, 8);
  ck_assert_int_eq(n, 2);
  kill(p.pid, SIGUSR1);
  for (int i = 0; i < n; i++)
    kill(kids[i], SIGUSR1);
  ck_assert(mr_t_wait_for_text(p.err_path, "complete:", 60) >= 0);
  int64_t step;
  ck_assert_int_eq(mr_ckpt_find_latest(ck, latest, sizeof latest, &step), 1);
  ck_assert_int_ge(step, 3);
  char want[32];
  snprintf(want, sizeof want, "\"step\": %lld,", (long long)step + 5);
  ck_assert_msg(mr_t_wait_for_text(metrics, want, 60) >= 0, "no step %lld after the checkpoint",
                (long long)step + 5);
  ck_assert_int_eq(mr_t_children(p.pid, kids, 8), 2);
  kill(p.pid, SIGTERM);
  int code = mr_t_wait(&p, 60);
  char *err = mr_t_slurp(p.err_path);
  ck_assert_msg(code == 128 + SIGTERM, "exit %d:\n%s", code, err);
  ck_assert_msg(strstr(err, "SIGUSR1: writing a checkpoint (training goes on)") != NULL, "%s",
                err);
  free(err);
  int64_t last;
  ck_assert_int_eq(mr_ckpt_find_latest(ck, latest, sizeof latest, &last), 1);
  ck_assert_int_ge(last, step + 5);
}
END_TEST

/* SIGTERM while a periodic checkpoint is still being written (the test
 * hook slows each write): that save completing is not the preemption's —
 * the job stops at a checkpoint of the step it had reached, or later. */
START_TEST(test_ckpt_sigterm_during_a_save_keeps_the_newer_steps) {
  char dir[64];
  setup(dir, sizeof dir);
  write_job(dir, "long.json", 100000, 4, "ck");
  static char delay[] = "MESHRUN_TEST_CKPT_DELAY_MS=1500";
  /* two slowed saves back to back take 3 s of the default 4 s grace; on a
   * busy machine that is not enough, and which save counts is the point */
  static char grace[] = "MESHRUN_PREEMPT_GRACE_MS=30000";
  char *env[] = {delay, grace, NULL};
  struct mr_tproc p;
  start(&p, dir, "long.json", "run", 2, 0, env);
  char metrics[200];
  snprintf(metrics, sizeof metrics, "%s/run/metrics.jsonl", dir);
  ck_assert(mr_t_wait_for_text(metrics, "\"step\": 6,", 60) >= 0); /* step 4's save in flight */
  kill(p.pid, SIGTERM);
  int code = mr_t_wait(&p, 60);
  char *err = mr_t_slurp(p.err_path);
  ck_assert_msg(code == 128 + SIGTERM, "exit %d:\n%s", code, err);
  const char *says = "the next launch resumes from step ";
  char *at = strstr(err, says);
  ck_assert_msg(at != NULL, "%s", err);
  ck_assert_msg(atoi(at + strlen(says)) >= 6, "stopped at the checkpoint of step %d, begun "
                "before the signal, losing the steps since:\n%s", atoi(at + strlen(says)), err);
  free(err);
}
END_TEST

/* Losses of run dir/run (steps from..from + n - 1) against those of the
 * uninterrupted run `full` (its steps from 1). */
static void losses_continue(const char *dir, const char *run, int from, int n,
                            const double *full) {
  char m[200];
  double got[32];
  snprintf(m, sizeof m, "%s/%s/metrics.jsonl", dir, run);
  ck_assert_int_eq(mr_t_read_losses(m, got, 32), n);
  for (int s = 0; s < n; s++)
    ck_assert_msg(fabs(got[s] - full[from - 1 + s]) <= 1e-4 * fabs(full[from - 1 + s]),
                  "%s, step %d: %.7f vs %.7f uninterrupted", run, from + s, got[s],
                  full[from - 1 + s]);
}

static void copy_file(const char *from, const char *to) {
  FILE *in = fopen(from, "rb"), *out = fopen(to, "wb");
  ck_assert(in != NULL && out != NULL);
  char buf[1 << 16];
  for (size_t n; (n = fread(buf, 1, sizeof buf, in)) > 0;)
    ck_assert_int_eq(fwrite(buf, 1, n, out), n);
  fclose(in);
  fclose(out);
}

/* A checkpoint is exactly the files its COMPLETE lists, and each save
 * starts in a folder of its own.  Saved under ZeRO-1 dp4 (4 rank files),
 * the save of step 8 interrupted; saved again under ZeRO-1 dp2 (2 files):
 * the dp4 shards of step 8 are not read with the new ones.  Stray shards
 * and a file of the operator's in a checkpoint are not read and not
 * removed.  A checkpoint whose files pass their checksums but whose
 * pieces do not cover the model (a shard missing from the list) is
 * marked bad at the launcher and the previous one resumed, no restart
 * spent.  A file where a step's folder goes stops the launch, exit 2,
 * before any rank.  Every run's losses continue the uninterrupted dp4
 * run's. */
START_TEST(test_ckpt_stale_shards_and_strays_never_loaded) {
  char dir[64], ck[160], d4[200], d8[200], d12[200], f[300], g[300];
  setup(dir, sizeof dir);
  const char *zero1 = "\"sharding\": {\"stage\": 1}"; /* on 4 ranks, then on 2 */
  write_job_s(dir, "full.json", 16, 0, "ck-full", zero1);
  write_job_s(dir, "first.json", 8, 4, "ck", zero1);
  write_job_s(dir, "second.json", 8, 4, "ck", zero1);
  write_job_s(dir, "third.json", 12, 4, "ck", zero1);
  write_job_s(dir, "fourth.json", 16, 4, "ck", zero1);
  write_job_s(dir, "fifth.json", 20, 4, "ck", zero1);
  ck_assert_int_eq(run_to_end(dir, "full.json", "full", 4), 0);
  double full[16];
  snprintf(f, sizeof f, "%s/full/metrics.jsonl", dir);
  ck_assert_int_eq(mr_t_read_losses(f, full, 16), 16);
  snprintf(ck, sizeof ck, "%s/ck", dir);
  mr_ckpt_step_dir(ck, 4, d4, sizeof d4);
  mr_ckpt_step_dir(ck, 8, d8, sizeof d8);
  mr_ckpt_step_dir(ck, 12, d12, sizeof d12);

  /* the dp4 save of step 8 interrupted: its 4 shards, no marker */
  ck_assert_int_eq(run_to_end(dir, "first.json", "first", 4), 0);
  snprintf(f, sizeof f, "%s/rank-3.safetensors", d8);
  ck_assert_int_eq(access(f, F_OK), 0);
  snprintf(f, sizeof f, "%s/COMPLETE", d8);
  ck_assert_int_eq(unlink(f), 0);
  ck_assert_int_eq(run_to_end(dir, "second.json", "second", 2), 0);
  losses_continue(dir, "second", 5, 4, full);
  snprintf(f, sizeof f, "%s/rank-3.safetensors", d8);
  ck_assert_msg(access(f, F_OK) != 0, "a dp4 shard of the interrupted save is still there");

  /* strays in the newest checkpoint, a note of the operator's in the
   * oldest (pruned) one */
  snprintf(f, sizeof f, "%s/rank-0.safetensors", d8);
  snprintf(g, sizeof g, "%s/rank-2.safetensors", d8);
  copy_file(f, g);
  snprintf(g, sizeof g, "%s/rank-3.safetensors", d8);
  copy_file(f, g);
  snprintf(g, sizeof g, "%s/notes.txt", d4);
  FILE *nf = fopen(g, "w");
  fputs("kept by the operator\n", nf);
  fclose(nf);
  ck_assert_int_eq(run_to_end(dir, "third.json", "third", 2), 0);
  losses_continue(dir, "third", 9, 4, full);
  ck_assert_msg(access(g, F_OK) == 0, "%s was removed with its checkpoint", g);

  /* step 12 without one of its shards, which COMPLETE no longer lists:
   * every checksum holds, the pieces do not cover the model */
  struct mr_ckpt_manifest m;
  ck_assert_int_eq(mr_ckpt_manifest_load(d12, &m), 0);
  const char *names[8], *sums[8];
  int n = 0;
  for (int i = 0; i < m.n; i++) {
    if (strcmp(m.names[i], "rank-1.safetensors") == 0)
      continue;
    names[n] = m.names[i], sums[n] = m.sums[i], n++;
  }
  ck_assert_int_eq(n, m.n - 1);
  ck_assert_int_eq(mr_ckpt_write_marker(d12, 12, names, sums, n), 0);
  mr_ckpt_manifest_free(&m);
  snprintf(f, sizeof f, "%s/rank-1.safetensors", d12);
  ck_assert_int_eq(unlink(f), 0);
  ck_assert_int_eq(mr_ckpt_verify(d12, NULL), 0);
  struct mr_tproc p;
  start(&p, dir, "fourth.json", "fourth", 2, 3, NULL);
  ck_assert_int_eq(mr_t_wait(&p, 120), 0);
  char *err = mr_t_slurp(p.err_path);
  ck_assert_msg(strstr(err, "step-00000012: marked bad") != NULL &&
                    strstr(err, "elements (a rank file missing)") != NULL, "%s", err);
  ck_assert_msg(strstr(err, "restarting") == NULL, "a restart was spent:\n%s", err);
  free(err);
  losses_continue(dir, "fourth", 9, 8, full);
  snprintf(f, sizeof f, "%s.bad/rank-0.safetensors", d12);
  ck_assert_msg(access(f, F_OK) == 0, "the bad checkpoint was not kept aside");

  /* a file where the folder of step 20 goes */
  char d20[200];
  mr_ckpt_step_dir(ck, 20, d20, sizeof d20);
  nf = fopen(d20, "w");
  fclose(nf);
  start(&p, dir, "fifth.json", "fifth", 2, 3, NULL);
  ck_assert_int_eq(mr_t_wait(&p, 60), 2);
  err = mr_t_slurp(p.err_path);
  ck_assert_msg(strstr(err, "step-00000020: not a folder, where the checkpoint of step 20") !=
                    NULL, "%s", err);
  free(err);
  snprintf(f, sizeof f, "%s/fifth/rank-0.log", dir);
  ck_assert_msg(access(f, F_OK) != 0, "a rank started: %s exists", f);
  struct stat st;
  ck_assert(stat(d20, &st) == 0 && S_ISREG(st.st_mode));
}
END_TEST

START_TEST(test_ckpt_resume_on_another_strategy_or_world_size) {
  /* saved under one strategy, resumed under another: the losses continue
   * as in the uninterrupted run of the first strategy */
  static const struct {
    int n1;
    const char *s1;
    int n2;
    const char *s2;
    int tied;
  } pairs[] = {
      {4, "\"sharding\": {\"stage\": 1}", 2, "", 0},                  /* ZeRO-1 dp4 -> dp2 */
      {2, "", 2, "\"sharding\": {\"stage\": 1}", 0},                  /* dp2 -> ZeRO-1 dp2 */
      {1, "", 4, "\"gradient_accumulation_steps\": 1, \"sharding\": {\"stage\": 1}", 0}, /* 1 -> 4 */
      /* dp2 x tp2 x pp2 on 8 ranks -> tp2 on 2 */
      {8,
       "\"auto_mode\": \"manual\", \"data_parallel\": {\"degree\": 2}, "
       "\"tensor_parallel\": {\"degree\": 2}, "
       "\"pipeline_parallel\": {\"degree\": 2, \"micro_batches\": 2}",
       2, "\"auto_mode\": \"manual\", \"tensor_parallel\": {\"degree\": 2}", 0},
      /* ZeRO-3 dp4 -> a 2-stage pipeline */
      {4, "\"auto_mode\": \"manual\", \"data_parallel\": {\"degree\": 4}, \"sharding\": {\"stage\": 3}",
       2, "\"auto_mode\": \"manual\", \"pipeline_parallel\": {\"degree\": 2, \"micro_batches\": 2}", 0},
      /* tied embeddings on both stages of a pipeline, to and from ZeRO-3
       * (each stage's copy a data-th of the embedding) */
      {4, "\"auto_mode\": \"manual\", \"data_parallel\": {\"degree\": 2}, \"sharding\": {\"stage\": 3}, "
          "\"pipeline_parallel\": {\"degree\": 2, \"micro_batches\": 2}",
       2, "\"auto_mode\": \"manual\", \"pipeline_parallel\": {\"degree\": 2, \"micro_batches\": 2}", 1},
      {2, "\"auto_mode\": \"manual\", \"pipeline_parallel\": {\"degree\": 2, \"micro_batches\": 2}",
       4, "\"auto_mode\": \"manual\", \"data_parallel\": {\"degree\": 2}, \"sharding\": {\"stage\": 3}, "
          "\"pipeline_parallel\": {\"degree\": 2, \"micro_batches\": 2}", 1},
  };
  for (size_t k = 0; k < sizeof pairs / sizeof pairs[0]; k++) {
    char dir[64];
    setup(dir, sizeof dir);
    tie_embeddings = pairs[k].tied;
    write_job_s(dir, "full.json", 8, 0, "ck-full", pairs[k].s1);
    write_job_s(dir, "first.json", 4, 4, "ck", pairs[k].s1);
    write_job_s(dir, "second.json", 8, 0, "ck", pairs[k].s2);
    ck_assert_int_eq(run_to_end(dir, "full.json", "full", pairs[k].n1), 0);
    ck_assert_int_eq(run_to_end(dir, "first.json", "first", pairs[k].n1), 0);
    ck_assert_int_eq(run_to_end(dir, "second.json", "second", pairs[k].n2), 0);
    double full[8], second[8];
    char m[200];
    snprintf(m, sizeof m, "%s/full/metrics.jsonl", dir);
    ck_assert_int_eq(mr_t_read_losses(m, full, 8), 8);
    snprintf(m, sizeof m, "%s/second/metrics.jsonl", dir);
    ck_assert_int_eq(mr_t_read_losses(m, second, 8), 4);
    for (int s = 0; s < 4; s++)
      ck_assert_msg(fabs(second[s] - full[4 + s]) <= 1e-4 * fabs(full[4 + s]),
                    "pair %zu, step %d: %.7f after resuming on %d ranks vs %.7f uninterrupted "
                    "on %d", k, 5 + s, second[s], pairs[k].n2, full[4 + s], pairs[k].n1);
  }
  tie_embeddings = 0;
}
END_TEST

/* Rewrites checkpoint folder src (step `step`) under root dst as
 * checkpoints held GPT-2's fused q|k|v weight before it was held [C, 3, C]:
 * every tensor whole in one rank file, in the shape Hugging Face files give
 * it (the index's file_shape, [C, 3C]). */
static void write_merged_layout(const char *src, const char *dst, int64_t step) {
  char path[600], out[400];
  snprintf(path, sizeof path, "%s/index.json", src);
  cJSON *ix;
  ck_assert_int_eq(mr_json_load(path, &ix), 0);
  cJSON *tensors = cJSON_GetObjectItemCaseSensitive(ix, "tensors");
  struct mr_ckpt_reader *rd;
  ck_assert_int_eq(mr_ckpt_reader_open(src, &rd), 0);
  mkdir(dst, 0755);
  mr_ckpt_step_dir(dst, step, out, sizeof out);
  ck_assert_int_eq(mkdir(out, 0755), 0);
  snprintf(path, sizeof path, "%s/rank-0.safetensors", out);
  struct mr_st_writer *w;
  ck_assert_int_eq(mr_st_writer_new(path, 0, &w), 0);
  cJSON *pieces = cJSON_CreateObject();
  float *bufs[256];
  int nb = 0, merged = 0;
  cJSON *e;
  cJSON_ArrayForEach(e, tensors) {
    cJSON *sh = cJSON_GetObjectItemCaseSensitive(e, "shape");
    cJSON *fs = cJSON_GetObjectItemCaseSensitive(e, "file_shape");
    int nd = cJSON_GetArraySize(sh), fnd = fs ? cJSON_GetArraySize(fs) : nd;
    int64_t shape[4], off[4] = {0}, numel = 1;
    for (int d = 0; d < nd; d++)
      numel *= shape[d] = (int64_t)cJSON_GetArrayItem(sh, d)->valuedouble;
    const char *prefixes[3] = {"", "optim.exp_avg.", "optim.exp_avg_sq."};
    for (int k = 0; k < 3; k++) {
      char name[200];
      snprintf(name, sizeof name, "%s%s", prefixes[k], e->string);
      ck_assert_int_lt(nb, 256);
      bufs[nb] = malloc((size_t)numel * sizeof(float));
      ck_assert_msg(mr_ckpt_reader_read(rd, name, nd, shape, off, shape, 0, numel, bufs[nb]) == 0,
                    "%s", mr_error_message());
      ck_assert_int_eq(mr_st_writer_add(w, name, MR_F32, 1, &numel, bufs[nb]), 0);
      cJSON *a = cJSON_AddArrayToObject(pieces, name); /* the whole tensor, merged */
      for (int d = 0; d < fnd; d++)
        cJSON_AddItemToArray(a, cJSON_CreateNumber(0));
      for (int d = 0; d < fnd; d++)
        cJSON_AddItemToArray(a, cJSON_Duplicate(cJSON_GetArrayItem(fs ? fs : sh, d), 1));
      cJSON_AddItemToArray(a, cJSON_CreateNumber(0));
      cJSON_AddItemToArray(a, cJSON_CreateNumber((double)numel));
      nb++;
    }
    if (fs != NULL) {
      cJSON_ReplaceItemInObjectCaseSensitive(e, "shape", cJSON_Duplicate(fs, 1));
      cJSON_DeleteItemFromObjectCaseSensitive(e, "file_shape");
      merged++;
    }
  }
  ck_assert_int_eq(merged, 4); /* c_attn weight and bias of both layers */
  char *ptext = cJSON_PrintUnformatted(pieces);
  ck_assert_int_eq(mr_st_writer_add_metadata(w, "pieces", ptext), 0);
  ck_assert_int_eq(mr_st_writer_finish(w), 0);
  mr_st_writer_free(w);
  free(ptext);
  cJSON_Delete(pieces);
  for (int i = 0; i < nb; i++)
    free(bufs[i]);
  mr_ckpt_reader_free(rd);
  char sha[2][MR_CHECKSUM_HEX];
  ck_assert_int_eq(mr_checksum_file(path, sha[0]), 0);
  snprintf(path, sizeof path, "%s/index.json", out);
  char *text = cJSON_Print(ix);
  FILE *f = fopen(path, "w");
  fputs(text, f);
  fclose(f);
  free(text);
  cJSON_Delete(ix);
  ck_assert_int_eq(mr_checksum_file(path, sha[1]), 0);
  const char *files[2] = {"rank-0.safetensors", "index.json"};
  const char *shas[2] = {sha[0], sha[1]};
  ck_assert_int_eq(mr_ckpt_write_marker(out, step, files, shas, 2), 0);
}

/* GPT-2's fused q|k|v weight, split by heads under tensor parallelism:
 * saved under tp2 (each rank a [C, 3, C/2] box of it and of its moments),
 * resumed on one rank the losses continue as in the uninterrupted tp2 run;
 * a checkpoint holding it as Hugging Face files do ([C, 3C]: checkpoints
 * of the earlier layout) resumes under tp2 alike. */
START_TEST(test_ckpt_gpt2_fused_weight_across_layouts) {
  char dir[64], src[200], dst[200];
  setup(dir, sizeof dir);
  gpt2 = 1;
  const char *tp2 = "\"auto_mode\": \"manual\", \"tensor_parallel\": {\"degree\": 2}";
  write_job_s(dir, "full.json", 8, 0, "ck-full", tp2);
  write_job_s(dir, "first.json", 4, 4, "ck", tp2);
  write_job_s(dir, "one.json", 8, 0, "ck", "\"auto_mode\": \"manual\"");
  write_job_s(dir, "old.json", 8, 0, "ck-old", tp2);
  gpt2 = 0;
  ck_assert_int_eq(run_to_end(dir, "full.json", "full", 2), 0);
  ck_assert_int_eq(run_to_end(dir, "first.json", "first", 2), 0);
  snprintf(src, sizeof src, "%s/ck/step-00000004", dir);
  snprintf(dst, sizeof dst, "%s/ck-old", dir);
  write_merged_layout(src, dst, 4);
  ck_assert_int_eq(run_to_end(dir, "one.json", "one", 1), 0);
  ck_assert_int_eq(run_to_end(dir, "old.json", "old", 2), 0);
  double full[8], got[8];
  char m[200];
  snprintf(m, sizeof m, "%s/full/metrics.jsonl", dir);
  ck_assert_int_eq(mr_t_read_losses(m, full, 8), 8);
  const char *runs[2] = {"one", "old"};
  for (int r = 0; r < 2; r++) {
    snprintf(m, sizeof m, "%s/%s/metrics.jsonl", dir, runs[r]);
    ck_assert_int_eq(mr_t_read_losses(m, got, 8), 4);
    for (int s = 0; s < 4; s++)
      ck_assert_msg(fabs(got[s] - full[4 + s]) <= 1e-4 * fabs(full[4 + s]),
                    "%s, step %d: %.7f resumed vs %.7f uninterrupted", runs[r], 5 + s, got[s],
                    full[4 + s]);
  }
}
END_TEST

/* Launches job dir/name on 2 ranks with a hang timeout of `timeout` s and
 * the test hook `hook` ("NAME=VALUE"); returns the launcher's stderr
 * (malloc'd) and its exit code. */
static char *launch_watched(const char *dir, const char *name, const char *hook,
                            const char *timeout, int *code) {
  static char env_hook[96], jobp[200], logdir[200];
  snprintf(env_hook, sizeof env_hook, "%s", hook);
  char *env[] = {env_hook, NULL};
  snprintf(jobp, sizeof jobp, "%s/%s", dir, name);
  snprintf(logdir, sizeof logdir, "%s/%s.log", dir, name);
  char *argv[] = {(char *)mr_t_meshrun(), "launch", "--nproc", "2", "--hang-timeout",
                  (char *)timeout, "--log-dir", logdir, jobp, NULL};
  struct mr_tproc p;
  mr_t_spawn(&p, dir, argv, env);
  *code = mr_t_wait(&p, 120);
  return mr_t_slurp(p.err_path);
}

/* The same with a 3 s hang timeout and MESHRUN_TEST_STALL=stall
 * (RANK:STEP).  (1 s was seen outlasted by a step's gradient sync on a
 * busy 2-core machine, before completed collectives counted as progress;
 * a single slow all-reduce can still outlast it.) */
static char *launch_stalled(const char *dir, const char *name, const char *stall, int *code) {
  char hook[64];
  snprintf(hook, sizeof hook, "MESHRUN_TEST_STALL=%s", stall);
  return launch_watched(dir, name, hook, "3", code);
}

/* A checkpoint write slower than the hang timeout (a slow disk: the test
 * hook writes 100 kB a second, over 6 s a rank's file) makes the next save
 * wait for it with no step done: the bytes the writer moves are progress,
 * so the job finishes, saving every 2 steps, with no hang called.  (A 2 s
 * timeout was seen outlasted under AddressSanitizer by a rank's heartbeats
 * held up 1.8 s on a busy 2-core machine; 3 s, as launch_stalled's.) */
START_TEST(test_ckpt_slow_checkpoint_write_is_not_a_hang) {
  char dir[64];
  setup(dir, sizeof dir);
  write_job(dir, "slow.json", 6, 2, "ck");
  int code;
  char *err = launch_watched(dir, "slow.json", "MESHRUN_TEST_CKPT_BYTES_PER_S=100000", "3",
                             &code);
  ck_assert_msg(code == 0, "exit %d:\n%s", code, err);
  ck_assert_msg(strstr(err, "hang") == NULL, "%s", err);
  ck_assert_msg(strstr(err, "checkpoint of step 6 complete") != NULL, "%s", err);
  free(err);
  char path[300];
  snprintf(path, sizeof path, "%s/ck/step-00000006/rank-0.safetensors", dir);
  struct stat st;
  ck_assert_int_eq(stat(path, &st), 0);
  ck_assert_msg((double)st.st_size / 100000 > 6.0, "a %lld-byte file is written in under 6 s",
                (long long)st.st_size);
}
END_TEST

/* A slow network (the test hook sleeps 250 ms before each wait on a
 * communication operation) makes a step's gradient sync, one instruction
 * that waits on every gradient's all-reduce, last longer than the 5 s hang
 * timeout while each operation completes well inside it: that is progress,
 * so the job finishes with no hang called.  (A 1 s timeout with 400 ms
 * waits was seen outlasted by one operation under the sanitizers on a busy
 * machine, and 3 s with 150 ms by a rank's heartbeats held up 3 s while
 * the sanitized dist_train ran beside it.) */
START_TEST(test_ckpt_slow_gradient_sync_is_not_a_hang) {
  char dir[64];
  setup(dir, sizeof dir);
  write_job(dir, "slowcomm.json", 2, 0, "ck");
  int code;
  char *err = launch_watched(dir, "slowcomm.json", "MESHRUN_TEST_COMM_WAIT_MS=250", "5", &code);
  ck_assert_msg(code == 0, "exit %d:\n%s", code, err);
  ck_assert_msg(strstr(err, "hang") == NULL, "%s", err);
  free(err);
  /* the steps did outlast the timeout: without counting operations done as
   * progress this job is called a hang */
  char path[200];
  snprintf(path, sizeof path, "%s/slowcomm.json.log/metrics.jsonl", dir);
  char *metrics = mr_t_slurp(path);
  const char *t = strstr(metrics, "\"step_time_s\": ");
  ck_assert_msg(t != NULL, "%s", metrics);
  double step_s = strtod(t + strlen("\"step_time_s\": "), NULL);
  ck_assert_msg(step_s > 5.0, "step 1 took %.2f s, not over the 5 s hang timeout", step_s);
  free(metrics);
}
END_TEST

/* A write that stops moving bytes is still a hang, and says so: the rank
 * waits on its own checkpoint write.  (A 2 s timeout was seen outlasted
 * under the sanitizers by a gradient all-reduce on a busy machine, a hang
 * called before the write's; the write stalls 8 s, past 3 s.) */
START_TEST(test_ckpt_stalled_checkpoint_write_diagnosed) {
  char dir[64];
  setup(dir, sizeof dir);
  write_job(dir, "stuck.json", 6, 2, "ck");
  int code;
  char *err = launch_watched(dir, "stuck.json", "MESHRUN_TEST_CKPT_DELAY_MS=8000", "3", &code);
  ck_assert_msg(code == 1, "exit %d:\n%s", code, err);
  ck_assert_msg(strstr(err, "hang: no rank made progress") != NULL &&
                    strstr(err, "waits on its own checkpoint write") != NULL,
                "%s", err);
  free(err);
}
END_TEST

/* A start slower than the hang timeout (ranks lowering, opening their
 * communication, loading: long under a sanitizer) is not a hang: the hang
 * clock starts at the first step. */
START_TEST(test_ckpt_slow_start_is_not_a_hang) {
  char dir[64];
  setup(dir, sizeof dir);
  write_job(dir, "slow.json", 4, 2, "ck");
  int code;
  char *err = launch_watched(dir, "slow.json", "MESHRUN_TEST_START_DELAY_MS=3000", "1", &code);
  ck_assert_msg(code == 0 && strstr(err, "hang") == NULL && strstr(err, "restart") == NULL,
                "exit %d:\n%s", code, err);
  free(err);
}
END_TEST

START_TEST(test_ckpt_hang_in_collective_diagnosed) {
  char dir[64];
  setup(dir, sizeof dir);
  write_job(dir, "h.json", 6, 2, "ck");
  int code;
  char *err = launch_stalled(dir, "h.json", "1:4", &code);
  ck_assert_msg(code == 1, "exit %d:\n%s", code, err);
  ck_assert_msg(strstr(err, "rank 1 is stuck outside communication") != NULL, "%s", err);
  /* rank 0 waits in step 4's AllReduce on the data group (the loss), and
   * says which rank has not arrived */
  ck_assert_msg(strstr(err, "AllReduce") != NULL && strstr(err, "data{0,1}") != NULL, "%s", err);
  ck_assert_msg(strstr(err, "rank 0: step 4") != NULL && strstr(err, "waiting for rank 1") != NULL,
                "%s", err);
  free(err);
}
END_TEST

/* A stalled first pipeline stage: the second names the receive it waits in
 * (the boundary tensor, the micro-batch, the peer). */
START_TEST(test_ckpt_hang_in_pipeline_receive_diagnosed) {
  char dir[64];
  setup(dir, sizeof dir);
  write_job_s(dir, "hp.json", 6, 2, "ck",
              "\"auto_mode\": \"manual\", \"pipeline_parallel\": {\"degree\": 2, "
              "\"micro_batches\": 2}");
  int code;
  char *err = launch_stalled(dir, "hp.json", "0:4", &code);
  ck_assert_msg(code == 1, "exit %d:\n%s", code, err);
  ck_assert_msg(strstr(err, "rank 0 is stuck outside communication") != NULL, "%s", err);
  ck_assert_msg(strstr(err, "rank 1: step 4") != NULL && strstr(err, "Recv") != NULL &&
                    strstr(err, "pipe{0,1}") != NULL && strstr(err, "m0 recv") != NULL,
                "%s", err);
  free(err);
}
END_TEST

/* Runs a 6-step job on 2 ranks, no restarts, with one test hook set
 * ("NAME=VALUE"): it must fail (exit 1) with both fragments on stderr. */
static void fails_with(const char *hook, const char *want1, const char *want2) {
  char dir[64];
  setup(dir, sizeof dir);
  write_job(dir, "f.json", 6, 100, "ck");
  char env0[96];
  snprintf(env0, sizeof env0, "%s", hook);
  char *env[] = {env0, NULL};
  struct mr_tproc p;
  start(&p, dir, "f.json", "f", 2, 0, env);
  int code = mr_t_wait(&p, 60);
  char *err = mr_t_slurp(p.err_path);
  ck_assert_msg(code == 1, "exit %d:\n%s", code, err);
  ck_assert_msg(strstr(err, want1) != NULL && strstr(err, want2) != NULL, "%s", err);
  free(err);
}

/* A rank that exits 0 without reporting its job done is a failure, judged
 * once its connection has been read to the end (a clean exit right after
 * the last report is not one). */
START_TEST(test_ckpt_rank_exiting_early_is_a_failure) {
  fails_with("MESHRUN_TEST_EXIT=1:3", "job failed after 0 restarts: rank 1 (pid",
             "exited before finishing its job");
}
END_TEST

/* The launcher sends each rank the digest of the program it checked; a
 * worker that lowers another one (here: told a wrong digest) stops with
 * both digests named, and the job fails. */
START_TEST(test_ckpt_worker_lowering_another_program_stops) {
  fails_with("MESHRUN_TEST_PLAN_DIGEST=1", "rank 1: the program this worker lowered from the plan",
             "is not the one the launcher checked");
}
END_TEST

static Suite *ckpt_suite(void) {
  Suite *s = suite_create("ckpt");
  TCase *tc = mr_t_tcase("recovery");
  tcase_set_timeout(tc, 300);
  tcase_add_test(tc, test_ckpt_killed_ranks_resume_bitwise);
#ifndef __SANITIZE_ADDRESS__
  tcase_add_test(tc, test_ckpt_chaos_kills_resume_bitwise);
#endif
  tcase_add_test(tc, test_ckpt_killed_rank_group_stops_at_once);
  tcase_add_test(tc, test_ckpt_corrupt_or_incomplete_checkpoint_skipped);
  tcase_add_test(tc, test_ckpt_all_corrupt_refused_before_any_rank);
  tcase_add_test(tc, test_ckpt_finished_job_relaunched_exits_at_once);
  tcase_add_test(tc, test_ckpt_bad_data_refused_before_any_rank);
  tcase_add_test(tc, test_ckpt_failed_save_fails_at_once_and_keeps_the_last);
  tcase_add_test(tc, test_ckpt_unwritable_dir_refused_at_launch);
  tcase_add_test(tc, test_ckpt_sigterm_checkpoints_and_exits_143);
  tcase_add_test(tc, test_ckpt_sigusr1_checkpoints_and_goes_on);
  tcase_add_test(tc, test_ckpt_resume_on_another_strategy_or_world_size);
  tcase_add_test(tc, test_ckpt_stale_shards_and_strays_never_loaded);
  tcase_add_test(tc, test_ckpt_gpt2_fused_weight_across_layouts);
  tcase_add_test(tc, test_ckpt_sigterm_during_a_save_keeps_the_newer_steps);
  tcase_add_test(tc, test_ckpt_hang_in_collective_diagnosed);
  tcase_add_test(tc, test_ckpt_slow_checkpoint_write_is_not_a_hang);
  tcase_add_test(tc, test_ckpt_stalled_checkpoint_write_diagnosed);
  tcase_add_test(tc, test_ckpt_slow_start_is_not_a_hang);
  tcase_add_test(tc, test_ckpt_slow_gradient_sync_is_not_a_hang);
  tcase_add_test(tc, test_ckpt_hang_in_pipeline_receive_diagnosed);
  tcase_add_test(tc, test_ckpt_rank_exiting_early_is_a_failure);
  tcase_add_test(tc, test_ckpt_worker_lowering_another_program_stops);
  suite_add_tcase(s, tc);
  return s;
}

MR_TEST_MAIN(ckpt_suite)
