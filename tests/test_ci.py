"""The suite runs as the README's Quick start has it: CI (.ci/run) runs those commands as
written, and nothing the Quick start leaves out (matplotlib, PyTorch, CuPy, SLURM) is needed
for a test to pass, only for more tests to run."""
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ENV = dict(os.environ, OMP_NUM_THREADS="1", RINGNET_BLAS_THREADS="1")


def quick_start():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = text.split("\n## Quick start", 1)[1]
    block = re.search(r"^```bash\n(.*?)^```", section, re.M | re.S).group(1)
    return [line for line in block.splitlines() if line.strip()]


def test_ci_runs_the_quick_start_as_written():
    script = (ROOT / ".ci" / "run").read_text(encoding="utf-8").splitlines()
    commands = quick_start()
    assert len(commands) == 2
    assert commands[1].endswith("bash tests/run.sh") and "[test," in commands[1]
    # both lines, verbatim and in order, as commands of their own in .ci/run
    at = [script.index(c) for c in commands]
    assert at == sorted(at)
    # nothing is installed before the Quick start's own pip install
    installs = [l for l in script[:at[0]] if "pip install" in l and not l.lstrip().startswith("#")]
    assert installs == ["python -m pip install -q --upgrade pip"], installs


def _hidden(tmp_path, *modules):
    folder = tmp_path / "hidden"
    folder.mkdir()
    for module in modules:
        (folder / f"{module}.py").write_text(f'raise ModuleNotFoundError("No module named {module}")\n')
    return dict(ENV, PYTHONPATH=os.pathsep.join([str(folder), str(ROOT), ENV.get("PYTHONPATH", "")]))


def test_the_trace_tests_pass_without_matplotlib(tmp_path):
    skips = tmp_path / "skips.txt"
    env = dict(_hidden(tmp_path, "matplotlib"), RINGNET_TEST_SKIPS=str(skips))
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           "tests/test_trace.py", "-k", "exchange_runs_under or picture_of"],
                          capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert "1 passed, 1 skipped" in proc.stdout, proc.stdout[-1000:]
    # the skip is on record for CI's second pass, at its rank count
    assert skips.read_text().splitlines() == ["1 tests/test_trace.py::test_the_picture_of_a_trace"]


def test_the_cluster_tests_share_one_worker_and_the_others_spread():
    """tests/run.sh's serial stage runs on pytest-xdist workers: every test of tests/hpc is
    one unit of work (they start and stop this machine's clusters), every other its own."""
    import pytest
    pytest.importorskip("xdist")
    import conftest
    scope = conftest._ClusterTogether._split_scope
    hpc = ["tests/hpc/test_cluster.py::test_a", "tests/hpc/test_slurm.py::test_b[x-1]",
           "tests/hpc/test_cluster_cpus.py::test_c"]
    assert {scope(None, n) for n in hpc} == {"tests/hpc"}
    others = ["tests/test_ci.py::test_a", "tests/test_ci.py::test_b", "tests/hpcx.py::test_c",
              "tests/layers/test_layers.py::test_d[hpc]"]
    assert len({scope(None, n) for n in others}) == len(others)
    assert "tests/hpc" not in {scope(None, n) for n in others}


def test_a_skip_on_an_xdist_worker_is_on_record_once(tmp_path):
    """Under pytest-xdist the controller records the skips CI reruns, once each (the workers
    report them to it), and the pytest a worker's test starts in a child records its own."""
    import pytest
    pytest.importorskip("xdist")
    skips = tmp_path / "skips.txt"
    env = dict(_hidden(tmp_path, "matplotlib"), RINGNET_TEST_SKIPS=str(skips))
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           "-n", "2", "tests/test_trace.py", "-k",
                           "exchange_runs_under or picture_of"],
                          capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert "1 passed, 1 skipped" in proc.stdout, proc.stdout[-1000:]
    assert skips.read_text().splitlines() == ["1 tests/test_trace.py::test_the_picture_of_a_trace"]


def test_a_bad_worker_count_is_one_line_before_any_test():
    proc = subprocess.run(["bash", str(ROOT / "tests" / "run.sh")], capture_output=True,
                          text=True, env=dict(ENV, RINGNET_TEST_WORKERS="two"), timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == [
        "tests/run.sh: RINGNET_TEST_WORKERS must be a whole number of workers "
        "(0: one process), got 'two'"], proc.stderr
    assert proc.stdout == ""
