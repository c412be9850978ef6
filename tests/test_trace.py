"""--trace: the Chrome trace file parses, spans nest, and its totals equal the --json summary."""
import collections
import statistics
import json
import os
import subprocess
import sys
import time

import pytest

ENV = dict(os.environ, OMP_NUM_THREADS="1", RINGNET_BLAS_THREADS="1")
DIGITS_LAYERS = ["conv1", "relu1", "conv2", "relu2", "pool1", "flatten", "ip1", "relu3", "ip2"]


def traced_run(tmp_path, *args, np_=2, steps=8, path=None):
    path = path or tmp_path / "trace.json"
    cmd = [sys.executable, "-m", "ringnet.train", "--steps", str(steps), "--no-eval", "--json",
           "--quiet", "--trace", str(path), *args]
    if np_ > 1:
        cmd = ["mpirun", "-np", str(np_), *cmd]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=ENV, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    with open(path) as f:
        trace = json.load(f)                                   # it parses
    assert not [p for p in os.listdir(path.parent) if ".tmp" in p]
    return summary, trace


def spans(trace):
    events = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    for e in events:
        assert {"name", "cat", "pid", "tid", "ts", "dur", "args"} <= set(e), e
        assert e["dur"] >= 0
    return events


def lane_names(trace):
    return {(e["pid"], e["tid"]): e["args"]["name"] for e in trace["traceEvents"]
            if e["ph"] == "M" and e["name"] == "thread_name"}


def assert_nested(events):
    """On every lane, two spans are disjoint or one contains the other."""
    lanes = collections.defaultdict(list)
    for e in events:
        lanes[(e["pid"], e["tid"])].append(e)
    eps = 0.01                                                 # us: ts/dur are rounded
    for lane, items in lanes.items():
        items.sort(key=lambda e: (e["ts"], -e["dur"]))
        stack = []
        for e in items:
            while stack and e["ts"] >= stack[-1]["ts"] + stack[-1]["dur"] - eps:
                stack.pop()
            if stack:
                top = stack[-1]
                assert e["ts"] + e["dur"] <= top["ts"] + top["dur"] + eps, \
                    f"{e['name']} overlaps {top['name']} without nesting on {lane}"
            stack.append(e)


def totals(events, cats, pid):
    return sum(e["dur"] for e in events if e["pid"] == pid and e["cat"] in cats) / 1e6


def overlaps(a, b):
    return a["ts"] < b["ts"] + b["dur"] and b["ts"] < a["ts"] + a["dur"]


@pytest.mark.parametrize("mode,delay", [("ring", 1), ("ring", 0), ("tree", 0), ("split-fc", 0)])
def test_trace_parses_nests_and_matches_the_summary(tmp_path, mode, delay):
    # delay 1 without the synchronous warm-up: the exchange on the stream from step 0
    summary, trace = traced_run(tmp_path, "--mode", mode, "--delay", str(delay),
                                *(["--warmup-steps", "0"] if delay else []))
    events = spans(trace)
    assert_nested(events)
    ranks = summary["ranks"]
    assert {e["pid"] for e in events} == set(range(ranks))
    assert lane_names(trace)[(0, 0)] == "training"
    steps = summary["steps"]
    # The --json summary's per-rank means, from the same spans.
    for key, cats in (("compute_s", {"compute"}), ("update_s", {"update"}),
                      ("comm_wait_s", {"wait", "exposed_comm"}),
                      ("comm_total_s", {"comm", "exposed_comm"})):
        traced = sum(totals(events, cats, r) for r in range(ranks)) / ranks
        assert traced == pytest.approx(summary[key], rel=0.05, abs=1e-4), key
    traced_data = sum(totals(events, {"data"}, r) for r in range(ranks)) / ranks
    assert traced_data == pytest.approx(summary["data_s"], rel=0.05, abs=2e-3 * steps)
    # Bytes: the transfer spans add up to the transport's counters.
    sent = sum(e["args"]["sent"] for e in events if e["cat"] == "transfer")
    # split-fc: the final evaluation (not traced) gathers the other ranks' FC slices
    untraced = (ranks - 1) * summary["fc_params_per_rank"] * 4 if mode == "split-fc" else 0
    assert sent / ranks == summary["bytes_sent"] - untraced
    for r in range(ranks):
        step_spans = sorted((e for e in events if e["pid"] == r and e["cat"] == "step"),
                            key=lambda e: e["ts"])
        assert len(step_spans) == steps
        for e in (e for e in events if e["pid"] == r and e["cat"] == "transfer"):
            assert e["args"]["sent"] + e["args"]["received"] > 0
            assert {e["args"]["to"], e["args"]["from"]} - {None} <= set(range(ranks)) - {r}
        # every step runs each conv layer forward and backward, inside the step span
        for s in step_spans:
            inside = [e for e in events if e["pid"] == r and e["tid"] == s["tid"]
                      and e["cat"] in ("forward", "backward") and overlaps(e, s)]
            for kind in ("forward", "backward"):
                names = [e["args"]["layer"] for e in inside if e["cat"] == kind]
                assert {"conv1", "conv2"} <= set(names), (kind, names)
    if mode != "split-fc":
        for r in range(ranks):
            names = [e["args"]["layer"] for e in events if e["pid"] == r and e["cat"] == "forward"]
            assert names == DIGITS_LAYERS * steps
            assert len([e for e in events if e["pid"] == r and e["cat"] == "loss"]) == steps
    step_ms = sorted(e["dur"] for e in events if e["pid"] == 0 and e["cat"] == "step")
    assert min(step_ms) / 1000 <= summary["step_ms"] <= max(step_ms) / 1000


def test_delay_one_exchange_runs_under_the_next_step(tmp_path):
    _, trace = traced_run(tmp_path, "--mode", "ring", "--delay", "1", "--warmup-steps", "0",
                          steps=10)
    events = spans(trace)
    lanes = lane_names(trace)
    for r in (0, 1):
        comm = [e for e in events if e["pid"] == r and e["cat"] == "comm"]
        compute = [e for e in events if e["pid"] == r and e["cat"] in ("forward", "backward")]
        assert comm and all(lanes[(r, e["tid"])] != "training" for e in comm)
        # some exchange of step t-1 is in flight while step t computes
        assert any(overlaps(c, w) for c in comm for w in compute)


def test_the_picture_of_a_trace(tmp_path):
    """The docs' command draws a trace (needs matplotlib, the plot extra)."""
    pytest.importorskip("matplotlib")
    traced_run(tmp_path, "--mode", "ring", "--delay", "1", "--warmup-steps", "0", steps=4)
    png = tmp_path / "trace.png"
    proc = subprocess.run([sys.executable, "-m", "ringnet.bench.plot", "trace",
                           str(tmp_path / "trace.json"), str(png), "--steps", "2"],
                          capture_output=True, text=True, env=ENV, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert proc.stdout.strip() == f"wrote {png}", proc.stdout


def test_delay_zero_exchange_is_on_the_training_thread(tmp_path):
    _, trace = traced_run(tmp_path, "--mode", "ring", "--delay", "0", steps=4)
    events = spans(trace)
    transfers = [e for e in events if e["cat"] == "transfer"]
    assert transfers and all(e["tid"] == 0 for e in transfers)
    assert not [e for e in events if e["cat"] == "comm"]


def test_the_origin_places_the_steps_on_this_hosts_monotonic_clock(tmp_path):
    # origin_s + ts is a perf_counter reading any process of the host shares: every step
    # lies between this process's readings before the launch and after the exit, and the
    # last one ends once the training has taken most of its time
    before = time.perf_counter()
    summary, trace = traced_run(tmp_path, "--mode", "ring", "--delay", "1", steps=6)
    after = time.perf_counter()
    origin = trace["otherData"]["origin_s"]
    steps = [e for e in spans(trace) if e["cat"] == "step"]
    assert len(steps) == 2 * 6
    starts = [origin + e["ts"] / 1e6 for e in steps]
    ends = [origin + (e["ts"] + e["dur"]) / 1e6 for e in steps]
    assert before < min(starts) and max(ends) < after, (before, min(starts), max(ends), after)
    assert max(ends) - min(starts) >= 0.5 * summary["train_s"], (summary["train_s"], starts, ends)


@pytest.mark.parametrize("np_", [2, 3])
def test_the_ranks_timelines_line_up(tmp_path, np_):
    # The ring's k-th receive from a peer ends after that peer posted its k-th send to it.
    # A transfer span covers the wait, which follows the posting at once unless the thread
    # is descheduled in between, so on rank 0's clock the receive ends after the send's span
    # begins in the typical pair (the median); lined up by the barrier alone the ranks were
    # milliseconds apart.
    summary, trace = traced_run(tmp_path, "--mode", "ring", "--delay", "0", np_=np_, steps=6)
    alignment = trace["otherData"]["clock_alignment"]
    assert [a["rank"] for a in alignment] == list(range(np_)) and alignment[0]["offset_us"] == 0
    bound = {a["rank"]: a["error_us"] for a in alignment}
    assert max(bound.values()) < 5000, alignment
    events = spans(trace)
    for r in range(np_):
        right = (r + 1) % np_
        mine = sorted((e for e in events if e["pid"] == r and e["cat"] == "transfer"
                       and e["args"].get("to") == right), key=lambda e: e["ts"])
        theirs = sorted((e for e in events if e["pid"] == right and e["cat"] == "transfer"
                         and e["args"].get("from") == r), key=lambda e: e["ts"])
        assert len(mine) == len(theirs) >= 6                    # at least one a step
        # us: the alignment's bounds, the rounding of ts/dur, a posting's few Python lines
        slack = bound[r] + bound[right] + 50.0
        lead = statistics.median(b["ts"] + b["dur"] - a["ts"] for a, b in zip(mine, theirs))
        assert lead >= -slack, (r, right, lead, slack)


def test_single_process_trace(tmp_path):
    path = tmp_path / "new" / "folder" / "trace.json"          # missing folders are made
    summary, trace = traced_run(tmp_path, np_=1, steps=3, path=path)
    events = spans(trace)
    assert_nested(events)
    assert summary["ranks"] == 1 and not [e for e in events if e["cat"] == "transfer"]
    assert len([e for e in events if e["cat"] == "step"]) == 3


def test_nesting_check_catches_overlap():
    bad = [{"name": "a", "pid": 0, "tid": 0, "ts": 0.0, "dur": 10.0},
           {"name": "b", "pid": 0, "tid": 0, "ts": 5.0, "dur": 10.0}]
    with pytest.raises(AssertionError, match="overlaps"):
        assert_nested(bad)
    assert_nested(bad[:1] + [{"name": "c", "pid": 0, "tid": 0, "ts": 2.0, "dur": 3.0}])


def test_bad_trace_path_is_one_line_before_training(tmp_path):
    (tmp_path / "file").write_text("")
    proc = subprocess.run(["mpirun", "-np", "2", sys.executable, "-m", "ringnet.train",
                           "--steps", "2", "--trace", str(tmp_path / "file" / "t.json")],
                          capture_output=True, text=True, env=ENV, timeout=300)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ringnet: error: rank 0: --trace"), proc.stderr
    assert "is not a folder" in lines[0] and "ringnet:" not in proc.stdout
    assert os.listdir(tmp_path) == ["file"]


def test_no_listener_no_fine_spans():
    from ringnet import stats, trace
    seen = []
    unsubscribe = stats.subscribe(seen.append)
    try:
        with trace.span("forward", layer="x"):
            pass
        assert not trace.active() and not seen              # no Tracer: a no-op
    finally:
        unsubscribe()


def test_nccl_transfers_are_traced(tmp_path):
    """Over the NCCL transport (its strict host stand-in) the trace shows every transfer,
    and they add up to the bytes the summary reports."""
    env = dict(ENV, RINGNET_NCCL="standin")
    path = tmp_path / "trace.json"
    cmd = ["mpirun", "-np", "2", sys.executable, "-m", "ringnet.train", "--steps", "4",
           "--no-eval", "--json", "--quiet", "--transport", "nccl", "--mode", "ring",
           "--delay", "1", "--warmup-steps", "0", "--trace", str(path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["transport"] == "nccl"
    events = spans(json.load(open(path)))
    transfers = [e for e in events if e["cat"] == "transfer"]
    assert transfers and all(e["args"]["enqueued"] is False for e in transfers)
    assert sum(e["args"]["sent"] for e in transfers) / 2 == summary["bytes_sent"]
    lanes = {e["tid"] for e in transfers}
    assert len(lanes) >= 1 and all(e["args"]["to"] in (0, 1) or e["args"]["from"] in (0, 1)
                                   for e in transfers)


@pytest.mark.parametrize("drift_ppm", [1000.0, -1000.0, 0.0])
def test_a_span_within_another_stays_within_it_whatever_the_drift(drift_ppm):
    """A rank whose clock alignments at the start and the end of tracing differ (a drift,
    here 0.1%: a loaded machine's ping-pong over a short run) still has every span inside
    its parent in the trace: both ends of a span are mapped to rank 0's clock, and its
    duration is the difference of the mapped ends."""
    from ringnet.trace import ClockSync, Tracer
    tracer = object.__new__(Tracer)
    first = ClockSync(at=10.0, offset=0.002, error=1e-6, origin=10.0)
    last = ClockSync(at=10.5, offset=0.002 + drift_ppm * 1e-6 * 0.5, error=1e-6)
    tracer._syncs, tracer.t0 = [first, last], 10.0
    outer = tracer._placed(10.0405, 0.0115)                      # 11.5 ms, 40 ms in
    inner = tracer._placed(10.0405 + 0.0115 - 12e-6, 11e-6)      # ends 1 us before it
    assert inner[0] + inner[1] <= outer[0] + outer[1]
    assert inner[0] >= outer[0]
    # the mapped duration moves with the drift, by its share of the span
    assert outer[1] == pytest.approx(11500 * (1 - drift_ppm * 1e-6), abs=2e-3)
