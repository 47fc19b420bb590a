#!/usr/bin/env bash
# run-fuzz.sh FUZZER SEEDER NAME - seeds a fresh corpus, then fuzzes for
# MESHRUN_FUZZ_SECONDS.  A crash leaves its input in the corpus folder's
# parent and fails the test.
set -euo pipefail
fuzzer=$(realpath "$1") seeder=$(realpath "$2") name=$3
secs=${MESHRUN_FUZZ_SECONDS:-40}
work=$(mktemp -d "${TMPDIR:-/tmp}/mr-fuzz-$name-XXXXXX")
mkdir -p "$work/corpus"
"$seeder" "$work/corpus"
cd "$work"
"$fuzzer" -max_total_time="$secs" -print_final_stats=1 -rss_limit_mb=2048 \
  -max_len=65536 corpus 2>&1 | tail -n 25
rc=${PIPESTATUS[0]}
[ "$rc" -eq 0 ] && rm -rf "$work"
exit "$rc"
