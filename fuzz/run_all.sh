#!/usr/bin/env bash
# Run every harness for SECONDS each (default 60), one after the other, on the pure twin by
# default (AIOBRPC_NO_EXTENSIONS=1: every module is Python, so atheris sees the coverage of the
# modules Cython compiles too; TWIN=compiled runs the compiled build, whose C code atheris
# cannot see but whose crashes it still catches).
#
#   fuzz/run_all.sh 60                  # CI: a minute each
#   fuzz/run_all.sh 7200                # two hours each
#   HARNESSES="stream h2_server" fuzz/run_all.sh 600
#   JOBS=4 fuzz/run_all.sh 3600         # libFuzzer's -fork=N per harness
#
# New corpus entries go to fuzz/corpus/<harness>/ (minimise with `-merge=1` before committing),
# crashes to fuzz/findings/<harness>/ (crash-<sha1>). Exit status 1 when any harness found one.
set -u
cd "$(dirname "$0")/.."
SECONDS_EACH="${1:-60}"
HARNESSES="${HARNESSES:-baidu_server http_server h2_server stream baidu_client grpc_client compress json_transcode naming codec collective lanes lane_messages tensor_meta ps_server}"
JOBS="${JOBS:-0}"
if [ "${TWIN:-pure}" = "pure" ]; then export AIOBRPC_NO_EXTENSIONS=1; fi
rc=0
for h in $HARNESSES; do
  mkdir -p "fuzz/findings/$h" "fuzz/corpus/$h"
  work="$(mktemp -d)"  # new inputs land here, not in the committed corpus (merge them on purpose)
  extra=()
  if [ "$JOBS" -gt 0 ]; then extra=(-fork="$JOBS" -ignore_crashes=1); fi
  echo "== $h: ${SECONDS_EACH}s"
  python3 -m "fuzz.$h" "$work" "fuzz/corpus/$h" -max_total_time="$SECONDS_EACH" -rss_limit_mb=2048 \
    -timeout=10 -max_len=65536 -artifact_prefix="fuzz/findings/$h/" -print_final_stats=1 "${extra[@]}" \
    2>&1 | grep -E "^(#[0-9]+ +(INITED|DONE)|==|stat::|.*(Error|Finding|Traceback|crash-|timeout-|oom-))" | tail -n 40
  status=${PIPESTATUS[0]}
  if [ "$status" -ne 0 ]; then echo "!! $h exited $status"; rc=1; fi
  rm -rf "$work"
done
exit $rc
