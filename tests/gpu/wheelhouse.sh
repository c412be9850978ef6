#!/usr/bin/env bash
# Build, on a machine that reaches PyPI, the wheelhouse a GPU machine without network needs
# for tests/gpu/run.sh: pytest-mpi, the MPICH library and launcher (mpirun) as a wheel for
# Linux x86-64 (any Python; the GPU machine has mpi4py but no MPI library), and a wheel of
# this checkout. run.sh's pre-check installs from it what is missing there, offline.
# Usage: bash tests/gpu/wheelhouse.sh [DIR]   (default dist/gpu-wheelhouse: git-ignored, so
#        it travels only where it is carried; about 14 MB)
# Versions: MPICH_VERSION (default 5.0.2), PYTEST_MPI_VERSION (default 0.6),
# PYTHON_VERSION of the GPU machine (default 3.12).
set -eu
cd "$(dirname "$0")/../.."
DIR=${1:-dist/gpu-wheelhouse}
mkdir -p "$DIR"
python -m pip download -q --no-deps --only-binary=:all: --dest "$DIR" \
    --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 \
    --python-version "${PYTHON_VERSION:-3.12}" --implementation cp \
    "mpich==${MPICH_VERSION:-5.0.2}" "pytest-mpi==${PYTEST_MPI_VERSION:-0.6}"
rm -f "$DIR"/ringnet-*.whl
python -m pip wheel -q --no-deps --no-build-isolation --wheel-dir "$DIR" .
ls -1 "$DIR"
du -sh "$DIR" | cut -f1
