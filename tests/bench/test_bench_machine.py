"""What every benchmark says of its machine: the BLAS that ran and the load average, and no
verdict while the machine is busy (ringnet.blas.describe, ringnet.bench.machine)."""
import json
import os
import subprocess
import sys

import pytest

from ringnet import blas
from ringnet.bench import machine

from tests.test_docs import _main_output

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _loads(monkeypatch, *values, cores=2):
    """Make the 1-minute load average read ``values`` in turn, on a machine of ``cores``."""
    seq = iter(values)
    monkeypatch.setattr(machine.os, "getloadavg", lambda: (next(seq), 0.0, 0.0))
    monkeypatch.setattr(machine.os, "cpu_count", lambda: cores)


def test_describe_reports_the_kernel_variables_and_changes_none(monkeypatch):
    monkeypatch.setenv("OPENBLAS_L2_SIZE", "512")
    monkeypatch.delenv("OPENBLAS_CORETYPE", raising=False)
    watched = blas.KERNEL_VARS + ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")
    before = {var: os.environ.get(var) for var in watched}
    info = blas.describe()
    assert {var: os.environ.get(var) for var in watched} == before
    assert info["env"] == {"OPENBLAS_CORETYPE": None, "OPENBLAS_L2_SIZE": "512"}
    line = blas.describe_line(info, threads=1, per_rank=True)
    assert line.startswith("BLAS: ") and "1 thread per rank" in line
    assert line.endswith("OPENBLAS_CORETYPE unset, OPENBLAS_L2_SIZE=512")
    # the library NumPy loaded, as threadpoolctl sees it
    from threadpoolctl import threadpool_info
    apis = {i["internal_api"] for i in threadpool_info() if i["user_api"] == "blas"}
    assert {lib["internal_api"] for lib in info["libraries"]} == apis
    for lib in info["libraries"]:
        assert f"{lib['internal_api']} {lib['version']}" in line
        if lib["architecture"]:
            assert f"{lib['architecture']} kernels" in line


def test_a_user_s_kernel_choice_reaches_the_process_and_the_line():
    """A subprocess with both variables set: the line names them, OpenBLAS ran with them
    (the kernels threadpoolctl reports follow OPENBLAS_CORETYPE) and nothing unset them."""
    code = ("import os, json; from ringnet.blas import configure_blas_threads, describe, describe_line\n"
            "configure_blas_threads(); info = describe()\n"
            "print(json.dumps([describe_line(info), os.environ.get('OPENBLAS_CORETYPE'), "
            "os.environ.get('OPENBLAS_L2_SIZE'), info['libraries']]))")
    env = dict(os.environ, OPENBLAS_CORETYPE="Sandybridge", OPENBLAS_L2_SIZE="512",
               PYTHONPATH=ROOT)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    line, coretype, l2, libraries = json.loads(proc.stdout)
    assert (coretype, l2) == ("Sandybridge", "512")
    assert "OPENBLAS_CORETYPE=Sandybridge, OPENBLAS_L2_SIZE=512" in line
    openblas = [lib for lib in libraries if lib["internal_api"] == "openblas"]
    if openblas and openblas[0]["architecture"]:
        assert openblas[0]["architecture"] == "Sandybridge"


def test_no_verdict_while_busy_and_why(monkeypatch):
    _loads(monkeypatch, 0.50, 2.30)
    run = machine.begin(out=False)
    assert run.end(out=False) == "load average 0.50 at start, 2.30 at end (2 cores: busy, above 1.5)"
    assert run.verdict(True) == run.verdict(False) == \
        "no verdict: load average 2.30 at end, above 1.5 for 2 cores"
    facts = run.facts()
    assert facts["load"] == {"start": 0.5, "end": 2.3, "cores": 2, "busy_above": 1.5,
                             "busy": "load average 2.30 at end, above 1.5 for 2 cores"}
    assert set(facts["blas"]) >= {"libraries", "threads", "env", "threads_ran"}

    _loads(monkeypatch, 1.60, 1.70, cores=2)
    run = machine.begin(out=False)
    run.end(out=False)
    assert run.verdict(True) == "no verdict: load average 1.60 at start and 1.70 at end, " \
                                "above 1.5 for 2 cores"


def test_the_first_line_says_busy_when_the_machine_is(monkeypatch):
    """A busy machine is said at the top, where a reader starts, not only in the footer."""
    _loads(monkeypatch, 2.30, 0.5, cores=2)
    assert "BUSY: other programs share the cores" in machine.begin(out=False).header()
    _loads(monkeypatch, 1.50, 0.5, cores=2)          # not above 0.75 per core
    assert "BUSY" not in machine.begin(out=False).header()


def test_a_verdict_on_a_quiet_machine(monkeypatch):
    _loads(monkeypatch, 0.40, 1.50, cores=2)        # 1.5 is not above 0.75 per core
    run = machine.begin(out=False)
    assert "quiet" in run.end(out=False)
    assert (run.verdict(True), run.verdict(False)) == ("PASS", "FAIL")
    _loads(monkeypatch, 5.0, 5.9, cores=8)          # 6 on 8 cores: quiet
    run = machine.begin(out=False)
    run.end(out=False)
    assert run.verdict(True) == "PASS" and run.busy_above == 6.0


def _lines(proc):
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout.strip().splitlines()


def _bench(*args):
    env = dict(os.environ, OMP_NUM_THREADS="1", RINGNET_BLAS_THREADS="1", PYTHONPATH=ROOT)
    return subprocess.run([sys.executable, "-m", "ringnet.bench", *args], capture_output=True,
                          text=True, env=env, timeout=300, cwd=ROOT)


@pytest.mark.parametrize("argv", [["budget", "--model", "lenet"],
                                  ["layers", "--model", "lenet", "--iters", "1", "--batch-size", "2"],
                                  ["model", "--np", "1", "2", "--compute", "k40"]],
                         ids=lambda a: a[0])
def test_a_benchmark_starts_with_its_blas_and_ends_with_the_load(argv):
    lines = _lines(_bench(*argv))
    assert lines[0].startswith("BLAS: ") and "load average" in lines[0], lines[0]
    assert lines[-1].startswith("load average ") and " at end (" in lines[-1], lines[-1]


def test_json_carries_the_same_facts_and_stdout_stays_one_json_line():
    proc = _bench("budget", "--model", "lenet", "--json")
    lines = _lines(proc)
    assert len(lines) == 1
    doc = json.loads(lines[0])
    assert doc["blas"]["env"].keys() == {"OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE"}
    assert set(doc["load"]) >= {"start", "end", "cores", "busy_above"}
    assert proc.stderr.startswith("BLAS: ")


def test_scaling_names_its_blas_and_the_load(monkeypatch):
    from ringnet.bench import scaling
    monkeypatch.setattr(scaling, "run_config", lambda a, mode, delay, n, **kw: {
        "step_ms": 10.0 / n, "comm_wait_s": 0.0, "steps": 3, "overlap": 0.0,
        "bytes_per_step": 0, "fc_params_per_rank": None, "blas_threads": 1})
    lines = _main_output(scaling.main, ["--np", "1", "2", "--modes", "ring", "--repeats", "1"]).splitlines()
    assert lines[0].startswith("BLAS: ") and "1 thread per rank" in lines[0]
    assert lines[-1].startswith("load average ")
    doc = json.loads(_main_output(scaling.main, ["--np", "1", "2", "--modes", "ring", "--repeats", "1",
                                                 "--json"]).strip().splitlines()[-1])
    assert doc["blas"]["threads_ran"] == 1 and doc["threads_ran"] == {"ringnet": [1]}
    assert doc["load"]["end"] is not None
