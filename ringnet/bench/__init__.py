"""Benchmarks: ``python -m ringnet.bench layers|comm|scaling|model|faults|elastic|delay|curves``."""
import json
import subprocess

from ringnet.errors import UsageError

__all__ = ["run_json"]


def run_json(cmd, what, env=None, timeout=None):
    """Run ``cmd`` and return the last JSON object it printed on stdout.

    A timeout or a failed run raises one-line UsageErrors naming ``what``; ringnet's own
    error line (a NaN loss, bad input) is preferred to MPI's abort line as the reason.
    """
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise UsageError(f"{what} ({' '.join(map(str, cmd))}) did not finish within "
                         f"{timeout:.0f} s") from None
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        errors = proc.stderr.strip().splitlines() or ["(no output)"]
        tail = next((line for line in errors if line.startswith("ringnet: error:")), errors[-1])
        raise UsageError(f"{what} failed (exit {proc.returncode}): {tail}")
    return json.loads(lines[-1])
