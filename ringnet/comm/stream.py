"""Streams: ordered queues of operations that run beside the caller's computation.

**Who progresses a CPU stream's transfers.** MPI moves a message only while some
thread of the rank is inside an MPI call. A CPU stream's thread that polls its
requests takes core time (and the GIL) from its own rank's computation, and a thread
blocked inside MPI spins there. ``RINGNET_CPU_PROGRESS`` chooses:

* ``driven``: a CPU stream's thread *sleeps* on each transfer: the training thread tests
  the pending transfer at every layer boundary (:meth:`CpuStream.progress`; the
  strategies call it) and wakes the stream's thread when it completed; a thread that
  waits on the stream (:meth:`Handle.wait`) drives it meanwhile. Meant for ranks of one
  node, where a message is a copy.
* ``poll``: the stream's thread polls its transfers itself (a short yielding spin, then
  short sleeps). Meant for messages that cross a network: MPI over TCP moves a message
  only while it is progressed, on both sides, and tests at layer boundaries only can
  leave the link idle between them.
* ``block``: the thread blocks in MPI's own wait (no deadline: for comparisons only).
* ``auto`` (the default): ``poll`` when the transport's ranks span more than one node,
  ``driven`` on one node (:func:`progress_mode` with the node count).

GPU streams always poll: their host thread mostly waits on the device, not on the
training thread's layers.
"""
import os
import threading
import queue
import time
from typing import Any, Callable, Optional

from ringnet.backend import cupy, gpu_available

__all__ = ["Handle", "CpuStream", "GpuStream", "current_tag", "current_stream", "PROGRESS_MODES",
           "progress_mode", "progress_setting", "resolve_progress", "progress_all", "thread_local",
           "driven_streams"]

# what a stream's thread has set on itself (tag, stream): the hot paths read it directly
thread_local = threading.local()

# The ways a CPU stream's thread can wait on a transfer, then the setting that picks one.
PROGRESS_MODES = ("driven", "poll", "block", "auto")


def progress_setting() -> str:
    """Return ``RINGNET_CPU_PROGRESS`` as given (one of :data:`PROGRESS_MODES`; unset: auto)."""
    mode = os.environ.get("RINGNET_CPU_PROGRESS", "") or "auto"
    if mode not in PROGRESS_MODES:
        raise ValueError(f"RINGNET_CPU_PROGRESS={mode!r}: use one of {', '.join(PROGRESS_MODES)}")
    return mode


def resolve_progress(mode: str, nodes: int = 1) -> str:
    """Return the progress a stream uses for ``mode`` when its ranks are on ``nodes`` nodes:
    ``auto`` is ``poll`` across nodes and ``driven`` on one; the others are themselves."""
    if mode not in PROGRESS_MODES:
        raise ValueError(f"unknown progress mode {mode!r}: use one of {', '.join(PROGRESS_MODES)}")
    if mode == "auto":
        return "poll" if nodes > 1 else "driven"
    return mode


def progress_mode(nodes: int = 1) -> str:
    """Return how CPU streams progress their transfers when their ranks are on ``nodes``
    nodes: ``RINGNET_CPU_PROGRESS`` resolved by :func:`resolve_progress` (driven, poll or
    block). Raises ValueError for an unknown value."""
    return resolve_progress(progress_setting(), nodes)


def current_tag() -> int:
    """Return the message tag of the stream running on this thread (0 off-stream)."""
    return getattr(thread_local, "tag", 0)


def current_stream() -> Optional["CpuStream"]:
    """Return the stream whose thread is the calling thread (None off-stream)."""
    return getattr(thread_local, "stream", None)


class Handle:
    """Completion of one operation submitted to a stream (:meth:`CpuStream.submit`).

    :meth:`done` polls, :meth:`wait` blocks and returns the operation's value or
    re-raises its exception on the waiting thread. Made by the stream, not by callers.
    """

    __slots__ = ("_event", "_error", "_value", "_cuda_event", "_stream")

    def __init__(self, stream: Optional["CpuStream"] = None):
        self._event = threading.Event()
        self._error = None
        self._value = None
        self._cuda_event = None
        self._stream = stream

    def _finish(self, value=None, error=None, cuda_event=None):
        self._value, self._error, self._cuda_event = value, error, cuda_event
        self._event.set()

    def done(self) -> bool:
        """Return True once the operation has finished, without blocking (a driven CPU
        stream's transfer is tested once; a GPU operation counts when its event has run)."""
        if not self._event.is_set():
            if self._stream is not None:
                self._stream.progress()
            if not self._event.is_set():
                return False
        return self._cuda_event is None or self._cuda_event.done

    def wait(self, timeout: Optional[float] = None) -> Any:
        """Wait for the operation; re-raise its error here; return its value.

        ``timeout``: seconds to wait (None: no limit); past it, raises TimeoutError and
        the operation stays queued.

        On a GPU stream the host waits only until the operation is enqueued; the caller's
        current CUDA stream then waits on the event recorded behind it, so later kernels
        and copies on that stream (``asnumpy`` included) see its result while the host
        runs ahead. Deadlines on the device work are the transport's (its watchdog).
        """
        driven = self._stream is not None and self._stream.driven
        if not (self._stream._drive(self._event, timeout) if driven else self._event.wait(timeout)):
            raise TimeoutError(f"stream operation not finished within {timeout} s")
        if self._error is not None:
            raise self._error
        if self._cuda_event is not None:
            cupy.cuda.get_current_stream().wait_event(self._cuda_event)
        return self._value


class CpuStream:
    """One communication thread that runs submitted callables in submission order.

    ``tag`` separates this stream's messages from those of other streams (all ranks
    create their streams in the same order, so they agree on it). ``name`` prefixes the
    thread's name. ``progress``: how its transfers progress, one of
    :data:`PROGRESS_MODES` (see the module docstring; default ``RINGNET_CPU_PROGRESS``);
    ``auto`` resolves with ``nodes``, the number of nodes the stream's ranks are on.
    Raises ValueError for another. ``mode`` is the progress it uses (never ``auto``).
    ``close()`` (or leaving a ``with`` block) ends it.
    """

    def __init__(self, tag: int = 0, name: str = "ringnet-comm", progress: Optional[str] = None,
                 nodes: int = 1):
        self.tag = tag
        self.mode = resolve_progress(progress_setting() if progress is None else progress, nodes)
        self.driven = self.mode == "driven"
        self._queue = queue.SimpleQueue()
        self._closed = False
        # driven progress: the test of the transfer this stream's thread sleeps on
        self._cond = threading.Condition()
        self._testing = threading.Lock()
        self._test = None
        self._completed = False
        if self.driven:
            with _driven_lock:
                driven_streams.append(self)
        self._thread = threading.Thread(target=self._loop, name=f"{name}-{tag}", daemon=True)
        self._thread.start()

    def _enter(self):
        """Prepare the worker thread (GPU streams bind the device here)."""
        return None

    def _run(self, fn, args, after=None):
        return fn(*args), None

    def _mark(self):
        """Return what the submitted operation must wait for (GPU: an event on the caller's stream)."""
        return None

    def _loop(self):
        thread_local.tag = self.tag
        thread_local.stream = self
        self._enter()
        while True:
            item = self._queue.get()
            if item is None:
                return
            handle, fn, args, after = item
            try:
                value, cuda_event = self._run(fn, args, after)
            except BaseException as exc:  # noqa: BLE001 - handed to the waiting thread
                handle._finish(error=exc)
            else:
                handle._finish(value=value, cuda_event=cuda_event)

    # -- progress -------------------------------------------------------------------
    def wait_transfer(self, test: Callable[[], bool], block: Callable[[], Any],
                      timeout: Optional[float]) -> bool:
        """On this stream's thread: return True once ``test()`` is true, False after ``timeout`` s.

        ``driven``: sleep until :meth:`progress` (another thread) saw ``test()`` true;
        ``block``: call ``block()`` (MPI's own wait). The transport calls this only in
        those modes; in ``poll`` mode it polls ``test`` itself.
        """
        if self.mode == "block":
            block()
            return True
        with self._cond:
            self._test, self._completed = test, False
            try:
                return self._cond.wait_for(lambda: self._completed, timeout)
            finally:
                self._test = None

    def progress(self) -> None:
        """Test the transfer this stream's thread sleeps on; wake the thread when it completed.

        Cheap (one MPI test at most) and safe from any thread; a no-op unless driven.
        """
        test = self._test
        if test is None or not self._testing.acquire(blocking=False):
            return
        try:
            if self._test is test and test():
                with self._cond:
                    if self._test is test:
                        self._completed = True
                        self._cond.notify()
        finally:
            self._testing.release()

    def _drive(self, event, timeout):
        """Wait for ``event`` while progressing the transfers (the waiting thread drives)."""
        start = time.perf_counter()
        pause = 0.0
        while True:
            progress_all()
            if event.wait(pause):
                return True
            if timeout is not None and time.perf_counter() - start > timeout:
                return event.is_set()
            pause = min(_DRIVE_MAX_PAUSE_S, pause + 1e-5)

    # -- queue ----------------------------------------------------------------------
    def submit(self, fn: Callable[..., Any], *args) -> Handle:
        """Queue ``fn(*args)`` behind the earlier operations; return its :class:`Handle`.

        ``fn`` runs on the stream's thread; its value or exception goes to the Handle.
        Raises RuntimeError on a closed stream.
        """
        if self._closed:
            raise RuntimeError("submit on a closed stream")
        handle = Handle(self)
        self._queue.put((handle, fn, args, self._mark()))
        return handle

    def synchronize(self) -> None:
        """Wait for every operation submitted so far (errors are re-raised)."""
        self.submit(lambda: None).wait()

    def close(self) -> None:
        """Finish the queued operations and stop the thread (errors stay with their
        Handles); a second call does nothing."""
        if not self._closed:
            if self.driven:     # drive what is queued: the thread may sleep on a transfer
                try:
                    self.synchronize()
                except BaseException:  # noqa: BLE001 - each error went to its own Handle
                    pass
            self._closed = True
            self._queue.put(None)
            self._thread.join()
            with _driven_lock:
                if self in driven_streams:
                    driven_streams.remove(self)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


# A thread that waits on a driven stream polls at most this long between tests.
_DRIVE_MAX_PAUSE_S = 0.0002
driven_streams = []                 # the driven CPU streams of this process
_driven_lock = threading.Lock()


def progress_all() -> None:
    """Progress every driven CPU stream of this process (see :meth:`CpuStream.progress`).

    The strategies call it at layer boundaries; blocking transfers off-stream call it
    while they wait, so a stream never sleeps while its rank is busy elsewhere in MPI.
    """
    for stream in tuple(driven_streams):
        stream.progress()


class GpuStream(CpuStream):
    """A CUDA stream plus the thread that enqueues work on it.

    The thread is needed because host-side MPI calls block; NCCL calls and kernels
    are only enqueued on ``cuda_stream``. Events order the streams, not the host: an
    operation waits on the event recorded on the submitter's current stream at
    ``submit`` (so the caller need not synchronize before submitting a buffer it just
    wrote), and :meth:`Handle.wait` makes the waiter's stream wait on the event
    recorded after the operation.

    ``tag`` as for :class:`CpuStream`; ``device_id``: the CUDA device (None: the caller's
    current one). Raises RuntimeError without a usable CUDA device.
    """

    def __init__(self, tag: int = 0, device_id: Optional[int] = None):
        if not gpu_available():
            raise RuntimeError("GpuStream needs a usable CUDA device")
        self.device_id = cupy.cuda.Device().id if device_id is None else device_id
        with cupy.cuda.Device(self.device_id):
            self.cuda_stream = cupy.cuda.Stream(non_blocking=True)
        super().__init__(tag, name="ringnet-cuda", progress="poll")

    def _enter(self):
        # The current device is per host thread: bind the caller's device here too.
        cupy.cuda.Device(self.device_id).use()

    def _mark(self):
        return cupy.cuda.get_current_stream().record()

    def _run(self, fn, args, after=None):
        with self.cuda_stream:
            if after is not None:
                self.cuda_stream.wait_event(after)
            value = fn(*args)
            event = self.cuda_stream.record()
        return value, event
