#!/usr/bin/env bash
# The GPU acceptance run, for a machine with at least one CUDA GPU.
# Usage: bash tests/gpu/run.sh [--stages gpu|cpu|all|NAME,...] [--report-dir DIR]
#                              [--wheelhouse DIR]          (repository root or anywhere)
#   --stages      gpu (default): the GPU stages, whose limits add up to 360 s on one GPU
#                 (multi-gpu and ddp-gpu, 390 s more, run only with two or more GPUs);
#                 cpu: the CPU stages (cpu-cores, model-valid; 280 s, no GPU needed);
#                 all; or stage names separated by commas.
#   --report-dir  each stage's row is appended to DIR/report.jsonl as soon as it ends (and
#                 the logs so far to DIR/gpu-logs.tar.gz), so a run killed at its limit
#                 still leaves what finished; at the end DIR/report.json has everything
#                 (the per-layer step tables too).
#   --wheelhouse  where the pre-check installs missing pieces from (default
#                 dist/gpu-wheelhouse, built by tests/gpu/wheelhouse.sh).
# Pre-check, before any stage: `from mpi4py import MPI`, `mpirun -np 2 true` and pytest-mpi
# must work (what is missing is installed from the wheelhouse first, offline); otherwise one
# line naming what is missing, exit 1.
#
# Stages (none may fail silently):
#   gpu-n1      single-process GPU tests: single mode on the GPU equals the CPU run (float64),
#               NCCL and MPI with CuPy buffers through every communicator at N=1, the fused
#               CUDA kernels (pooling, col2im, dropout masks) against the NumPy layers, CUDA
#               graphs (the cuBLAS route and its capture, replayed steps equal to eager steps
#               bit for bit, a run with --cuda-graphs on)
#   gpu-n2      2 ranks sharing the GPU(s), MPI transport with CuPy buffers: ring/tree/master
#               at delay 0 and 1, split-fc at delay 0 and 1 against single / the recurrence,
#               ring/tree/master at delay 0 as CUDA graphs per bucket span against single;
#               NCCL refused when ranks share a GPU
#   gpu-n4      the same modes at 4 ranks
#   multi-gpu   a host with G >= 2 GPUs, one rank per GPU over NCCL (mpirun -np G): every mode
#               (ring/tree/master delay 0 and 1, also delay 0 as CUDA graphs per bucket span,
#               split-fc delay 0 and 1 with and without its activation stream) against
#               single / the recurrence, each rank with a CUDA
#               context on its own GPU only; then `bench comm --transport nccl`, every
#               algorithm's all-reduce right at every size. One line and skipped on one GPU.
#   nccl-shared the CLI with --transport nccl on ranks that share a GPU: exit 2, one line
#   auto-shared the CLI with --transport auto on ranks that share a GPU: MPI, and it says why
#   quickstart  the README's main job (mpirun -np 4 python -m ringnet.train) on the GPU: it
#               picks the GPU by itself, learns (test accuracy >= 95%), times compute
#   step-times  each model's GPU step time, eager and replayed as a CUDA graph, beside
#               PyTorch's CUDA step (when torch has CUDA; the graph's target is <= 0.5x), and
#               per layer the host time of its calls beside its device time
#   ddp-gpu     a host with G >= 2 GPUs: `bench scaling --vs ddp --device gpu`, ring delay 1
#               over NCCL beside PyTorch DDP over NCCL on the same problem, at N = 2 and, with
#               4 or more GPUs, N = 4. One line and skipped on one GPU (one GPU cannot host
#               two NCCL ranks) or without a CUDA PyTorch.
#   cpu-cores   the CPU path where every rank has a core of its own (a GPU host has many):
#               `bench comm` (auto against MPI's all-reduce, 8 B-64 MiB, N = 2, 3, 4),
#               `bench scaling --ceiling` (ring delay 1 and 0 at N = 2, LeNet and
#               cifar10_quick, beside single at the per-rank batch) and `bench scaling
#               --vs ddp` (ring delay 1 beside PyTorch DDP over gloo at N = 2, 4,
#               cifar10_quick; one line and skipped without PyTorch). The
#               report keeps their numbers and targets; a missed target does not fail the
#               run (a shared host moves timings), a benchmark that does not run does.
#               Skipped on fewer than 4 cores.
#   model-valid the performance model's validation (`bench model --validate`, one round: every
#               mode at N = 1, 2, 4, LeNet and cifar10_quick, predicted beside measured) with a
#               core per rank; the report counts the rows within 15%, the record is kept in
#               the logs (bench-model-validation.json). Skipped on fewer than 4 cores.
# Under mpirun a rank whose test fails aborts the job (tests/gpu/mpi_abort.py), so a stage
# whose other ranks wait in a collective ends at once with that rank's error in its row.
# The last line is one JSON report (under 8,000 characters). Exit 0: every stage passed; 1: a
# stage failed, or the pre-check; 2: bad arguments; 77 (the "skipped" code of automake and
# meson): GPU stages asked for and no usable GPU here, one line, nothing run.
# GPU_RUN_LOGS=DIR keeps each stage's full log there as DIR/gpu-logs.tar.gz.
set -u
cd "$(dirname "$0")/../.."
GPU_STAGES="gpu-n1 gpu-n2 gpu-n4 multi-gpu ddp-gpu nccl-shared auto-shared quickstart step-times"
CPU_STAGES="cpu-cores model-valid"
SELECT=gpu REPORT_DIR="" WHEELHOUSE="$PWD/dist/gpu-wheelhouse"
while [ $# -gt 0 ]; do
  case "$1" in
    --stages) SELECT=${2:-}; shift 2 || { echo "run.sh: --stages needs a value" >&2; exit 2; } ;;
    --report-dir) REPORT_DIR=${2:-}; shift 2 || { echo "run.sh: --report-dir needs a folder" >&2; exit 2; } ;;
    --wheelhouse) WHEELHOUSE=${2:-}; shift 2 || { echo "run.sh: --wheelhouse needs a folder" >&2; exit 2; } ;;
    -h|--help) sed -n '2,/^set -u/p' "$0" | sed 's/^# \{0,1\}//' | sed '$d'; exit 0 ;;
    *) echo "run.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done
SELECTED=""
for item in ${SELECT//,/ }; do
  case "$item" in
    gpu) SELECTED="$SELECTED $GPU_STAGES" ;;
    cpu) SELECTED="$SELECTED $CPU_STAGES" ;;
    all) SELECTED="$SELECTED $GPU_STAGES $CPU_STAGES" ;;
    *) case " $GPU_STAGES $CPU_STAGES " in
         *" $item "*) SELECTED="$SELECTED $item" ;;
         *) echo "run.sh: --stages: unknown stage '$item' (gpu, cpu, all or one of:" \
                 "$GPU_STAGES $CPU_STAGES)" >&2; exit 2 ;;
       esac ;;
  esac
done
[ -n "$SELECTED" ] || { echo "run.sh: --stages names no stage" >&2; exit 2; }
selected() { case " $SELECTED " in *" $1 "*) return 0 ;; esac; return 1; }
needs_gpu=false
for name in $GPU_STAGES; do selected "$name" && needs_gpu=true; done
if [ -n "$REPORT_DIR" ]; then
  mkdir -p "$REPORT_DIR" || { echo "run.sh: cannot make --report-dir $REPORT_DIR" >&2; exit 2; }
  REPORT_DIR=$(cd "$REPORT_DIR" && pwd)
  : > "$REPORT_DIR/report.jsonl"
fi

# This checkout's ringnet, also in the scripts and under mpirun; tests/gpu for mpi_abort.
export PYTHONPATH="$PWD:$PWD/tests/gpu${PYTHONPATH:+:$PYTHONPATH}" OMP_NUM_THREADS=1 PYTHONDONTWRITEBYTECODE=1
MPIRUN=${MPIRUN:-mpirun}
WORK=$(mktemp -d)
keep_logs() {
  if [ -n "${GPU_RUN_LOGS:-}" ]; then tar -czf "$GPU_RUN_LOGS/gpu-logs.tar.gz" -C "$WORK" . ; fi
  rm -rf "$WORK"
}
trap keep_logs EXIT
# shellcheck source=tests/gpu/stage.sh
. tests/gpu/stage.sh
if ! command -v python >/dev/null && command -v python3 >/dev/null; then
  mkdir -p "$WORK/bin" && ln -s "$(command -v python3)" "$WORK/bin/python"
  export PATH="$WORK/bin:$PATH"
fi

# Pre-check: what every stage needs; the missing pieces from the wheelhouse, offline.
missing() {
  local out=""
  python -c "import pytest" 2>/dev/null || out="$out, pytest"
  python -c "import pytest_mpi" 2>/dev/null || out="$out, pytest-mpi"
  python -c "from mpi4py import MPI" 2>/dev/null || out="$out, a working 'from mpi4py import MPI'"
  timeout 60 "$MPIRUN" -np 2 true >/dev/null 2>&1 || out="$out, a working '$MPIRUN -np 2 true'"
  echo "${out#, }"
}
lacking=$(missing)
if [ -n "$lacking" ] && [ -d "$WHEELHOUSE" ]; then
  wants=""
  case "$lacking" in *pytest-mpi*) wants="$wants pytest-mpi" ;; esac
  case "$lacking" in *mpi4py*|*"-np 2"*) wants="$wants mpich" ;; esac
  if [ -n "$wants" ]; then
    echo "== pre-check: installing$wants from $WHEELHOUSE"
    # shellcheck disable=SC2086  # a list of names
    python -m pip install --no-index --no-deps --find-links "$WHEELHOUSE" $wants \
        > "$WORK/pip.log" 2>&1 || tail -n 3 "$WORK/pip.log" > "$WORK/pip.tail"
    scripts=$(python -c "import sysconfig; print(sysconfig.get_path('scripts'))")
    export PATH="$scripts:$PATH"
    hash -r
    lacking=$(missing)
  fi
fi
if [ -n "$lacking" ]; then
  where="no wheelhouse at $WHEELHOUSE (build it with: bash tests/gpu/wheelhouse.sh)"
  [ -d "$WHEELHOUSE" ] && where="not in, or not working from, the wheelhouse $WHEELHOUSE"
  [ -s "$WORK/pip.tail" ] && where="$where (pip: $(tr '\n' ' ' < "$WORK/pip.tail"))"
  echo "tests/gpu/run.sh: missing $lacking; $where; no stage was run" >&2
  if [ -n "$REPORT_DIR" ]; then
    python -c 'import json, sys; print(json.dumps({"stage": "pre-check", "passed": False, "missing": sys.argv[1]}))' \
        "$lacking" >> "$REPORT_DIR/report.jsonl"
  fi
  exit 1
fi

GPUS=0
if $needs_gpu; then
  if ! why=$(python - 2>&1 <<'EOF'
import sys
try:
    from ringnet.backend import check_gpu, gpu_available
except Exception as exc:  # noqa: BLE001
    sys.exit(f"cannot import ringnet: {exc}")
if not gpu_available():
    sys.exit("CuPy is missing or sees no CUDA GPU")
try:
    check_gpu()
except RuntimeError as exc:
    sys.exit(str(exc))
EOF
  ); then
    echo "tests/gpu/run.sh needs a CUDA GPU and CuPy: ${why##*$'\n'}; no GPU test was run" >&2
    exit 77
  fi
  GPUS=$(python -c "import cupy; print(cupy.cuda.runtime.getDeviceCount())")
fi
# the cores this job may use (the CPU stages need one per rank, 4 ranks)
CORES=$(python -c "import os; print(len(os.sched_getaffinity(0)))")

# --transport nccl with ranks sharing a GPU must end with exit 2 and one error line.
nccl_shared() {
  if [ "$GPUS" -ge 2 ]; then echo "skipped: $GPUS GPUs, 2 ranks do not share one"; return 0; fi
  "$MPIRUN" -np 2 python -m ringnet.train --device gpu --transport nccl --steps 1 --quiet \
      > "$WORK/nccl-shared.out" 2>&1
  local rc=$?
  cat "$WORK/nccl-shared.out"
  [ "$rc" -eq 2 ] && [ "$(grep -c 'ringnet: error:.*share GPU' "$WORK/nccl-shared.out")" -eq 1 ] \
    && ! grep -q Traceback "$WORK/nccl-shared.out"
}

# --transport auto with ranks sharing a GPU must choose MPI and give the reason.
auto_shared() {
  if [ "$GPUS" -ge 2 ]; then echo "skipped: $GPUS GPUs, 2 ranks do not share one"; return 0; fi
  "$MPIRUN" -np 2 python -m ringnet.train --device gpu --steps 2 --json --quiet > "$WORK/auto.json" \
    || return 1
  cat "$WORK/auto.json"
  python - "$WORK/auto.json" <<'EOF'
import json, sys
summary = json.loads(open(sys.argv[1]).read().strip().splitlines()[-1])
assert summary["device"] == "gpu" and summary["transport"] == "mpi", summary
assert "share GPU" in summary["transport_reason"], summary["transport_reason"]
EOF
}

# The Quick start's job, as a user runs it on a GPU machine: device auto must find the GPU.
quickstart() {
  "$MPIRUN" -np 4 python -m ringnet.train --json --quiet > "$WORK/quickstart.json" || return 1
  cat "$WORK/quickstart.json"
  python - "$WORK/quickstart.json" <<'EOF'
import json, sys
s = json.loads(open(sys.argv[1]).read().strip().splitlines()[-1])
assert s["device"] == "gpu" and s["ranks"] == 4, s
assert s["test_accuracy"] >= 0.95, f"test accuracy {s['test_accuracy']}"
assert s["compute_s"] > 0 and s["update_s"] > 0, "GPU spans were not timed"
EOF
}

# The CPU path with a core per rank: all-reduce against MPI's own, the ring's speedup at N = 2.
cpu_cores() {
  if [ "$CORES" -lt 4 ]; then echo "skipped: $CORES cores, fewer than 4 ranks"; return 0; fi
  for n in 2 3 4; do
    "$MPIRUN" -np "$n" python -m ringnet.bench comm --algos native,auto --transport mpi \
        --iters 20 --json > "$WORK/comm-$n.json" || return 1
    tail -n 1 "$WORK/comm-$n.json"
  done
  for model in lenet cifar10_quick; do
    python -m ringnet.bench scaling --np 1 2 --modes ring --model "$model" --steps 20 \
        --repeats 3 --ceiling --json > "$WORK/scaling-$model.json" || return 1
    tail -n 1 "$WORK/scaling-$model.json"
  done
  if python -c "import torch" 2>/dev/null; then
    python -m ringnet.bench scaling --np 2 4 --modes ring --delays 1 --model cifar10_quick \
        --steps 20 --repeats 1 --vs ddp --json > "$WORK/vs-ddp-cpu.json" || return 1
    tail -n 1 "$WORK/vs-ddp-cpu.json"
  else
    echo "skipped --vs ddp: no PyTorch here (pip install torch==2.13.0)"
  fi
  python - "$WORK" "$CORES" <<'EOF'
import json, os, sys
work, cores = sys.argv[1], int(sys.argv[2])
out = {"cores": cores, "allreduce": [], "scaling": []}


def last_json(name):
    return json.loads(open(os.path.join(work, name)).read().strip().splitlines()[-1])


for n in (2, 3, 4):
    doc = last_json(f"comm-{n}.json")
    out["allreduce"] += [{"np": n, "bytes": r["bytes"], "picked": r["picked"],
                          "vs_native": round(r["vs_native"], 3),
                          "quartiles": [round(q, 3) for q in r["vs_native_quartiles"]],
                          "target": r["target"],
                          "passed": r["passed"]} for r in doc["rows"] if r["algo"] == "auto"]
for model in ("lenet", "cifar10_quick"):
    doc = last_json(f"scaling-{model}.json")
    out["scaling"] += [{"model": model, "mode": r["mode"], "delay": r["delay"], "np": r["np"],
                        "step_ms": r["step_ms"], "speedup": r["speedup"],
                        "ceiling": r.get("ceiling")} for r in doc["rows"]]
if os.path.exists(os.path.join(work, "vs-ddp-cpu.json")):
    doc = last_json("vs-ddp-cpu.json")
    out["vs_ddp"] = {"load": doc["load"], "rows": [
        {"mode": r["mode"], "delay": r["delay"], "np": r["np"], "step_ms": r["step_ms"],
         "vs_ddp": r.get("vs_ddp")} for r in doc["rows"]]}
json.dump(out, open(os.path.join(work, "cpu-cores.json"), "w"))
print(json.dumps(out))
EOF
}

# The performance model against measured steps where every rank has a core.
model_validation() {
  if [ "$CORES" -lt 4 ]; then echo "skipped: $CORES cores, fewer than 4 ranks"; return 0; fi
  python -m ringnet.bench model --np 1 2 4 --profile pcie3 --validate --validate-repeats 1 \
      --validate-steps 20 --validation "$WORK/bench-model-validation.json" --json \
      > "$WORK/model.json" || return 1
  python - "$WORK" "$CORES" <<'EOF'
import json, os, statistics, sys
work, cores = sys.argv[1], int(sys.argv[2])
doc = json.loads(open(os.path.join(work, "model.json")).read().strip().splitlines()[-1])
rows = doc["validation"]
errors = [(r["predicted_ms"] - r["measured_ms"]) / r["measured_ms"] for r in rows]
out = {"cores": cores, "rows": len(rows), "within_15": sum(abs(e) <= 0.15 for e in errors),
       "median_abs_error": round(statistics.median(abs(e) for e in errors), 3),
       "outside": [{k: r[k] for k in ("model", "mode", "delay", "np")} | {"error": round(e, 3)}
                   for r, e in zip(rows, errors) if abs(e) > 0.15]}
json.dump(out, open(os.path.join(work, "model-validation.json"), "w"))
print(json.dumps(out))
EOF
}

# The ring over NCCL beside PyTorch DDP over NCCL, one rank per GPU: two or more GPUs.
ddp_gpu() {
  if [ "$GPUS" -lt 2 ]; then
    echo "skipped: $GPUS GPU here; one GPU cannot host two NCCL ranks (--vs ddp --device gpu needs 2)"
    return 0
  fi
  if ! python -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
    echo "skipped: no PyTorch with CUDA here"; return 0
  fi
  local nps=2
  if [ "$GPUS" -ge 4 ]; then nps="2 4"; else echo "N = 4 skipped: $GPUS GPUs"; fi
  # shellcheck disable=SC2086  # nps is a list of rank counts
  python -m ringnet.bench scaling --np $nps --modes ring --delays 1 --model cifar10_quick \
      --device gpu --steps 30 --repeats 2 --vs ddp --json > "$WORK/vs-ddp-gpu.json" || return 1
  tail -n 1 "$WORK/vs-ddp-gpu.json"
  python - "$WORK" <<'EOF'
import json, os, sys
work = sys.argv[1]
doc = json.loads(open(os.path.join(work, "vs-ddp-gpu.json")).read().strip().splitlines()[-1])
rows = [{"mode": r["mode"], "delay": r["delay"], "np": r["np"], "step_ms": r["step_ms"],
         "vs_ddp": r.get("vs_ddp")} for r in doc["rows"]]
assert {r["np"] for r in rows if r["mode"] == "ddp"} >= {2}, rows
json.dump({"rows": rows, "load": doc["load"]}, open(os.path.join(work, "ddp-gpu.json"), "w"))
print(json.dumps(rows))
EOF
}

# Every mode over NCCL with one rank per GPU, and bench comm over NCCL: two or more GPUs.
multi_gpu() {
  "$MPIRUN" -np "$GPUS" python -m pytest -q -x -rfEs --tb=short -p no:cacheprovider -p mpi_abort \
      --with-mpi -m "gpu and mpi" tests/gpu/test_gpu_nccl_modes.py || return 1
  "$MPIRUN" -np "$GPUS" python -m ringnet.bench comm --transport nccl \
      --algos ring,tree,master,auto,native --iters 10 --json > "$WORK/comm-nccl.json" || return 1
  tail -n 1 "$WORK/comm-nccl.json"
  python - "$WORK/comm-nccl.json" "$GPUS" <<'EOF'
import json, sys
doc = json.loads(open(sys.argv[1]).read().strip().splitlines()[-1])
assert doc["transport"] == "nccl" and doc["ranks"] == int(sys.argv[2]), (doc["transport"], doc["ranks"])
wrong = [(r["algo"], r["bytes"]) for r in doc["rows"] if not r["ok"]]
assert not wrong, f"all-reduce over NCCL gave wrong sums: {wrong}"
EOF
}

export -f nccl_shared auto_shared quickstart cpu_cores model_validation multi_gpu ddp_gpu
export WORK GPUS CORES MPIRUN
PYTEST="python -m pytest -q -rfEs --tb=short -p no:cacheprovider -p mpi_abort --with-mpi"
# Under mpirun: stop at the first failure (mpi_abort then ends every rank at once).
MPYTEST="$PYTEST -x"
# One GPU: 100 + 70 + 70 + 20 + 25 + 40 + 35 = 360 s of limits.
selected gpu-n1 && stage gpu-n1 100 $PYTEST -m gpu tests/gpu/test_gpu_comm.py tests/gpu/test_gpu_train.py \
    tests/gpu/test_gpu_graphs.py tests/layers/test_cuda_kernels.py tests/layers/test_loss_kernel.py
selected gpu-n2 && stage gpu-n2 70 "$MPIRUN" -np 2 $MPYTEST -m "gpu and mpi" tests/gpu/test_gpu_comm.py \
    tests/gpu/test_gpu_comm_auto.py tests/gpu/test_gpu_modes.py tests/gpu/test_gpu_train.py
selected gpu-n4 && stage gpu-n4 70 "$MPIRUN" -np 4 $MPYTEST -m "gpu and mpi" tests/gpu/test_gpu_modes.py
if selected multi-gpu; then
  if [ "$GPUS" -ge 2 ]; then stage multi-gpu 300 bash -c multi_gpu
  else skip_stage multi-gpu "$GPUS GPU here, the NCCL stage needs two or more"; fi
fi
if selected ddp-gpu; then
  if [ "$GPUS" -ge 2 ]; then stage ddp-gpu 90 bash -c ddp_gpu
  else skip_stage ddp-gpu "$GPUS GPU here; one GPU cannot host two NCCL ranks"; fi
fi
selected nccl-shared && stage nccl-shared 20 bash -c nccl_shared
selected auto-shared && stage auto-shared 25 bash -c auto_shared
selected quickstart && stage quickstart 40 bash -c quickstart
selected step-times && stage step-times 35 python tests/gpu/step_vs_torch.py --layers --out "$WORK/steps.json"
selected cpu-cores && stage cpu-cores 130 bash -c cpu_cores
selected model-valid && stage model-valid 150 bash -c model_validation

python tests/gpu/report.py final "$WORK" "$REPORT_DIR"
