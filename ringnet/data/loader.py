"""Per-rank sharded mini-batches with a prefetch thread, device-side normalisation and augmentation."""
import queue
import threading
import time

import numpy as np

from ringnet.backend import cupy, resolve_dtype
from ringnet.errors import InputError
from ringnet.shards import shard_bounds
from ringnet.workers import Worker

__all__ = ["ShardedLoader", "iterate_eval", "normalize", "augment_params",
           "augment_batch", "PAD"]

PAD = 4  # augmentation: random crop of the image padded by PAD pixels on each side
_POLL_S = 0.05  # how often a blocked prefetch thread checks whether it should stop


def _channel_vector(value, channels, default, what):
    if value is None:
        return np.full(channels, default, dtype=np.float64)
    vec = np.asarray(value, dtype=np.float64).reshape(-1)
    if vec.size == 1:
        vec = np.repeat(vec, channels)
    if vec.size != channels:
        raise InputError(f"{what} has {vec.size} values but the images have {channels} channels")
    return vec


def _stats(mean, std, channels):
    mean = _channel_vector(mean, channels, 0.0, "mean")
    std = _channel_vector(std, channels, 1.0, "std")
    # A constant channel has std 0; leave it centred rather than dividing by zero.
    return mean, np.where(std > 0, std, 1.0)


def normalize(images, mean, std, xp=np, dtype="float32"):
    """Return ``(images - mean) / std`` per channel as an xp array of ``dtype``.

    ``images`` is uint8 (B, C, H, W) on the host or the device; the conversion runs
    wherever ``xp`` computes, so only uint8 crosses to a GPU.
    """
    dtype = resolve_dtype(dtype)
    c = images.shape[1]
    mean, std = _stats(mean, std, c)
    x = xp.asarray(images).astype(dtype)
    x -= xp.asarray(mean, dtype=dtype).reshape(1, c, 1, 1)
    x /= xp.asarray(std, dtype=dtype).reshape(1, c, 1, 1)
    return x


def _mix64(x):
    """Apply the splitmix64 finaliser to a uint64 array (a fast, well-spread hash)."""
    x = x ^ (x >> np.uint64(30))
    x = x * np.uint64(0xBF58476D1CE4E5B9)
    x = x ^ (x >> np.uint64(27))
    x = x * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def augment_params(seed, epoch, indices, pad=PAD):
    """Return (dy, dx, flip) for each global index: a function of (seed, epoch, index) only."""
    with np.errstate(over="ignore"):
        key = _mix64(np.array([seed & (2**64 - 1)], dtype=np.uint64))
        key = _mix64(key ^ np.uint64(epoch & (2**64 - 1)))
        h = _mix64(np.asarray(indices, dtype=np.uint64) + key)
    span = np.uint64(2 * pad + 1)
    dy = (h % span).astype(np.intp)
    dx = ((h >> np.uint64(16)) % span).astype(np.intp)
    flip = ((h >> np.uint64(32)) & np.uint64(1)).astype(bool)
    return dy, dx, flip


def augment_batch(images, dy, dx, flip, pad=PAD):
    """Return padded-random-crop, optionally mirrored copies of uint8 (B, C, H, W) images."""
    b, c, h, w = images.shape
    padded = np.zeros((b, c, h + 2 * pad, w + 2 * pad), dtype=images.dtype)
    padded[:, :, pad:pad + h, pad:pad + w] = images
    rows = dy[:, None] + np.arange(h)                                  # (B, H)
    cols = np.where(flip[:, None], np.arange(w - 1, -1, -1), np.arange(w)) + dx[:, None]  # (B, W)
    # One gather does crop and flip together: no per-sample Python loop.
    return padded[np.arange(b)[:, None, None, None], np.arange(c)[None, :, None, None],
                  rows[:, None, :, None], cols[:, None, None, :]]


def _read(images, indices):
    """Return images[indices] (any order); files are read chunk by chunk in increasing order."""
    indices = np.asarray(indices)
    if isinstance(images, np.ndarray):
        return images[indices]
    order = np.argsort(indices, kind="stable")
    ordered = indices[order]
    out = np.empty((len(indices),) + tuple(images.shape[1:]), dtype=images.dtype)
    if len(ordered) == 0:
        return out
    # h5py's point selections cost ~0.4 ms per index; one slice per touched chunk
    # decompresses each chunk once and is several times faster.
    chunks = getattr(images, "chunks", None)
    rows = chunks[0] if chunks else 1
    groups = np.flatnonzero(np.diff(ordered // rows)) + 1
    for start, stop in zip(np.r_[0, groups], np.r_[groups, len(ordered)]):
        lo, hi = ordered[start], ordered[stop - 1] + 1
        block = np.asarray(images[lo:hi])
        out[order[start:stop]] = block[ordered[start:stop] - lo]
    return out


class _Failure:
    def __init__(self, exc):
        self.exc = exc


class _PinnedSlot:
    """A page-locked host buffer for one local batch and the event of its last copy."""

    def __init__(self, shape):
        count = int(np.prod(shape))
        offset = -(-count // 8) * 8  # labels 8-byte aligned after the images
        mem = cupy.cuda.alloc_pinned_memory(offset + 8 * shape[0])
        self.images = np.frombuffer(mem, np.uint8, count).reshape(shape)
        self.labels = np.frombuffer(mem, np.int64, shape[0], offset=offset)
        self.free = threading.Event()
        self.free.set()
        self.copied = None  # cupy Event: the device copy from this buffer has finished


class ShardedLoader:
    """Global batches in a seeded order, each rank loading its own contiguous part.

    Global order of epoch e: ``default_rng([seed, e]).permutation(n)`` (or
    ``arange(n)`` without shuffle); global batch s is ``perm[s*B:(s+1)*B]`` and
    rank r gets ``[r*B/N, (r+1)*B/N)`` of it, so every world size sees the same
    samples per step. A thread (the same one every epoch) keeps the next ``prefetch``
    batches ready;
    ``wait_s`` sums the time the consumer waited for data.
    """

    def __init__(self, split, global_batch, rank=0, size=1, seed=0, shuffle=True, xp=np,
                 dtype="float32", mean=None, std=None, prefetch=2, drop_last=True,
                 augment=False):
        n = len(split)
        if size < 1 or not 0 <= rank < size:
            raise InputError(f"rank {rank} is not in a world of size {size}")
        if global_batch < 1:
            raise InputError(f"batch size must be positive, got {global_batch}")
        if global_batch % size:
            raise InputError(f"global batch {global_batch} is not divisible by the "
                             f"{size} ranks: use a multiple of {size}")
        if prefetch < 0:
            raise InputError(f"prefetch must be >= 0, got {prefetch}")
        if drop_last and global_batch > n:
            raise InputError(f"global batch {global_batch} is larger than the {n} "
                             "training images")
        self.split = split
        self.global_batch = global_batch
        self.rank, self.size = rank, size
        self.seed, self.shuffle = seed, shuffle
        self.xp = xp
        self.dtype = resolve_dtype(dtype)
        self.prefetch = prefetch
        self._worker = Worker(f"ringnet-prefetch-r{rank}")     # one thread for every epoch
        self.drop_last = drop_last
        self.augment = augment
        self.n = n
        self.steps_per_epoch = n // global_batch if drop_last else -(-n // global_batch)
        self.image_shape = tuple(split.images.shape[1:])
        self.mean, self.std = _stats(mean, std, self.image_shape[0])
        self.wait_s = 0.0
        self._perm = (None, None)
        self._gpu = cupy is not None and xp is cupy
        if self._gpu:
            self._setup_gpu()

    def __len__(self):
        return self.steps_per_epoch

    # -- which samples ------------------------------------------------------------

    def _order(self, epoch):
        cached_epoch, perm = self._perm  # one tuple: safe to read from either thread
        if cached_epoch != epoch:
            if self.shuffle:
                perm = np.random.default_rng([self.seed, epoch]).permutation(self.n)
            else:
                perm = np.arange(self.n)
            self._perm = (epoch, perm)
        return perm

    def batch_indices(self, epoch, step):
        """Return the global indices of global batch ``step`` of ``epoch``."""
        if not 0 <= step < self.steps_per_epoch:
            raise IndexError(f"step {step} outside [0, {self.steps_per_epoch})")
        b = self.global_batch
        return self._order(epoch)[step * b:(step + 1) * b]

    def local_indices(self, epoch, step):
        """Return this rank's contiguous part of global batch ``step`` of ``epoch``."""
        batch = self.batch_indices(epoch, step)
        lo, hi = shard_bounds(len(batch), self.size)[self.rank]
        return batch[lo:hi]

    def _host_batch(self, epoch, step):
        idx = self.local_indices(epoch, step)
        images = _read(self.split.images, idx)
        if self.augment:
            images = augment_batch(images, *augment_params(self.seed, epoch, idx))
        return images, self.split.labels[idx]

    # -- iteration ----------------------------------------------------------------

    def epoch(self, epoch, start_step=0):
        """Yield ``(x, y)`` for this rank, step by step, from ``start_step`` to the epoch end."""
        steps = range(start_step, self.steps_per_epoch)
        if self._gpu:
            return self._epoch_gpu(epoch, steps)
        return self._epoch_host(epoch, steps)

    def _to_host_xp(self, images, labels):
        # On the CPU the "device" is the host: the prefetch thread finishes the batch.
        return (normalize(images, self.mean, self.std, np, self.dtype),
                np.asarray(labels, dtype=np.int64))

    def _epoch_host(self, epoch, steps):
        if self.prefetch == 0:
            for step in steps:
                t0 = time.perf_counter()
                batch = self._to_host_xp(*self._host_batch(epoch, step))
                self.wait_s += time.perf_counter() - t0
                yield batch
            return

        def make(step, stop):
            return self._to_host_xp(*self._host_batch(epoch, step))

        yield from self._prefetched(steps, make)

    def _prefetched(self, steps, make, before=None):
        """Yield make(step, stop) for each step, computed ahead by a thread."""
        items = queue.Queue(maxsize=self.prefetch)
        stop = threading.Event()

        def put(item):
            while not stop.is_set():
                try:
                    items.put(item, timeout=_POLL_S)
                    return True
                except queue.Full:
                    continue
            return False

        def produce():
            try:
                if before is not None:
                    before()
                for step in steps:
                    if stop.is_set() or not put(make(step, stop)):
                        return
            except BaseException as exc:  # noqa: BLE001 - handed to the consumer
                put(_Failure(exc))

        done = self._worker.submit(produce)
        try:
            for _ in steps:
                t0 = time.perf_counter()
                while True:
                    try:
                        item = items.get(timeout=_POLL_S)
                        break
                    except queue.Empty:
                        if (done.is_set() or not self._worker.alive()) and items.empty():
                            raise RuntimeError("prefetch thread ended without a batch")
                self.wait_s += time.perf_counter() - t0
                if isinstance(item, _Failure):
                    raise item.exc
                yield item
        finally:
            stop.set()
            # (a thread gone with the job unfinished: the interpreter's exit stopped it)
            while not done.is_set() and self._worker.alive():
                try:  # unblock a producer waiting on a full queue
                    while True:
                        items.get_nowait()
                except queue.Empty:
                    pass
                done.wait(_POLL_S)

    # -- GPU: pinned buffers, a copy stream, double-buffered host->device copies ----

    def _setup_gpu(self):
        self._device_id = cupy.cuda.Device().id
        c = self.image_shape[0]
        self._mean_dev = cupy.asarray(self.mean, dtype=self.dtype).reshape(1, c, 1, 1)
        self._std_dev = cupy.asarray(self.std, dtype=self.dtype).reshape(1, c, 1, 1)
        self._copy_stream = cupy.cuda.Stream(non_blocking=True)
        local = self.global_batch // self.size
        # prefetch queued + one being filled + one in flight + one being consumed
        self._slots = [_PinnedSlot((local,) + self.image_shape)
                       for _ in range(max(self.prefetch, 1) + 3)]

    def _fill_slot(self, epoch, step, stop=None):
        slot = self._slots[step % len(self._slots)]
        while not slot.free.wait(_POLL_S):
            if stop is not None and stop.is_set():
                raise RuntimeError("loader stopped")
        slot.free.clear()
        if slot.copied is not None:
            slot.copied.synchronize()  # the previous copy out of this buffer is done
        images, labels = self._host_batch(epoch, step)
        n = len(labels)
        slot.images[:n] = images
        slot.labels[:n] = labels
        return slot, n

    def _issue_copy(self, slot, n):
        """Start the copy and normalisation of a pinned batch on the copy stream."""
        main = cupy.cuda.get_current_stream()
        # Allocated from the main stream's pool: memory it frees is reused in its order.
        raw = cupy.empty((n,) + self.image_shape, dtype=np.uint8)
        x = cupy.empty((n,) + self.image_shape, dtype=self.dtype)
        y = cupy.empty(n, dtype=np.int64)
        # That memory may have been freed by kernels still queued on the main stream.
        self._copy_stream.wait_event(main.record())
        raw.set(slot.images[:n], stream=self._copy_stream)
        y.set(slot.labels[:n], stream=self._copy_stream)
        with self._copy_stream:
            cupy.subtract(raw, self._mean_dev, out=x)
            cupy.divide(x, self._std_dev, out=x)
        slot.copied = self._copy_stream.record()
        slot.free.set()
        return x, y, slot.copied, raw

    def _epoch_gpu(self, epoch, steps):
        def make(step, stop=None):
            return self._fill_slot(epoch, step, stop)

        def bind():
            cupy.cuda.Device(self._device_id).use()  # the current device is per thread

        if self.prefetch == 0:
            def source():
                for step in steps:
                    t0 = time.perf_counter()
                    item = make(step)
                    self.wait_s += time.perf_counter() - t0
                    yield item
            batches = source()
        else:
            batches = self._prefetched(steps, make, before=bind)
        pending = None
        try:
            for slot, n in batches:
                issued = self._issue_copy(slot, n)
                if pending is not None:
                    yield self._finish(pending)
                pending = issued
            if pending is not None:
                yield self._finish(pending)
                pending = None
        finally:
            batches.close()

    def _finish(self, issued):
        x, y, copied, _raw = issued  # _raw stays alive until the wait below is queued
        cupy.cuda.get_current_stream().wait_event(copied)
        return x, y


def iterate_eval(split, batch_size, rank=0, size=1, xp=np, dtype="float32", mean=None,
                 std=None):
    """Yield ``(x, y)`` batches of this rank's contiguous part of ``split``.

    The parts of all ranks are disjoint and cover the split, so per-rank counts of
    correct predictions add up to the test accuracy. Ranks may get different numbers
    of batches: reduce only after the loop.
    """
    if batch_size < 1:
        raise InputError(f"batch size must be positive, got {batch_size}")
    lo, hi = shard_bounds(len(split), size)[rank]
    for start in range(lo, hi, batch_size):
        stop = min(start + batch_size, hi)
        images = np.asarray(split.images[start:stop])  # contiguous read
        yield (normalize(images, mean, std, xp, dtype),
               xp.asarray(split.labels[start:stop], dtype=np.int64))
