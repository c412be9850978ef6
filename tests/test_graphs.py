"""CUDA graphs (``--cuda-graphs``) checked without a GPU, on the recording stand-in for CuPy.

There a captured "graph" is the list of recorded launches, replayed on the same memory
with the same arguments, which is what a CUDA graph does. So a value of the step passed
as an argument (baked in at capture), a buffer made outside the step, a transfer or a
host read inside it show up here as they would on a GPU. The reference is the same run
without graphs: eager steps on the stand-in.
"""
import os
import sys

import numpy as np
import pytest

from ringnet import graphs, models, optim
from ringnet.bench import budget
from ringnet.layers import activation, cuda_ops, gemm
from ringnet.parallel.base import DataParallelStrategy
from ringnet.parallel.ring import RingStrategy
from ringnet.parallel.single import SingleStrategy
from ringnet.parallel.tree import TreeStrategy
from ringnet.testing import cuda_emulation

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "parallel"))
from test_overlap import _RecordingComm  # noqa: E402  (a one-rank communicator that logs)

MODELS = ["lenet", "cifar10_quick", "carnet"]      # carnet has a Dropout


@pytest.fixture(autouse=True)
def _gemm_route():
    gemm.enable(False)
    yield
    gemm.enable(False)


def _policy():
    return optim.LRPolicy("inv", 0.01, gamma=0.1, power=0.75)     # lr changes every step


def _batches(model, steps, batch=8, seed=1):
    rng = np.random.default_rng(seed)
    return [(rng.normal(size=(batch,) + model.input_shape).astype(np.float32),
             rng.integers(0, model.num_classes, batch)) for _ in range(steps)]


def _run(name, steps, use_graphs, strategy=SingleStrategy, strict=True, backend=None):
    """Train ``steps`` steps on the stand-in; return (params, momentum, losses, GraphStep)."""
    rec = budget.Recorder()
    with budget.recording(rec):
        model = models.build_model(name, xp=rec, seed=0)
        model.params[...] += np.random.default_rng(3).normal(
            scale=0.02, size=model.num_params).astype(np.float32)   # biases that matter
        st = strategy(model, lambda n: optim.SGD(n, _policy(), momentum=0.9, weight_decay=5e-4,
                                                 xp=rec, dtype=model.dtype), None)
        st.stats.gpu = None                # the stand-in has no CUDA events to time with
        gemm.enable()                      # both runs multiply through the same route
        if use_graphs:
            st.graph_step((backend or graphs.StandinGraphs)(rec), strict=strict)
        losses = []
        for it, (x, y) in enumerate(_batches(model, steps)):
            loss, correct = st.step(x, y, it)
            losses.append((float(np.asarray(loss)), int(np.asarray(correct))))
        return (np.array(model.params), np.array(st.engine.optimizer.v), losses, st.graphs)


@pytest.mark.parametrize("name", MODELS)
def test_replayed_steps_equal_eager_steps_bit_for_bit(name):
    want = _run(name, 5, False)
    got = _run(name, 5, True)
    assert got[3].replays == 5 - graphs.WARMUP and got[3].off is None
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_array_equal(got[1], want[1])
    assert got[2] == want[2]
    assert len({loss for loss, _ in want[2]}) == 5        # every step's own loss came back


def test_data_parallel_graph_leaves_the_update_to_the_exchange():
    want = _run("lenet", 4, False, strategy=DataParallelStrategy)
    got = _run("lenet", 4, True, strategy=DataParallelStrategy)
    assert got[3].optimizer is None and got[3].replays == 4 - graphs.WARMUP
    np.testing.assert_array_equal(got[0], want[0])
    assert got[2] == want[2]


def test_a_learning_rate_baked_into_the_graph_is_caught(monkeypatch):
    def apply_with_host_lr(self, w, g):          # lr as a kernel argument, as before graphs
        lr = self.dtype.type(float(np.asarray(self._lr)))
        optim._fused_kernel(optim.get_array_module(w))(g, lr, self.momentum,
                                                       self.weight_decay, w, self.v)
    monkeypatch.setattr(optim.SGD, "apply", apply_with_host_lr)
    want = _run("lenet", 5, False)
    got = _run("lenet", 5, True)
    assert not np.array_equal(got[0], want[0])   # the replays kept the capture step's lr


def test_dropout_keys_passed_from_the_host_cannot_be_captured(monkeypatch):
    def forward(self, x, train=True):
        xp = activation.get_array_module(x)
        keys = xp.asarray(np.array(activation.stream_keys((self.seed, self.step, 0)), np.uint64))
        self._mask = cuda_ops.dropout_mask(xp, x.shape, x.dtype, keys,
                                           activation.keep_threshold(self.p), 2.0)
        return x * self._mask
    monkeypatch.setattr(activation.Dropout, "forward", forward)
    with pytest.raises(graphs.GraphMismatch, match="could not be captured .CaptureError: "
                       "asarray in .*transfer inside captured work"):
        _run("carnet", 3, True)
    got = _run("carnet", 3, True, strict=False)         # auto: eager steps, and why
    assert "CaptureError" in got[3].off and got[3].replays == 0


class _LosingGraphs(graphs.StandinGraphs):
    def launch(self, graph):          # a replay that drops the update kernel
        self.recorder.replay([again for again in graph][:-2])


def test_a_replay_that_differs_turns_graphs_off_under_auto_and_stops_a_run_under_on():
    want = _run("lenet", 5, False)
    got = _run("lenet", 5, True, strict=False, backend=_LosingGraphs)
    assert "differs from the eager step" in got[3].off and "weights" in got[3].off
    np.testing.assert_array_equal(got[0], want[0])       # the eager steps took over
    assert got[2] == want[2]
    with pytest.raises(graphs.GraphMismatch, match="replay of step 2 differs"):
        _run("lenet", 5, True, strict=True, backend=_LosingGraphs)


class _RefusingGraphs(graphs.StandinGraphs):
    def capture_segments(self, fn):   # as CuPy refuses a cuBLAS stream change while capturing
        raise NotImplementedError("calling cuBLAS API during stream capture is unsupported")


def test_a_capture_that_fails_turns_graphs_off_under_auto_and_stops_a_run_under_on():
    want = _run("lenet", 4, False)
    got = _run("lenet", 4, True, strict=False, backend=_RefusingGraphs)
    assert got[3].off == ("step 2 could not be captured (NotImplementedError: calling cuBLAS "
                          "API during stream capture is unsupported)")
    np.testing.assert_array_equal(got[0], want[0])
    assert got[2] == want[2] and got[3].replays == 0
    with pytest.raises(graphs.GraphMismatch, match="could not be captured"):
        _run("lenet", 4, True, strict=True, backend=_RefusingGraphs)


class _AtOnce:
    """A stream that runs each operation when it is submitted, and is its own done handle."""

    def submit(self, fn, *args):
        fn(*args)
        return self

    def wait(self, timeout=None):
        return None

    def close(self):
        return None


class _InOrderComm(_RecordingComm):
    """One rank whose exchanges run when submitted, so ``log`` is the exact order of graph
    launches and bucket exchanges."""

    def new_stream(self):
        return _AtOnce()


class _LoggedGraphs(graphs.StandinGraphs):
    def __init__(self, recorder, log):
        super().__init__(recorder)
        self.log = log

    def launch(self, graph):
        self.log.append("graph")
        super().launch(graph)


def _bucketed_strategy(rec, comm, strategy_class):
    """LeNet at delay 0 with one bucket per parameter layer, on the stand-in."""
    model = models.build_model("lenet", xp=rec, seed=0)
    model.params[...] += np.random.default_rng(3).normal(
        scale=0.02, size=model.num_params).astype(np.float32)
    st = strategy_class(model, lambda n: optim.SGD(n, _policy(), momentum=0.9,
                                                   weight_decay=5e-4, xp=rec, dtype=model.dtype),
                        None, comm, delay=0, bucket_size=1)
    st.stats.gpu = None
    gemm.enable()
    return st


def test_the_run_header_says_the_step_is_a_graph_per_bucket_span(monkeypatch):
    monkeypatch.setattr(graphs, "CudaGraphs", graphs.StandinGraphs)
    rec = budget.Recorder()
    with budget.recording(rec):
        st = _bucketed_strategy(rec, _InOrderComm(), RingStrategy)
        said = graphs.setup("auto", st, rec)
    assert st.graphs.splits == tuple(sorted((layer for _, _, layer in st.buckets[:-1]),
                                            reverse=True))
    assert said == ("on (auto: forward and backward as 4 graphs, one per delay-0 bucket span, "
                    "each bucket's exchange started between them; the update outside, "
                    "captured after 2 eager steps)")


def _bucketed(strategy_class, steps, use_graphs, early=False):
    """Delay 0, one bucket per parameter layer, on the stand-in; return (params, momentum,
    losses, GraphStep, the log of the last step, the bucket sizes in exchange order)."""
    rec, comm = budget.Recorder(), _InOrderComm()
    with budget.recording(rec):
        st = _bucketed_strategy(rec, comm, strategy_class)
        model = st.model
        if use_graphs:
            st.graph_step(_LoggedGraphs(rec, comm.log), strict=True)
            if early:        # start the next bucket at each cut: one graph too soon
                starts = st.graphs.splits[1:] + (0,)
                st.graphs.at_split = lambda layer: st.layer_done(
                    "backward", starts[st.graphs.splits.index(layer)])
        losses = []
        for it, (x, y) in enumerate(_batches(model, steps)):
            del comm.log[:]
            loss, correct = st.step(x, y, it)
            losses.append((float(np.asarray(loss)), int(np.asarray(correct))))
        sizes = [hi - lo for lo, hi, _ in st.buckets]
        return (np.array(model.params), np.array(st.optimizer.v), losses, st.graphs,
                list(comm.log), sizes)


@pytest.mark.parametrize("strategy_class", [RingStrategy, TreeStrategy])
def test_delay0_buckets_are_exchanged_between_the_graphs_of_a_replay(strategy_class):
    """One graph per bucket span: a replayed step launches a graph, starts the bucket its
    backward completed, launches the next; the result equals the eager bucketed run."""
    want = _bucketed(strategy_class, 5, False)
    got = _bucketed(strategy_class, 5, True)
    sizes = want[5]
    assert len(sizes) == 4                              # lenet: conv1, conv2, ip1, ip2
    step = got[3]
    assert step.off is None and step.replays == 5 - graphs.WARMUP and len(step.graph) == 4
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_array_equal(got[1], want[1])
    assert got[2] == want[2]
    # the eager step exchanges the buckets last layers first; the replay the same buckets,
    # each right after the graph that wrote its gradient (the first layer's after the last)
    def exchange(n):
        return [("reduce", n), ("distribute", n)]
    assert [entry for entry in want[4] if entry != "graph"] == sum(map(exchange, sizes), [])
    assert got[4] == sum((["graph"] + exchange(n) for n in sizes), [])


def test_a_bucket_started_before_its_graph_ran_changes_the_result():
    """The comparison above can fail: a bucket exchanged one graph too soon, before the
    backward of its last layer, is updated with a stale gradient."""
    want = _bucketed(RingStrategy, 4, False)
    early = _bucketed(RingStrategy, 4, True, early=True)
    assert early[3].off is None
    assert not np.array_equal(early[0], want[0])


@pytest.mark.parametrize("name", MODELS)
def test_two_consecutive_steps_issue_the_same_launches_on_the_same_buffers(name):
    rec = budget.Recorder()
    with budget.recording(rec):
        model = models.build_model(name, xp=rec)
        opt = optim.SGD(model.num_params, _policy(), momentum=0.9, xp=rec, dtype=model.dtype)
        gemm.enable()
        step = graphs.GraphStep(model, opt, graphs.StandinGraphs(rec))
        batches = _batches(model, 4)
        for it in range(2):                                   # warm-up: buffers made
            step._load(*batches[it], it)
            step._compute()

        def one(i):
            step._load(*batches[2 + i], 2 + i)
            rec.begin_step()                                  # the captured part only
            step._compute()
        first, second = graphs.capture_signature(rec, one)
    assert len(first) > 20
    for a, b in zip(first, second):
        assert a == b, f"{a[:2]} differs between consecutive steps"
    assert len(first) == len(second)


def test_the_signature_names_a_value_that_changes_between_steps(monkeypatch):
    def step_with_host_lr(self, w, g, it):                    # the update before graphs
        optim._fused_kernel(optim.get_array_module(w))(
            g, self.dtype.type(self.lr_policy(it)), self.momentum, self.weight_decay, w, self.v)
    rec = budget.Recorder()
    with budget.recording(rec):
        model = models.build_model("lenet", xp=rec)
        opt = optim.SGD(model.num_params, _policy(), xp=rec, dtype=model.dtype)
        monkeypatch.setattr(optim.SGD, "step", step_with_host_lr)
        x, y = _batches(model, 1)[0]

        def one(i):
            model.loss_and_grad(rec.asarray(x), rec.asarray(y))
            opt.step(model.params, model.grads, i)
        one(0)                                                    # warm-up: buffers made
        first, second = graphs.capture_signature(rec, lambda i: one(1 + i))
    differ = [(a, b) for a, b in zip(first, second) if a != b]
    assert [a[1] for a, _ in differ] == ["ringnet_sgd_update"]


def test_graphs_are_unavailable_on_the_cpu_and_for_split_fc():
    class SplitLike:
        name, graph_step = "split-fc", None
    assert graphs.unavailable(np, object()) == "the arrays live on the CPU"
    assert "split-fc" in graphs.unavailable(budget.Recorder(), SplitLike())


# --- the GEMM route that captures -------------------------------------------------

def _layouts(rng, rows, cols):
    """The matrix (rows, cols) in memories cuBLAS takes without a copy, and one it does not."""
    base = rng.normal(size=(rows, cols))
    wide = np.zeros((rows, cols + 3))
    wide[:, :cols] = base
    tall = np.zeros((cols, rows + 2))
    tall[:, :rows] = base.T
    return [("row-major", base.copy()), ("column-major", np.asfortranarray(base)),
            ("row-major, ld > cols", wide[:, :cols]), ("transposed, ld > rows", tall[:, :rows].T)]


@pytest.mark.parametrize("m,k,n", [(5, 7, 3), (1, 4, 6), (6, 1, 2), (3, 5, 1), (1, 1, 1)])
def test_the_gemm_plan_computes_the_product_in_every_layout(m, k, n):
    rng = np.random.default_rng(m * 100 + k * 10 + n)
    for na, a in _layouts(rng, m, k):
        for nb, b in _layouts(rng, k, n):
            for nc, c in _layouts(rng, m, n):
                c[...] = np.nan
                steps = gemm.plan(a, b, c)
                assert steps is not None, (na, nb, nc)
                transa, transb, mm, nn, kk, first, lda, second, ldb, ldc = steps
                cuda_emulation.gemm(transa, transb, mm, nn, kk, first, lda, second, ldb, c, ldc)
                np.testing.assert_allclose(c, a @ b, rtol=1e-12, atol=1e-12,
                                           err_msg=f"{na} @ {nb} -> {nc}")


def test_the_gemm_plan_refuses_memory_that_is_neither_orientation_and_matmul_copies_it():
    rng = np.random.default_rng(0)
    a = rng.normal(size=(8, 10))[::2, ::2]                   # both strides > 1
    b = rng.normal(size=(5, 3))
    assert gemm.plan(a, b, np.empty((4, 3))) is None
    with pytest.raises(ValueError, match="gemm shapes"):
        gemm.plan(a, b.T, np.empty((4, 3)))
    rec = budget.Recorder()
    with budget.recording(rec):
        gemm.enable()
        out = rec.empty((4, 3))
        gemm.matmul(rec, rec.asarray(a), rec.asarray(b), out=out.T.T)
        np.testing.assert_allclose(out, a @ b, rtol=1e-12)
        wrong = rec.empty((3, 4)).T[::1, ::1]
        gemm.matmul(rec, rec.asarray(a), rec.asarray(b), out=wrong)
        np.testing.assert_allclose(wrong, a @ b, rtol=1e-12)
    assert [e[1] for e in rec.events].count("cublas gemm") == 2


def test_setup_says_why_graphs_are_off_and_refuses_on_where_they_cannot_run():
    class Strategy:
        name, graphs, graph_step = "split-fc", None, None
    assert graphs.setup("off", Strategy(), budget.Recorder()) == "off (asked for)"
    assert graphs.setup("auto", Strategy(), np) == "off (auto: the arrays live on the CPU)"
    assert graphs.setup("auto", Strategy(), budget.Recorder()) == \
        "off (auto: split-fc exchanges activations inside its step)"
    with pytest.raises(graphs.UsageError, match="--cuda-graphs on: split-fc exchanges"):
        graphs.setup("on", Strategy(), budget.Recorder())
    with pytest.raises(graphs.UsageError, match="must be auto, on or off"):
        graphs.setup("yes", Strategy(), np)


@pytest.mark.parametrize("flags,line", [
    (["--cuda-graphs", "on", "--device", "cpu"], "--cuda-graphs on needs the GPU path"),
    (["--cuda-graphs", "on"], "--cuda-graphs on: the arrays live on the CPU"),
])
def test_the_cli_refuses_graphs_on_the_cpu_in_one_line(flags, line):
    import subprocess
    import sys
    run = subprocess.run([sys.executable, "-m", "ringnet.train", "--model", "digits", "--steps",
                          "2", "--no-eval", "--device", "cpu"][:-2] + flags,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and run.stderr.strip().count("\n") == 0, run.stderr
    assert line in run.stderr and "Traceback" not in run.stderr


@pytest.mark.parametrize("name", ["lenet", "carnet"])
def test_a_graphed_step_is_one_graph_and_one_copy_of_its_loss(name):
    eager = budget.step_budget(name, batch_size=8)
    graphed = budget.graph_budget(name, batch_size=8)
    outside = graphed["outside"]
    assert graphed["captured"] == eager["launches"] and graphed["replays"] == 2
    assert outside["launches"] == 1 and outside["kernel"] == 1          # step_record
    assert outside["host_waits"] == 0 and outside["allocations"] == 0
    # inputs, labels, the learning rate, each Dropout's keys: copies outside the graph
    assert outside["transfers"] == 3 + (name == "carnet")


class _FakeCublas:
    """cublasSgemm_v2 / cublasDgemm_v2 on host memory, with cuBLAS's C argument order; with
    ``memory`` (the stand-in's :class:`~ringnet.bench.budget.DeviceMemory`), each GEMM uses
    the workspace last set, as cuBLAS does, and fails where that memory is freed."""

    def __init__(self, memory=None):
        self.calls, self.memory, self.workspace, self.live = [], memory, None, 0
        self.cublasSgemm_v2 = lambda *a: self._gemm(np.float32, *a)
        self.cublasDgemm_v2 = lambda *a: self._gemm(np.float64, *a)

    def cublasCreate_v2(self, handle):
        self.live += 1
        return 0

    def cublasDestroy_v2(self, handle):
        self.live -= 1
        return 0

    def cublasSetStream_v2(self, handle, stream):
        self.workspace = None                     # cuBLAS goes back to its own workspace
        return 0

    def cublasSetWorkspace_v2(self, handle, ptr, size):
        self.workspace = (ptr.value, size.value)
        return 0

    def _gemm(self, dtype, handle, transa, transb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc):
        import ctypes
        if self.memory is not None and self.workspace is not None:
            self.memory.check(*self.workspace, what="cuBLAS's gemm (its workspace)")
        self.calls.append((transa, transb, m, n, k, lda, ldb, ldc))
        item = np.dtype(dtype).itemsize

        def matrix(ptr, rows, cols, ld):
            span = ld * (cols - 1) + rows
            ctype = ctypes.c_float if dtype is np.float32 else ctypes.c_double
            flat = np.ctypeslib.as_array((ctype * span).from_address(ptr.value))
            return np.lib.stride_tricks.as_strided(flat, (rows, cols), (item, ld * item))
        ma = matrix(a, k if transa else m, m if transa else k, lda)
        mb = matrix(b, n if transb else k, k if transb else n, ldb)
        out = matrix(c, m, n, ldc)
        out[...] = alpha._obj.value * ((ma.T if transa else ma) @ (mb.T if transb else mb)) + \
            beta._obj.value * np.nan_to_num(out)
        return 0


class _OnDevice:
    """A host array dressed as a CuPy array for the handle: ``.data.ptr`` and ``.dtype``."""

    def __init__(self, array):
        from types import SimpleNamespace
        self.array, self.dtype = array, array.dtype
        self.data = SimpleNamespace(ptr=array.ctypes.data)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_the_cublas_call_passes_the_plan_in_cublas_argument_order(dtype):
    import ctypes
    handle = gemm._Handle.__new__(gemm._Handle)
    handle.lib = lib = _FakeCublas()
    handle.ptr, handle.stream = ctypes.c_void_p(1), 7
    handle.cupy = type("cupy", (), {"cuda": type("cuda", (), {
        "get_current_stream": staticmethod(lambda: type("s", (), {"ptr": 7})())})})
    handle.one = {np.dtype(np.float32): ctypes.c_float(1.0), np.dtype(np.float64): ctypes.c_double(1.0)}
    handle.zero = {np.dtype(np.float32): ctypes.c_float(0.0), np.dtype(np.float64): ctypes.c_double(0.0)}
    handle.fn = {np.dtype(np.float32): lib.cublasSgemm_v2, np.dtype(np.float64): lib.cublasDgemm_v2}
    rng = np.random.default_rng(4)
    for _, a in _layouts(rng, 6, 4):
        for _, b in _layouts(rng, 4, 5):
            for _, c in _layouts(rng, 6, 5):
                a, b, c = (np.asarray(v, dtype=dtype) if v.dtype != dtype else v for v in (a, b, c))
                c[...] = np.nan
                steps = list(gemm.plan(a, b, c))
                steps[5], steps[7] = _OnDevice(steps[5]), _OnDevice(steps[7])
                handle.gemm(tuple(steps), _OnDevice(c))
                np.testing.assert_allclose(c, a @ b, rtol=1e-5)
    assert len(lib.calls) == 64 and {call[:2] for call in lib.calls} >= {(0, 0), (1, 1)}


# --- lifetimes: the cuBLAS workspace, the private pool, the graph step ------------------

def _gemm_on(handle, rec, lib):
    a, b = np.ones((4, 3), np.float32), np.ones((3, 2), np.float32)
    c = np.zeros((4, 2), np.float32)
    steps = list(gemm.plan(a, b, c))
    steps[5], steps[7] = _OnDevice(steps[5]), _OnDevice(steps[7])
    handle.gemm(tuple(steps), _OnDevice(c))
    return c


def test_memory_of_a_collected_pool_is_refused_by_the_stand_in():
    """The stand-in's pools free what they gave out when collected, as CuPy's do: a launch
    on such an array raises instead of reading whatever the GPU put there since."""
    import gc
    rec = budget.Recorder()
    with budget.recording(rec):
        pool = rec.cuda.MemoryPool()
        with rec.cuda.using_allocator(pool.malloc):
            kept = rec.zeros(8)
        outside = rec.zeros(8)
        del pool
        gc.collect()
        assert np.isnan(np.asarray(kept, np.float64).view(np.float64)).all()     # poison
        with pytest.raises(budget.FreedMemoryError, match="memory pool that was collected"):
            kept + 1.0
        outside + 1.0                                                  # not the pool's


def test_the_cublas_workspace_outlives_the_pool_its_handle_was_made_under():
    """The first GEMM (which makes the handle) runs inside the graph step's private pool;
    the workspace must not come from it: after that pool is collected, the handle still
    hands the workspace to cuBLAS."""
    import gc
    rec = budget.Recorder()
    lib = _FakeCublas(rec.memory)
    pool = rec.cuda.MemoryPool()
    with rec.cuda.using_allocator(pool.malloc):
        handle = gemm._Handle(rec, lib=lib)
        handle.bind(7)
        np.testing.assert_array_equal(_gemm_on(handle, rec, lib), 3.0)
    del pool
    gc.collect()
    handle.stream = None                          # a new stream: the workspace set again
    handle.bind(8)
    np.testing.assert_array_equal(_gemm_on(handle, rec, lib), 3.0)
    workspace = lib.workspace
    handle.close()                                # the handle's own: freed with it
    assert lib.live == 0 and handle.workspace is None
    with pytest.raises(budget.FreedMemoryError, match="runtime.free"):
        rec.memory.check(*workspace)


def test_the_cublas_library_is_the_versioned_one_of_the_runtime_in_use():
    assert gemm.library_name(12040) == "libcublas.so.12"
    assert gemm.library_name(13000) == "libcublas.so.13"


def test_the_capture_mode_is_passed_explicitly():
    from types import SimpleNamespace
    modes = []

    class Stream:
        def __init__(self, non_blocking=False):
            self.ptr = 5

        def wait_event(self, event):
            pass

        def record(self):
            return None

        def begin_capture(self, mode=None):
            modes.append(mode)

        def end_capture(self):
            return "graph"

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False
    cuda = SimpleNamespace(MemoryPool=object, Stream=Stream, get_current_stream=lambda: Stream(),
                           runtime=SimpleNamespace(streamCaptureModeRelaxed=2))
    backend = graphs.CudaGraphs(SimpleNamespace(cuda=cuda))
    bound = []
    saved, gemm.bind = gemm.bind, lambda: bound.append(True)
    try:
        segments, _ = backend.capture_segments(lambda cut: cut())
    finally:
        gemm.bind = saved
    assert segments == ["graph", "graph"] and modes == [2, 2] and bound == [True]


def test_the_cublas_route_ends_with_the_graph_step():
    """A graph step routes its GEMMs through cuBLAS; after it, the same process multiplies
    with the array module's matmul again (an eager run after a graphed one is eager)."""
    gemm.enable(False)
    rec = budget.Recorder()
    with budget.recording(rec):
        model = models.build_model("lenet", xp=rec, seed=0)
        opt = optim.SGD(model.num_params, _policy(), momentum=0.9, xp=rec, dtype=model.dtype)
        step = graphs.GraphStep(model, opt, graphs.StandinGraphs(rec))
        (x, y), = _batches(model, 1)
        rec.events.clear()
        step.step(x, y, 0)
        assert "cublas gemm" in [e[1] for e in rec.events]
        assert not gemm.enabled()
        rec.events.clear()
        model.loss_and_grad(rec.asarray(x), rec.asarray(y))
        names = [e[1] for e in rec.events if e[0] == "gemm"]
        assert names and "cublas gemm" not in names, names


def test_a_capture_begins_after_a_garbage_collection(monkeypatch):
    rec = budget.Recorder()
    seen = []
    monkeypatch.setattr(graphs.gc, "collect", lambda *a: seen.append(rec.captured is None))
    with budget.recording(rec):
        model = models.build_model("lenet", xp=rec, seed=0)
        opt = optim.SGD(model.num_params, _policy(), momentum=0.9, xp=rec, dtype=model.dtype)
        step = graphs.GraphStep(model, opt, graphs.StandinGraphs(rec))
        for it, (x, y) in enumerate(_batches(model, graphs.WARMUP + 1)):
            step.step(x, y, it)
    assert step.graph is not None and seen == [True]


@pytest.mark.parametrize("closed", [True, False])
@pytest.mark.parametrize("strategy", [SingleStrategy, RingStrategy])
def test_close_frees_the_graph_step_without_the_cyclic_collector(strategy, closed):
    """strategy.close() drops the graphs and gives the pool's free blocks back; the graph
    step is then freed by reference counting alone: no cycle through the strategy, also
    for a strategy never closed (a run that raised)."""
    import gc
    import weakref
    rec = budget.Recorder()
    gc.collect()
    gc.disable()
    try:
        with budget.recording(rec):
            if strategy is RingStrategy:                  # a graph per bucket span
                st = _bucketed_strategy(rec, _InOrderComm(), RingStrategy)
                gemm.enable(False)
            else:
                st = strategy(models.build_model("lenet", xp=rec, seed=0),
                              lambda n: optim.SGD(n, _policy(), momentum=0.9, xp=rec,
                                                  dtype=np.float32), None)
                st.stats.gpu = None
            model = st.model
            step = st.graph_step(graphs.StandinGraphs(rec), strict=True)
            pool = step.backend.pool
            for it, (x, y) in enumerate(_batches(model, graphs.WARMUP + 2)):
                st.step(x, y, it)
            assert step.replays == 2
            held = pool.used_blocks()
            if closed:
                st.close()
                assert step.closed and step.graph is None and step._keep == []
                assert pool.used_blocks() < held       # the static inputs, what only graphs held
                with pytest.raises(RuntimeError, match="after close"):
                    step.step(x, y, 9)
            ref = weakref.ref(step)
            del step, st
            assert ref() is None, "the graph step outlived close() and its strategy"
            model.loss_and_grad(rec.asarray(x), rec.asarray(y))   # the layers' buffers still valid
    finally:
        gc.enable()
