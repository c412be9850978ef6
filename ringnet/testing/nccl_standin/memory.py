"""The stand-in's memory: what NCCL operations write, and which readers may see it yet
(poison until an event or a wait orders them after the write; see
:mod:`ringnet.testing.nccl_standin`)."""
import ctypes

import numpy as np

from ringnet.testing.nccl_standin.common import NUMPY, POISON, NcclRuleError, state_lock


_made_on = []       # (first byte, end byte, device, ref to the buffer) of noted buffers


def note_made(array, device):
    """Note that ``array`` (a new device buffer of the recording CuPy stand-in,
    :mod:`ringnet.testing.recording_cupy`) was made while ``device`` was current: that is where CUDA
    puts it."""
    import weakref
    lo = array.__array_interface__["data"][0]
    with state_lock:
        _made_on[:] = [m for m in _made_on if m[3]() is not None]
        _made_on.append((lo, lo + max(array.nbytes, 1), device, weakref.ref(array)))


def made_on(ptr):
    """The device a noted buffer holding ``ptr`` was made on, or None."""
    with state_lock:
        for lo, hi, device, ref in reversed(_made_on):
            if lo <= ptr < hi and ref() is not None:
                return device
    return None


class Write:
    """Bytes [lo, hi) that an operation on ``queue`` writes: ``pending`` (enqueued),
    ``hidden`` (ran; memory holds poison, ``staged`` the bytes) or ``shown`` (ran; memory
    holds the bytes for the stream's own thread)."""

    __slots__ = ("queue", "comm", "lo", "hi", "seq", "staged", "state", "owner", "what")

    def __init__(self, queue, comm, lo, hi, owner, what):
        self.queue, self.comm, self.lo, self.hi = queue, comm, lo, hi
        self.owner, self.what = owner, what
        self.seq = None
        self.staged = None
        self.state = "pending"


pending_writes = []        # writes nobody has been ordered after yet


def _memory(lo, hi):
    if hi <= lo:
        return np.empty(0, np.uint8)
    return np.frombuffer((ctypes.c_char * (hi - lo)).from_address(lo), dtype=np.uint8)


def show_writes(queue, upto=None):
    """Give ``queue``'s results (up to position ``upto``) to the host code that follows."""
    with state_lock:
        for write in list(pending_writes):
            if write.queue is queue and write.state == "hidden" and (upto is None or write.seq <= upto):
                memory = _memory(write.lo, write.hi)
                if np.all(memory == POISON):
                    memory[...] = write.staged
                    write.state = "shown"
                else:       # written meanwhile by code not ordered after it: not NCCL's bytes
                    pending_writes.remove(write)


def hide(queue):
    with state_lock:
        for write in list(pending_writes):
            if write.queue is queue and write.state == "shown":
                memory = _memory(write.lo, write.hi)
                if np.array_equal(memory, write.staged):
                    memory[...] = POISON
                    write.state = "hidden"
                else:       # the stream's own host code changed them: no longer NCCL's bytes
                    pending_writes.remove(write)


def publish(queue, position):
    """Everything ``queue`` wrote up to ``position`` is visible to every reader from now on."""
    with state_lock:
        for write in list(pending_writes):
            if write.queue is queue and write.state != "pending" and write.seq <= position:
                release(write)


def release(write):
    if write.state == "hidden":
        memory = _memory(write.lo, write.hi)
        if np.all(memory == POISON):
            memory[...] = write.staged
    pending_writes.remove(write)


def _overlaps(lo, hi, skip=None):
    return [w for w in pending_writes if w is not skip and w.lo < hi and lo < w.hi]


def _unordered(op, write, reads):
    verb = "reads" if reads else "writes"
    tense = "is going to write" if write.state == "pending" else "wrote"
    return NcclRuleError(
        f"{op.describe()} on stream {op.queue.name} {verb} bytes that {write.what} on stream "
        f"{write.queue.name} {tense}, before an event orders it after that operation (a "
        "wait_event on an event recorded after it, or a synchronize): on a GPU the two race")


def outgoing(op, ptr, count):
    """Return a copy of what ``op`` sends from ``ptr``, as the stream sees it; raise when
    another stream's write to those bytes is not ordered before it."""
    itemsize = np.dtype(NUMPY[op.dtype]).itemsize
    lo, hi = int(ptr), int(ptr) + count * itemsize
    with state_lock:
        data = _memory(lo, hi).copy()
        for write in _overlaps(lo, hi):
            if write.queue is not op.queue:
                raise _unordered(op, write, reads=True)
            if write.state == "pending":        # comes later on this stream: memory is right
                continue
            memory = _memory(write.lo, write.hi)
            if write.state == "hidden" and np.all(memory == POISON):
                # ran earlier on this stream and hidden from other threads: its bytes
                a, b = max(lo, write.lo), min(hi, write.hi)
                data[a - lo:b - lo] = write.staged[a - write.lo:b - write.lo]
            elif not np.array_equal(memory, write.staged):
                pending_writes.remove(write)           # host code of this stream wrote there since
    return data.view(NUMPY[op.dtype])


def land(op, ptr, payload):
    """Store what ``op`` received (or computed) at ``ptr``: tracked writes go to poison."""
    raw = np.ascontiguousarray(payload).view(np.uint8).reshape(-1)
    lo, hi = int(ptr), int(ptr) + raw.size
    write = op.write
    with state_lock:
        if write is None:
            _memory(lo, hi)[...] = raw
            return
        for other in _overlaps(lo, hi, skip=write):
            if other.queue is not op.queue:
                raise _unordered(op, other, reads=False)
            if other.state != "pending":        # an earlier write of this stream: overwritten
                _trim(other, lo, hi)
        _memory(lo, hi)[...] = POISON
        write.staged = raw.copy()
        write.state = "hidden"


def _trim(write, lo, hi):
    """Drop [lo, hi) from ``write`` (keeping what lies on either side)."""
    pending_writes.remove(write)
    for a, b in ((write.lo, min(write.hi, lo)), (max(write.lo, hi), write.hi)):
        if b > a:
            part = Write(write.queue, write.comm, a, b, write.owner, write.what)
            part.seq, part.state = write.seq, write.state
            part.staged = write.staged[a - write.lo:b - write.lo].copy()
            pending_writes.append(part)
