#!/usr/bin/env bash
# The whole test suite: serial tests (MPI-marked ones at N=1), then the MPI tests at N=2, 3, 4.
# Usage: bash tests/run.sh [extra pytest args]   (pytest's exit 5, "no tests collected", counts as success)
set -u
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=1 RINGNET_BLAS_THREADS=1 PYTHONDONTWRITEBYTECODE=1
MPIRUN=${MPIRUN:-mpirun}
status=0
run() {
  echo "+ $*"
  "$@"
  local rc=$?
  if [ "$rc" -ne 0 ] && [ "$rc" -ne 5 ]; then status=$rc; fi
}
run python -m pytest -q --with-mpi tests "$@"
for n in 2 3 4; do
  run "$MPIRUN" -np "$n" python -m pytest -q --with-mpi -m mpi -p no:cacheprovider tests "$@"
done
[ "$status" -eq 0 ] && echo "all test runs passed" || echo "some test run failed (exit $status)"
exit "$status"
