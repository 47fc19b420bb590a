/* tunable.h - every tunable of meshrun, declared once with its environment
 * variable and default.
 *
 * A tunable is read from the environment the first time it is asked for and
 * cached for the life of the process.  Command-line flags that override one
 * call mr_tunable_override() before any reader runs.  To add a tunable, add a
 * row here; `meshrun env` lists them all. */
#ifndef MR_TUNABLE_H
#define MR_TUNABLE_H

#include <stdint.h>

/* XX(id, env name, default, description).  Integers and strings share the
 * table; a reader asks for the form it wants. */
#define MR_TUNABLE_MAP(XX)                                                   \
  XX(LOG_LEVEL, "MESHRUN_LOG_LEVEL", "info",                                 \
     "log level: error, warn, info, debug")                                  \
  XX(THREADS, "MESHRUN_THREADS", "1", "compute threads per CPU rank")        \
  XX(CLUSTER, "MESHRUN_CLUSTER", "",                                         \
     "cluster spec (a shipped name or a file) for jobs that name none; "    \
     "empty: launch plans for this machine, measured once and cached "     \
     "under ~/.cache/meshrun, and plan for cpu-local")                      \
  XX(DEVICE, "MESHRUN_DEVICE", "",                                          \
     "what ranks compute on: cpu or cuda (set by launch --device)")         \
  XX(CPU_SIMD, "MESHRUN_CPU_SIMD", "auto",                                   \
     "CPU kernels' vector path: auto (AVX-512 matmul, AVX2+FMA kernels "     \
     "where present), avx2 (no AVX-512) or portable")                        \
  XX(CPU_GEMM, "MESHRUN_CPU_GEMM", "auto",                                   \
     "CPU fp32 matmuls: auto (our sgemm where the CPU has AVX2+FMA, else "   \
     "OpenBLAS) or openblas (single-threaded OpenBLAS calls by rows)")       \
  XX(CUDA_ATTENTION, "MESHRUN_CUDA_ATTENTION", "auto",                       \
     "GPU attention kernels: auto (tensor cores under bf16 amp for head "    \
     "dims that are multiples of 16 up to 128, else CUDA cores) or cores")   \
  XX(HEARTBEAT_MS, "MESHRUN_HEARTBEAT_MS", "100",                            \
     "interval between a worker's heartbeats, ms")                           \
  XX(MAX_FRAME_BYTES, "MESHRUN_MAX_FRAME_BYTES", "268435456",                \
     "largest RPC frame accepted, bytes")                                    \
  XX(MAX_PREAUTH_CONNS, "MESHRUN_MAX_PREAUTH_CONNS", "64",                   \
     "connections one listener lets wait to authenticate at once beyond "   \
     "the job's ranks and nodes (a new one drops the oldest)")               \
  XX(AUTH_TIMEOUT_MS, "MESHRUN_AUTH_TIMEOUT_MS", "5000",                     \
     "time a new connection has to authenticate, ms")                        \
  XX(CONNECT_TIMEOUT_MS, "MESHRUN_CONNECT_TIMEOUT_MS", "30000",              \
     "time a spawned worker has to register, ms")                            \
  XX(STOP_GRACE_MS, "MESHRUN_STOP_GRACE_MS", "3000",                         \
     "time workers get to stop before SIGKILL, ms")                          \
  XX(RESTART_BACKOFF_MS, "MESHRUN_RESTART_BACKOFF_MS", "0",                  \
     "pause before a group restart, ms (doubles per restart)")               \
  XX(SELFCHECK_STEP_MS, "MESHRUN_SELFCHECK_STEP_MS", "20",                   \
     "length of one self-check step, ms")                                    \
  XX(SELFCHECK_STEPS, "MESHRUN_SELFCHECK_STEPS", "5",                        \
     "steps of the self-check job")                                          \
  XX(PREEMPT_GRACE_MS, "MESHRUN_PREEMPT_GRACE_MS", "4000",                   \
     "after SIGTERM, time to write a checkpoint before stopping anyway, ms") \
  XX(GRAD_SYNC_OVERLAP, "MESHRUN_GRAD_SYNC_OVERLAP", "1",                   \
     "1: gradient all-reduces run behind the backward; 0: each waited at once") \
  XX(GRAD_ACCUM_IN_OP, "MESHRUN_GRAD_ACCUM_IN_OP", "1",                     \
     "1: over micro-batches a parameter's gradient adds up in the op "      \
     "producing it (the GEMM with beta 1); 0: in a buffer of its own, "     \
     "added after each micro-batch (to measure against); a job's "          \
     "strategy.gradient_accumulation_in_op overrides it")                    \
  XX(STRAGGLER_RATIO, "MESHRUN_STRAGGLER_RATIO", "1.3",                      \
     "a rank whose work per step (step time less communication wait) "      \
     "stays above this many times its stage's median is named slow")        \
  XX(REBALANCE_GAIN, "MESHRUN_REBALANCE_GAIN", "0.15",                       \
     "a pipeline whose layers, moved off its slow stages, or an elastic "   \
     "job whose slow node, left out, would save at least this share of its " \
     "pace is re-planned from a checkpoint (0: never)")                      \
  XX(PROFILE, "MESHRUN_PROFILE", "0",                                        \
     "1: each rank times its instructions (the device synchronized after "  \
     "each) and logs seconds per step by instruction and op kind")          \
  XX(TRACE_MAX_MB, "MESHRUN_TRACE_MAX_MB", "256",                            \
     "the events a rank's trace (meshrun launch --trace) keeps, MiB; "      \
     "beyond it they are counted and left out")                             \
  XX(LOG_TAIL_LINES, "MESHRUN_LOG_TAIL_LINES", "10",                         \
     "lines of a failed rank's log shown on exit")                           \
  XX(LOSS_SCALE_GROWTH, "MESHRUN_LOSS_SCALE_GROWTH_INTERVAL", "2000",        \
     "fp16: clean steps before the loss scale doubles")                      \
  XX(INJECT_OVERFLOW_STEP, "MESHRUN_INJECT_OVERFLOW_STEP", "0",              \
     "testing: make step N's gradients overflow (1-based; 0: never)")         \
  XX(COMM_TIMEOUT_MS, "MESHRUN_COMM_TIMEOUT_MS", "300000",                   \
     "time a collective may take before it fails naming the late ranks, ms") \
  XX(COMM_TRANSPORT, "MESHRUN_COMM_TRANSPORT", "auto",                       \
     "CPU comm transport: auto (shm within a host, else tcp), shm, tcp")     \
  XX(COMM_ADDR, "MESHRUN_COMM_ADDR", "",                                     \
     "IPv4 address peers use to reach this rank (default: the host's)")     \
  XX(COMM_SHM_CHUNK_BYTES, "MESHRUN_COMM_SHM_CHUNK_BYTES", "1048576",        \
     "shm staging buffer per rank (two of them), bytes")                     \
  XX(COMM_SHM_SMALL_BYTES, "MESHRUN_COMM_SHM_SMALL_BYTES", "16384",          \
     "shm AllReduce up to this size: every rank reduces all, one sync")      \
  XX(COMM_SHM_HEAP_BYTES, "MESHRUN_COMM_SHM_HEAP_BYTES", "0",                \
     "peer-readable memory per rank per shm group for mem_alloc, bytes")    \
  XX(CONFIGS_DIR, "MESHRUN_CONFIGS_DIR", "",                                 \
     "folder holding clusters/*.json (default: configs/ beside the binary)")

enum mr_tunable_id {
#define XX(id, env, def, desc) MR_TUNABLE_##id,
  MR_TUNABLE_MAP(XX)
#undef XX
  MR_TUNABLE_COUNT
};

/* The tunable's value as a string.  Borrowed, valid for the process life. */
const char *mr_tunable_str(enum mr_tunable_id id);

/* The tunable's value as an integer; a value that does not parse logs a
 * warning naming the variable and falls back to the default. */
int64_t mr_tunable_int(enum mr_tunable_id id);

/* Replaces the value (e.g. from a command-line flag).  Copies value. */
void mr_tunable_override(enum mr_tunable_id id, const char *value);

/* Table access for listing: name, env, default, description of row i. */
const char *mr_tunable_env(enum mr_tunable_id id);
const char *mr_tunable_default(enum mr_tunable_id id);
const char *mr_tunable_desc(enum mr_tunable_id id);

#endif
