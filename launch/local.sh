#!/usr/bin/env bash
# Run ringnet on this workstation: one rank per GPU (or N CPU ranks), BLAS threads split evenly.
# Usage: launch/local.sh [-n N] [train flags...]      e.g.  launch/local.sh -n 4 --mode ring --delay 1
# Without -n: one rank per GPU, or one per CPU core. The launcher is $MPIRUN (default mpirun).
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
exec "$MPIRUN" -np "$N" python -m ringnet.train "$@"
