#!/usr/bin/env bash
# The whole test suite: serial tests (MPI-marked ones at N=1), then the MPI tests at N=2, 3, 4.
# Usage: bash tests/run.sh [extra pytest args]   (pytest's exit 5, "no tests collected", counts as success)
# Under mpirun only rank 0 writes to the terminal; the other ranks' output goes to a log that
# is shown when that rank failed. The last lines give each stage's counts and the total.
set -u
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=1 RINGNET_BLAS_THREADS=1 PYTHONDONTWRITEBYTECODE=1
MPIRUN=${MPIRUN:-mpirun}
WORKERS=${RINGNET_TEST_WORKERS:-2}
if ! [[ "$WORKERS" =~ ^[0-9]+$ ]]; then
  echo "tests/run.sh: RINGNET_TEST_WORKERS must be a whole number of workers (0: one process), got '$WORKERS'" >&2
  exit 2
fi
if [ "$WORKERS" -gt 0 ] && ! python -c "import xdist" 2>/dev/null; then
  echo "tests/run.sh: pytest-xdist is not installed (pip install -e \".[test]\"): the serial tests run in one process"
  WORKERS=0
fi
LOGS=$(mktemp -d "${TMPDIR:-/tmp}/ringnet-tests.XXXXXX")
trap 'rm -rf "$LOGS"' EXIT
status=0
started=$SECONDS
summaries=()

# The counts pytest's last line gives ("12 passed, 3 skipped, 40 deselected in 5.0s").
counts() { grep -aE '[0-9]+ (passed|failed|error|errors|skipped|deselected|xfailed|xpassed)' "$1" | tail -1 |
           sed -E 's/=+//g; s/ in [0-9.]+s.*//; s/^ +//; s/ +$//'; }

stage() {   # stage NAME RANKS COMMAND...
  local name=$1 ranks=$2 rc
  shift 2
  if [ "$ranks" -gt 1 ]; then
    echo "+ $MPIRUN -np $ranks $*"
    "$MPIRUN" -np "$ranks" bash -c '
      rank=${PMI_RANK:-${OMPI_COMM_WORLD_RANK:-${SLURM_PROCID:-0}}}
      log=$1; shift
      if [ "$rank" = 0 ]; then exec "$@"; fi
      exec "$@" > "$log.rank$rank" 2>&1' rank "$LOGS/$name" "$@" | tee "$LOGS/$name.rank0"
    rc=${PIPESTATUS[0]}
  else
    echo "+ $*"
    "$@" | tee "$LOGS/$name.rank0"
    rc=${PIPESTATUS[0]}
  fi
  local line
  line=$(printf '%-22s %s' "$name" "$(counts "$LOGS/$name.rank0")")
  if [ "$rc" -ne 0 ] && [ "$rc" -ne 5 ]; then
    status=$rc
    for log in "$LOGS/$name".rank*; do
      [ "$log" = "$LOGS/$name.rank0" ] && continue
      if grep -aqE '[0-9]+ (failed|error)|Traceback|Timeout' "$log"; then
        echo "--- ${log##*.} of $name: its failures ---"
        if grep -aq '= FAILURES =\|= ERRORS =' "$log"; then
          sed -n '/= \(FAILURES\|ERRORS\) =/,$p' "$log" | head -80
        else
          tail -40 "$log"
        fi
        line+="; ${log##*.}: $(counts "$log")"
      fi
    done
  fi
  summaries+=("$line")
}

# The serial tests on $RINGNET_TEST_WORKERS pytest-xdist workers (default 2; 0: one process):
# most of their time is spent waiting for the MPI jobs, launchers and clusters they start.
# tests/hpc's share one worker (tests/conftest.py); those marked `alone`, which time the
# machine itself, run after them with nothing beside them.
workers=()
if [ "$WORKERS" -gt 0 ]; then workers=(-n "$WORKERS"); fi
stage "serial" 1 python -m pytest -q --with-mpi "${workers[@]}" -m "not alone" tests "$@"
stage "serial, alone" 1 python -m pytest -q --with-mpi -m alone tests "$@"
for n in 2 3 4; do
  stage "mpirun -np $n" "$n" python -m pytest -q --with-mpi -m mpi -p no:cacheprovider tests "$@"
done

passed=0
for line in "${summaries[@]}"; do
  echo "$line"
  n=$(sed -nE 's/.* ([0-9]+) passed.*/\1/p' <<<"$line")
  passed=$((passed + ${n:-0}))
done
took=$((SECONDS - started))
if [ "$status" -eq 0 ]; then
  echo "all test runs passed: $passed test runs in $((took / 60)) min $((took % 60)) s"
else
  echo "some test run failed (exit $status); $passed test runs passed in $((took / 60)) min $((took % 60)) s"
fi
exit "$status"
