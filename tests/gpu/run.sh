#!/usr/bin/env bash
# Run the GPU tests (communication and training) on a machine with at least one CUDA GPU.
# Usage: tests/gpu/run.sh   (from the repository root, virtual environment active)
# Exit status: 0 all passed, 77 no GPU or no CuPy (nothing run), anything else a failure.
set -euo pipefail
cd "$(dirname "$0")/../.."
export OMP_NUM_THREADS=1
# Exit 77 (the "skipped" code of automake and meson) when there is nothing to test on.
if ! why=$(python -c "
try:
    import cupy
except ImportError:
    print('CuPy is not installed (pip install -e \".[gpu]\")')
else:
    print('' if cupy.is_available() else 'CuPy finds no usable CUDA GPU')
" 2>&1) || [ -n "$why" ]; then
  echo "tests/gpu/run.sh needs a CUDA GPU and CuPy: $why; no GPU test was run" >&2
  exit 77
fi
nvidia-smi -L || true
python -c "from cupy.cuda import nccl; print('NCCL', nccl.get_version() if nccl.available else 'not loadable')" || true

echo "== single process"
python -m pytest -q -m gpu tests/gpu
echo "== 2 ranks: MPI transport with CuPy buffers (host-staged unless MPI is CUDA-aware)"
mpirun -np 2 python -m pytest -q --with-mpi -m "gpu and mpi" tests/gpu
echo "== 2 ranks sharing GPUs: NCCL with NCCL_MULTI_RANK_GPU_ENABLE=1 (may be unsupported)"
NCCL_MULTI_RANK_GPU_ENABLE=1 mpirun -np 2 python -m pytest -q --with-mpi -m "gpu and mpi" -k nccl tests/gpu || \
    echo "NCCL with two ranks per GPU failed: this NCCL build does not support it"
echo "== training on the GPU equals the same run on the CPU (1 and 2 ranks)"
python -m pytest -q --with-mpi -m gpu tests/test_gpu_train.py
mpirun -np 2 python -m pytest -q --with-mpi -m gpu tests/test_gpu_train.py
echo "== ring delay 1 and split-fc on the GPU, 2 ranks, MPI transport"
mpirun -np 2 python -m ringnet.train --device gpu --transport mpi --steps 60 --json --quiet
mpirun -np 2 python -m ringnet.train --device gpu --transport mpi --mode split-fc --model lenet \
    --dataset synthetic --steps 20 --lr 0.001 --json --quiet
echo "== comm benchmark, 2 ranks"
mpirun -np 2 python -m ringnet.bench comm --transport mpi --sizes 1K,1M,16M --iters 5
