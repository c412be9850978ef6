"""ringnet.jobs: what a failed child job's error says, and where its whole output is kept."""
import os
import re
import sys

import pytest

from ringnet import jobs
from ringnet.errors import UsageError


def test_failure_reason_prefers_ringnet_then_the_exception_then_the_last_line():
    srun = "srun: error: node1: task 0: Exited with exit code 1"
    traceback = ["Traceback (most recent call last):", '  File "x.py", line 1, in <module>',
                 "ValueError: operands could not be broadcast", srun]
    assert jobs.failure_reason("\n".join(traceback)) == "ValueError: operands could not be broadcast"
    mine = ["note: something", "[rank 1] ringnet: error: rank 0 did not arrive at setup", srun]
    assert jobs.failure_reason("\n".join(mine)) == mine[1]
    assert jobs.failure_reason("ringnet: error: --lr must be a finite number\n" + srun) \
        == "ringnet: error: --lr must be a finite number"
    assert jobs.failure_reason(f"one\n{srun}\n") == srun
    assert jobs.failure_reason("") == "(no output)"


def test_a_failed_run_names_the_exception_and_keeps_its_output(tmp_path, monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(jobs.tempfile, "tempdir", None)
    code = "import sys; print('out line'); raise KeyError('missing-piece')"
    with pytest.raises(UsageError) as info:
        jobs.run_json([sys.executable, "-c", code], "a job")
    message = str(info.value)
    assert message.startswith("a job failed (exit 1): KeyError: 'missing-piece' (its output: ")
    kept = re.search(r"its output: (\S+)\)$", message).group(1)
    assert os.path.dirname(kept) == str(tmp_path)
    with open(kept) as f:
        text = f.read()
    assert "out line" in text and "Traceback" in text and "# exit 1" in text


def test_a_run_that_succeeds_returns_its_last_json_and_leaves_no_file(tmp_path, monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(jobs.tempfile, "tempdir", None)
    code = "print('{\"a\": 1}'); print('text'); print('{\"a\": 2}')"
    assert jobs.run_json([sys.executable, "-c", code], "a job") == {"a": 2}
    assert os.listdir(tmp_path) == []


STALLS = """
import os, signal, sys
count = os.path.join(sys.argv[1], "count")
n = int(open(count).read()) if os.path.exists(count) else 0
open(count, "w").write(str(n + 1))
if n < int(sys.argv[2]):
    from ringnet import start_watch
    sys.stderr.write(start_watch.MESSAGE.format(seconds=3))
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGKILL)
print('{"run": %d}' % (n + 1))
"""


def test_a_run_whose_mpi_start_up_stalled_is_run_once_more(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path))     # the failed run's output is kept there
    monkeypatch.setattr(jobs.tempfile, "tempdir", None)
    from ringnet import start_watch

    from ringnet.jobs import run_json
    START_STALLED = start_watch.STALLED
    assert start_watch.MESSAGE.startswith(START_STALLED)
    script = tmp_path / "stalls.py"
    script.write_text(STALLS)
    first = tmp_path / "once"
    first.mkdir()
    assert run_json([sys.executable, str(script), str(first), "1"], "ring at N=2") == {"run": 2}
    assert "ring at N=2: MPI start-up stalled, starting it again" in capsys.readouterr().err
    twice = tmp_path / "twice"
    twice.mkdir()
    with pytest.raises(UsageError, match=r"ring at N=2 failed \(exit -9\): ringnet: error: MPI "
                                         r"start-up \(MPI_Init\) did not finish within 3 s"):
        run_json([sys.executable, str(script), str(twice), "2"], "ring at N=2")
    assert (twice / "count").read_text() == "2"         # once more, not again and again
    assert len(list(tmp_path.glob("ringnet-failed-run-*.log"))) == 1
