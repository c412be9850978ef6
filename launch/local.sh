#!/usr/bin/env bash
# Run ringnet on this workstation: one rank per GPU (or N CPU ranks), BLAS threads split evenly.
# Usage: launch/local.sh [-n N] [launch flags --] [train flags...]
#   e.g.  launch/local.sh -n 4 --mode ring --delay 1
#         launch/local.sh -n 4 --shrink -- --steps 2000 --save ck.h5 --save-every 100
# Without -n: one rank per GPU, or one per CPU core. The launcher is $MPIRUN (default mpirun).
# Runs under python -m ringnet.launch: a job that loses a rank is relaunched from its last
# checkpoint (launch flags: --shrink, --min-ranks M, --max-restarts R; see its --help).
set -euo pipefail
N=""
if [ "${1:-}" = "-n" ]; then
  if [ $# -lt 2 ] || ! [[ "$2" =~ ^[1-9][0-9]*$ ]]; then
    echo "ringnet: error: -n needs a positive rank count (usage: launch/local.sh [-n N] [train flags...])" >&2
    exit 2
  fi
  N=$2
  shift 2
fi
if [ -z "$N" ]; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    N=$(nvidia-smi -L | wc -l)          # one rank per GPU
  else
    N=$(python -c "import os; print(max(1, len(os.sched_getaffinity(0))))")
  fi
fi
# Ranks on this node only, also inside a SLURM job: there MPICH's mpirun would start them
# through srun, which waits forever when called inside an srun step. (Open MPI ignores this.)
export HYDRA_LAUNCHER=${HYDRA_LAUNCHER:-fork}
MPIRUN=${MPIRUN:-mpirun}
if ! command -v "$MPIRUN" >/dev/null 2>&1; then
  echo "ringnet: error: launcher '$MPIRUN' not found: pip install mpich (or load your MPI), or set MPIRUN" >&2
  exit 2
fi
LAUNCH=()                               # flags before a "--" are the launcher's
for arg in "$@"; do
  if [ "$arg" = "--" ]; then
    while [ "$1" != "--" ]; do LAUNCH+=("$1"); shift; done
    shift
    break
  fi
done
exec python -m ringnet.launch -n "$N" --launcher "$MPIRUN" ${LAUNCH[@]+"${LAUNCH[@]}"} -- "$@"
