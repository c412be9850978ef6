"""bench soak: the fit and verdict against closed-form lines, and a short real run."""
import json
import os
import subprocess
import sys

import pytest

from ringnet.bench import soak

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_the_fit_recovers_a_line_and_its_noise():
    steps = list(range(0, 10000, 100))
    noise = [(-1) ** i * 30.0 for i in range(len(steps))]           # +-30 KB alternating
    rss = [50_000 + 0.004 * s + e for s, e in zip(steps, noise)]     # 4 KB per 1,000 steps
    slope, resid = soak.fit(steps, rss)
    assert slope * 1000 == pytest.approx(4.0, abs=0.2)
    assert resid == pytest.approx(30.0, rel=0.05)
    with pytest.raises(ValueError):
        soak.fit([1, 1, 1], [1, 2, 3])


def test_the_verdict_tells_growth_from_noise():
    steps = list(range(0, 12000, 100))
    flat = soak.verdict(steps, [80_000 + (i % 3) * 200.0 for i in range(len(steps))],
                        [6] * len(steps), [20] * len(steps))
    assert flat["flat"] and abs(flat["growth_kb_per_1000_steps"]) < 5
    # the per-step list this run used to keep: 32 bytes a step, 0.4 MB over 12,000 steps,
    # grows 3 MiB over 100,000 steps
    long = list(range(0, 100_000, 1000))
    grows = soak.verdict(long, [80_000 + 0.032 * s for s in long], [6] * len(long), [20] * len(long))
    assert not grows["flat"] and grows["growth_kb_per_1000_steps"] == pytest.approx(32.0)
    thread_leak = soak.verdict(steps, [80_000.0] * len(steps), [6 + i // 50 for i in range(len(steps))],
                               [20] * len(steps))
    assert not thread_leak["flat"]
    coming_and_going = soak.verdict(steps, [80_000.0] * len(steps), [6 + i % 2 for i in range(len(steps))],
                                    [20] * len(steps))
    assert coming_and_going["flat"]


def test_a_short_soak_run_samples_every_rank():
    env = dict(os.environ, OMP_NUM_THREADS="1", RINGNET_BLAS_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "ringnet.bench", "soak", "--np", "1",
                           "--model", "digits", "--dataset", "digits", "--steps", "3000",
                           "--every", "0.05", "--json"],
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert proc.returncode in (0, 1), proc.stderr[-2000:]
    report = json.loads(proc.stdout.splitlines()[-1])
    assert report["steps"] == 3000 and len(report["ranks"]) == 1
    row = report["ranks"][0]
    assert row["samples"] >= 3 and row["rss_mb_first"] > 10 and row["threads"][0] >= 1
    assert (proc.returncode == 0) == row["flat"]
