"""Benchmarks: ``python -m ringnet.bench layers|comm|scaling|model|faults|elastic|delay|curves``."""
import json
import statistics
import subprocess

from ringnet.errors import UsageError

__all__ = ["run_json", "paired_quartiles"]


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


def paired_quartiles(ours, theirs):
    """Return the lower and upper quartile of the ratios ours[i] / theirs[i].

    Benchmarks that time two things alternately pair each sample with its partner: a slow
    moment of the machine slows both and leaves their ratio, so these quartiles say how far
    the ratio itself moves, which the two medians' spreads would overstate. (Plain Python:
    this package is imported before ``bench layers`` pins NumPy's BLAS threads.)
    """
    ratios = [a / b for a, b in zip(ours, theirs, strict=True)]
    if len(ratios) < 2:
        return [ratios[0], ratios[0]]
    q1, _, q3 = statistics.quantiles(ratios, n=4, method="inclusive")
    return [q1, q3]
