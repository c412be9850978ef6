# The stage runner of tests/gpu/run.sh (sourced). Needs WORK (a scratch folder) and
# REPORT_DIR (where each stage's row goes as soon as it ends; empty: none).
#
# stage NAME LIMIT_S CMD...: run CMD under LIMIT_S (SIGINT at the limit, so pytest prints
# where each rank was; SIGKILL 15 s later), keep its output in $WORK/NAME.log, and append
# its row (passed, exit, seconds, timed_out, the pytest summary, the error lines) to
# $WORK/stages.jsonl and $REPORT_DIR/report.jsonl. A rank that fails under mpi_abort also
# writes its line to $WORK/NAME.aborts, which the row keeps even when the abort cut the log.
stage() {
  local name=$1 limit=$2; shift 2
  echo "== $name: $*"
  local t0=$SECONDS
  rm -f "$WORK/$name.aborts"
  RINGNET_STAGE_ABORTS="$WORK/$name.aborts" timeout -s INT -k 15 "$limit" "$@" 2>&1 | tee "$WORK/$name.log"
  local rc=${PIPESTATUS[0]}
  python "$GPU_TESTS/report.py" row "$WORK" "${REPORT_DIR:-}" "$name" "$rc" \
      "$((SECONDS - t0))" "$limit" "$*"
}

# skip_stage NAME WHY: a stage that does not apply here, on record as skipped.
skip_stage() {
  echo "== $1: skipped: $2"
  echo "skipped: $2" > "$WORK/$1.log"
  python "$GPU_TESTS/report.py" row "$WORK" "${REPORT_DIR:-}" "$1" 0 0 0 "skipped: $2"
}
GPU_TESTS=${GPU_TESTS:-$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)}
