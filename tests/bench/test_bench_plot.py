"""Benchmark pictures: the files are PNGs of the expected size holding the plotted series."""
import subprocess
import sys

import numpy as np
import pytest

plt = pytest.importorskip("matplotlib.pyplot")
from matplotlib import colors as mcolors  # noqa: E402
from matplotlib import image as mimage  # noqa: E402

from ringnet.bench import plot  # noqa: E402
from ringnet.errors import UsageError  # noqa: E402

SCALING = [
    {"mode": "single", "delay": 0, "np": 1, "speedup": 1.0, "efficiency": 1.0},
    {"mode": "ring", "delay": 1, "np": 2, "speedup": 1.8, "efficiency": 0.9},
    {"mode": "ring", "delay": 1, "np": 4, "speedup": 3.0, "efficiency": 0.75},
    {"mode": "tree", "delay": 0, "np": 2, "speedup": 1.5, "efficiency": 0.75},
    {"mode": "tree", "delay": 0, "np": 4, "speedup": 2.0, "efficiency": 0.5},
]
COMM = [{"algo": a, "bytes": b, "busbw": bw * b / (b + 4096)}
        for a, bw in (("ring", 1.0), ("native", 2.0)) for b in (1024, 65536, 1 << 22)]


def has_colour(png, colour, tolerance=0.02):
    """Return the number of pixels within ``tolerance`` of ``colour`` (a matplotlib colour)."""
    rgb = np.array(mcolors.to_rgb(colour))
    pixels = mimage.imread(png)[..., :3]
    return int((np.abs(pixels - rgb).max(axis=-1) < tolerance).sum())


def test_scaling_plot_draws_one_line_per_mode(tmp_path):
    out = str(tmp_path / "scaling.png")
    plot.plot_scaling(SCALING, out, title="test")
    image = mimage.imread(out)
    assert image.shape[:2] == (288, 720)                 # 9 x 3.6 inches at 80 dpi
    assert has_colour(out, "C0") > 100 and has_colour(out, "C1") > 100   # ring, tree
    assert has_colour(out, "C2") == 0                    # no third series


def test_comm_plot(tmp_path):
    out = str(tmp_path / "comm.png")
    plot.plot_comm(COMM, out)
    assert mimage.imread(out).shape[:2] == (288, 480)
    assert has_colour(out, "C0") > 50 and has_colour(out, "C1") > 50
    assert not list(tmp_path.glob("*.tmp*"))             # written atomically


def test_bad_plot_path_is_refused_before_the_benchmark_runs(tmp_path):
    with pytest.raises(UsageError, match="does not exist"):
        plot.check_writable(str(tmp_path / "missing" / "x.png"))
    with pytest.raises(UsageError, match="must end in"):
        plot.check_writable(str(tmp_path / "x.txt"))
    proc = subprocess.run([sys.executable, "-m", "ringnet.bench", "scaling", "--np", "1",
                           "--plot", str(tmp_path / "missing" / "s.png")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stderr.startswith("ringnet: error: cannot write")
    assert len(proc.stderr.strip().splitlines()) == 1


def test_trace_plot_draws_compute_and_transfer_lanes(tmp_path):
    meta = [{"name": "thread_name", "ph": "M", "pid": r, "tid": t, "args": {"name": n}}
            for r in (0, 1) for t, n in ((0, "training"), (1, "ringnet-comm-1"))]
    events = []
    for r in (0, 1):
        for k in range(4):
            t = 1000.0 * k
            events += [{"name": "step", "cat": "step", "ph": "X", "pid": r, "tid": 0, "ts": t,
                        "dur": 900.0, "args": {}},
                       {"name": "forward conv1", "cat": "forward", "ph": "X", "pid": r, "tid": 0,
                        "ts": t, "dur": 400.0, "args": {}},
                       {"name": "transfer", "cat": "transfer", "ph": "X", "pid": r, "tid": 1,
                        "ts": t + 100, "dur": 300.0, "args": {}}]
    out = str(tmp_path / "trace.png")
    plot.plot_trace({"traceEvents": meta + events}, out, steps=2, title="t")
    assert has_colour(out, plot._COLOURS["forward"]) > 500
    assert has_colour(out, plot._COLOURS["transfer"]) > 500
    assert has_colour(out, plot._COLOURS["backward"]) == 0
    with pytest.raises(UsageError, match="no step spans"):
        plot.plot_trace({"traceEvents": meta}, out)


def test_scaling_plot_from_a_csv_file(tmp_path):
    root = __import__("os").path.dirname(__import__("os").path.dirname(__import__("os").path.dirname(__file__)))
    out = tmp_path / "s.png"
    proc = subprocess.run([sys.executable, "-m", "ringnet.bench.plot", "scaling",
                           f"{root}/docs/img/scaling-cifar10_quick-2core.csv", str(out)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == f"wrote {out}\n"
    assert has_colour(str(out), "C4") > 100               # five series: split-fc is the fifth
    (tmp_path / "bad.csv").write_text("mode,np\nring,x\n")
    proc = subprocess.run([sys.executable, "-m", "ringnet.bench.plot", "scaling",
                           str(tmp_path / "bad.csv"), str(out)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stderr.startswith("ringnet: error: cannot read scaling")
