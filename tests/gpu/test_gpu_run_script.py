"""tests/gpu/run.sh without a GPU: the stage selector, the pre-check's one line, each
stage's row written as the stage ends, a stage whose rank raised while the others wait in a
collective, and the final JSON line's length; step_vs_torch's TF32 switch. (The run itself
without a GPU exits 77: tests/test_cli.py.)"""
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import launcher_free_env

ROOT = Path(__file__).resolve().parents[2]
GPU = ROOT / "tests" / "gpu"
sys.path.insert(0, str(GPU))
import report  # noqa: E402  (tests/gpu/report.py)


def _env(**more):
    return dict(launcher_free_env(), OMP_NUM_THREADS="1", **more)


def _one_core():
    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})   # the CPU stages skip at once


def _run_sh(*args, env=None, timeout=120):
    return subprocess.run(["bash", "tests/gpu/run.sh", *args], cwd=ROOT, env=env or _env(),
                          capture_output=True, text=True, timeout=timeout, preexec_fn=_one_core)


def _rows(path):
    return [json.loads(line) for line in open(path)]


def test_the_cpu_stages_run_only_when_asked_and_each_leaves_its_row(tmp_path):
    proc = _run_sh("--stages", "cpu", "--report-dir", str(tmp_path / "r"),
                   "--wheelhouse", str(tmp_path / "none"))
    assert proc.returncode == 0, proc.stderr
    rows = _rows(tmp_path / "r" / "report.jsonl")
    assert [r["stage"] for r in rows] == ["cpu-cores", "model-valid"]
    last = json.loads(proc.stdout.strip().splitlines()[-1])
    assert [s["stage"] for s in last["stages"]] == ["cpu-cores", "model-valid"] and last["passed"]
    assert json.load(open(tmp_path / "r" / "report.json"))["stages"] == rows
    assert (tmp_path / "r" / "gpu-logs.tar.gz").exists()
    one = _run_sh("--stages", "model-valid", "--wheelhouse", str(tmp_path / "none"))
    assert [s["stage"] for s in json.loads(one.stdout.splitlines()[-1])["stages"]] == ["model-valid"]


@pytest.mark.parametrize("args", [["--stages", "gpu-n9"], ["--stages", ","], ["--nosuch"]])
def test_a_bad_selector_is_one_line(args):
    proc = _run_sh(*args)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert "Traceback" not in proc.stderr and not proc.stdout


def test_a_missing_pytest_mpi_is_one_line_before_any_stage(tmp_path):
    shim = tmp_path / "no_pytest_mpi"
    shim.mkdir()
    (shim / "pytest_mpi.py").write_text('raise ImportError("No module named pytest_mpi")\n')
    proc = _run_sh("--stages", "cpu", "--report-dir", str(tmp_path / "r"), "--wheelhouse",
                   str(tmp_path / "none"), env=_env(PYTHONPATH=f"{shim}:{ROOT}"))
    assert proc.returncode == 1 and proc.stderr.count("\n") == 1, proc.stderr
    assert "missing pytest-mpi" in proc.stderr and "tests/gpu/wheelhouse.sh" in proc.stderr
    assert "==" not in proc.stdout                                 # no stage ran
    assert _rows(tmp_path / "r" / "report.jsonl") == [
        {"stage": "pre-check", "passed": False, "missing": "pytest-mpi"}]


def _stages(tmp_path, script, timeout=120):
    work, out = tmp_path / "work", tmp_path / "out"
    work.mkdir()
    out.mkdir()
    env = _env(WORK=str(work), REPORT_DIR=str(out), PYTHONPATH=f"{GPU}:{ROOT}")
    proc = subprocess.run(["bash", "-c", f". tests/gpu/stage.sh\n{script}"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)
    return proc, _rows(out / "report.jsonl")


def test_each_stage_row_is_written_when_the_stage_ends_and_a_limit_holds(tmp_path):
    start = time.monotonic()
    proc, rows = _stages(tmp_path, "stage first 20 echo hello\n"
                         # the first row is on file while the second stage runs
                         "stage slow 2 bash -c 'grep -q first \"$REPORT_DIR/report.jsonl\" "
                         "&& sleep 60'\n")
    assert time.monotonic() - start < 30, proc.stdout
    assert [r["stage"] for r in rows] == ["first", "slow"]
    assert rows[0]["passed"] and rows[0]["exit"] == 0
    assert rows[1]["timed_out"] and rows[1]["exit"] == 124 and rows[1]["seconds"] < 10
    assert rows[1]["error"][0] == "timed out at its limit of 2 s"


# The launcher's output as it came, as if the abort cut it before the rank's lines, and with
# more error lines after them than a row keeps.
AFTER_MPIRUN = ["", " >/dev/null 2>&1",
                "; rc=$?; for i in 1 2 3 4 5 6 7 8; do echo \"Error $i after\"; done; exit $rc"]


@pytest.mark.parametrize("after", AFTER_MPIRUN, ids=["as-is", "output-lost", "errors-after"])
def test_a_rank_that_raises_ends_the_stage_with_its_error(tmp_path, after):
    test = tmp_path / "test_one_rank.py"
    test.write_text("import pytest\nfrom mpi4py import MPI\n\n\n@pytest.mark.mpi\n"
                    "def test_one_rank_raises():\n"
                    "    if MPI.COMM_WORLD.Get_rank() == 1:\n"
                    "        raise ValueError('rank 1 broke here')\n"
                    "    MPI.COMM_WORLD.Barrier()\n")
    start = time.monotonic()
    mpirun = (f"mpirun -np 2 python -m pytest -q -x -p no:cacheprovider -p mpi_abort "
              f"--with-mpi {test}")
    proc, rows = _stages(tmp_path, f"stage ranks 90 bash -c '{mpirun}{after}'\n")
    assert time.monotonic() - start < 60, proc.stdout
    row, = rows
    assert not row["passed"] and not row["timed_out"], row
    assert "rank 1 FAILED" in row["error"][0] and "rank 1 broke here" in row["error"][0], row
    assert len(row["error"]) <= 6 and sum("rank 1 FAILED" in e for e in row["error"]) == 1, row


def test_the_json_line_stays_short_and_the_file_keeps_everything(tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    layers = [{"layer": f"conv{i}", "fwd_host": 0.1, "fwd_gpu": 0.2, "bwd_host": 0.3,
               "bwd_gpu": 0.4} for i in range(40)]
    steps = [{"model": f"m{i}", "step_ms": 1.0, "graph_step_ms": 0.5, "torch_step_ms": 1.1,
              "torch_tf32": "off", "layers": layers} for i in range(6)]
    (work / "steps.json").write_text(json.dumps(steps))
    with open(work / "stages.jsonl", "w") as f:
        for i in range(12):
            f.write(json.dumps({"stage": f"s{i}", "passed": False, "exit": 1, "seconds": 3,
                                "command": "x" * 400, "error": ["E " + "y" * 298] * 6}) + "\n")
    (work / "model-validation.json").write_text(json.dumps({"outside": [{"e": 1}] * 500}))
    proc = subprocess.run([sys.executable, str(GPU / "report.py"), "final", str(work),
                           str(tmp_path)], capture_output=True, text=True, env=_env())
    assert proc.returncode == 1
    line = proc.stdout.strip()
    assert "\n" not in line and len(line) < report.LINE_MAX
    short = json.loads(line)
    assert [s["stage"] for s in short["stages"]] == [f"s{i}" for i in range(12)]
    full = json.load(open(tmp_path / "report.json"))
    assert full["step_times"][0]["layers"] == layers and len(full["stages"][0]["error"]) == 6


def test_step_vs_torch_turns_tf32_off(monkeypatch):
    torch = pytest.importorskip("torch")
    import step_vs_torch
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    try:
        got, why = step_vs_torch._torch_cuda()
        assert got is torch and why is None
        assert not torch.backends.cuda.matmul.allow_tf32 and not torch.backends.cudnn.allow_tf32
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved
