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
