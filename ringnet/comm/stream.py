"""Streams: ordered queues of operations that run beside the caller's computation."""
import queue
import threading

from ringnet.backend import cupy, gpu_available

__all__ = ["Handle", "CpuStream", "GpuStream", "current_tag"]

_local = threading.local()


def current_tag():
    """Return the message tag of the stream running on this thread (0 off-stream)."""
    return getattr(_local, "tag", 0)


class Handle:
    """Completion of one operation submitted to a stream."""

    __slots__ = ("_event", "_error", "_value", "_cuda_event")

    def __init__(self):
        self._event = threading.Event()
        self._error = None
        self._value = None
        self._cuda_event = None

    def _finish(self, value=None, error=None, cuda_event=None):
        self._value, self._error, self._cuda_event = value, error, cuda_event
        self._event.set()

    def done(self):
        """Return True once the operation has finished (without blocking)."""
        if not self._event.is_set():
            return False
        return self._cuda_event is None or self._cuda_event.done

    def wait(self, timeout=None):
        """Wait for the operation; re-raise its error here; return its value.

        On a GPU stream the host waits only until the operation is enqueued; the caller's
        current CUDA stream then waits on the event recorded behind it, so later kernels
        and copies on that stream (``asnumpy`` included) see its result while the host
        runs ahead. Deadlines on the device work are the transport's (its watchdog).
        """
        if not self._event.wait(timeout):
            raise TimeoutError(f"stream operation not finished within {timeout} s")
        if self._error is not None:
            raise self._error
        if self._cuda_event is not None:
            cupy.cuda.get_current_stream().wait_event(self._cuda_event)
        return self._value


class CpuStream:
    """One communication thread that runs submitted callables in submission order.

    ``tag`` separates this stream's messages from those of other streams (all ranks
    create their streams in the same order, so they agree on it).
    """

    def __init__(self, tag=0, name="ringnet-comm"):
        self.tag = tag
        self._queue = queue.SimpleQueue()
        self._closed = False
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
        _local.tag = self.tag
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

    def submit(self, fn, *args):
        """Queue ``fn(*args)`` behind the earlier operations; return its Handle."""
        if self._closed:
            raise RuntimeError("submit on a closed stream")
        handle = Handle()
        self._queue.put((handle, fn, args, self._mark()))
        return handle

    def synchronize(self):
        """Wait for every operation submitted so far (errors are re-raised)."""
        self.submit(lambda: None).wait()

    def close(self):
        """Finish the queued operations and stop the thread."""
        if not self._closed:
            self._closed = True
            self._queue.put(None)
            self._thread.join()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class GpuStream(CpuStream):
    """A CUDA stream plus the thread that enqueues work on it.

    The thread is needed because host-side MPI calls block; NCCL calls and kernels
    are only enqueued on ``cuda_stream``. Events order the streams, not the host: an
    operation waits on the event recorded on the submitter's current stream at
    ``submit`` (so the caller need not synchronize before submitting a buffer it just
    wrote), and :meth:`Handle.wait` makes the waiter's stream wait on the event
    recorded after the operation.
    """

    def __init__(self, tag=0, device_id=None):
        if not gpu_available():
            raise RuntimeError("GpuStream needs a usable CUDA device")
        self.device_id = cupy.cuda.Device().id if device_id is None else device_id
        with cupy.cuda.Device(self.device_id):
            self.cuda_stream = cupy.cuda.Stream(non_blocking=True)
        super().__init__(tag, name="ringnet-cuda")

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
