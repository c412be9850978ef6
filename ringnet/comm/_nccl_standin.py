"""A strict stand-in for ``cupy.cuda.nccl`` on host memory, over MPI: NCCL's rules raise at once.

Only the surface ringnet's :class:`~ringnet.comm.NcclTransport` uses: ``get_unique_id``,
``NcclCommunicator(size, unique_id, rank)`` with ``send``/``recv(ptr, count, dtype, peer,
stream)``, ``allReduce``, ``abort``, ``destroy``, ``check_async_error``, and the thread's
``groupStart``/``groupEnd``. Pointers are host addresses (NumPy ``array.ctypes.data``);
the stream argument is accepted and ignored. It is never picked silently: the transport
uses it only with ``RINGNET_NCCL=standin`` or ``NcclTransport(nccl="standin")``.

Real NCCL turns a broken rule into a hang or into wrong data. Here each one raises
:class:`NcclRuleError` on the rank that sees it:

* two threads inside one communicator at once, or one communicator used from a second
  thread at all (its operations are then ordered across ranks only by timing);
* ranks whose operations on one communicator differ: every message carries the
  sender's per-peer sequence number, kind, peer, count, dtype (and for collectives the
  communicator-wide collective number and reduction op), compared on receipt;
* unbalanced ``groupStart``/``groupEnd``; any use after ``abort`` or ``destroy``;
* a send and its matching receive of different sizes or dtypes.

A send completes only once its receive has started (synchronous MPI send), as an NCCL
send does; an operation whose peer never posts the match raises :class:`NcclError`
after ``RINGNET_COMM_TIMEOUT`` seconds (or the communicator's ``timeout_s``) instead of
hanging. Inside a group, operations run at the outermost ``groupEnd``.
"""
import ctypes
import os
import secrets
import threading
import time

import numpy as np
from mpi4py import MPI

__all__ = ["available", "HOST_MEMORY", "NcclError", "NcclRuleError", "NcclCommunicator",
           "get_unique_id", "get_version", "groupStart", "groupEnd"]

available = True
HOST_MEMORY = True      # buffers are host pointers; what tells the transport it is the stand-in

NCCL_INT8 = NCCL_CHAR = 0
NCCL_UINT8 = 1
NCCL_INT32 = NCCL_INT = 2
NCCL_UINT32 = 3
NCCL_INT64 = 4
NCCL_UINT64 = 5
NCCL_FLOAT16 = NCCL_HALF = 6
NCCL_FLOAT32 = NCCL_FLOAT = 7
NCCL_FLOAT64 = NCCL_DOUBLE = 8
NCCL_SUM, NCCL_PROD, NCCL_MAX, NCCL_MIN = 0, 1, 2, 3

_NUMPY = {0: np.int8, 1: np.uint8, 2: np.int32, 3: np.uint32, 4: np.int64, 5: np.uint64,
          6: np.float16, 7: np.float32, 8: np.float64}
_REDUCE = {NCCL_SUM: np.add, NCCL_PROD: np.multiply, NCCL_MAX: np.maximum, NCCL_MIN: np.minimum}
_UNIQUE_ID_BYTES = 128
_JOIN_TAG, _MEMBERS_TAG = 32101, 32102          # rendezvous on COMM_WORLD
_HEADER_TAG, _PAYLOAD_TAG = 1, 2                # on each communicator's private MPI group
_SEND, _RECV, _ALLREDUCE = 1, 2, 3
_KINDS = {_SEND: "send", _RECV: "recv", _ALLREDUCE: "allReduce"}
# header: kind, sender rank, receiver rank, per-pair sequence, count, dtype, collective no., op
_HEADER_LEN = 8


class NcclError(RuntimeError):
    """An NCCL call failed (a peer that never answered, a bad argument)."""


class NcclRuleError(NcclError):
    """An operation that real NCCL would turn into a hang or corrupt data."""


def get_version():
    """Return 0: no NCCL library behind this module."""
    return 0


def _timeout():
    value = os.environ.get("RINGNET_COMM_TIMEOUT", "")
    try:
        return float(value) if value else 300.0
    except ValueError:
        return 300.0


def get_unique_id():
    """Return a 128-entry tuple naming a new communicator (its creator's rank is its root)."""
    raw = MPI.COMM_WORLD.Get_rank().to_bytes(4, "little") + secrets.token_bytes(16)
    return tuple(raw + bytes(_UNIQUE_ID_BYTES - len(raw)))


# -- groups (per thread, as in NCCL) -------------------------------------------------------
_thread_state = threading.local()


def _group():
    state = _thread_state
    if not hasattr(state, "depth"):
        state.depth, state.ops = 0, []
    return state


def groupStart():
    """Open a group on this thread: operations until the matching groupEnd run together."""
    _group().depth += 1


def groupEnd():
    """Close this thread's group; the outermost groupEnd runs the queued operations."""
    state = _group()
    if state.depth == 0:
        raise NcclRuleError("groupEnd without a matching groupStart on this thread")
    state.depth -= 1
    if state.depth == 0:
        ops, state.ops = state.ops, []
        _run(ops)


def _view(ptr, count, dtype):
    """Return the host memory at ``ptr`` as a NumPy array of ``count`` elements."""
    np_type = _NUMPY[dtype]
    if count == 0:
        return np.empty(0, np_type)
    raw = (ctypes.c_char * (count * np.dtype(np_type).itemsize)).from_address(ptr)
    return np.frombuffer(raw, dtype=np_type)


class _Op:
    __slots__ = ("comm", "kind", "ptr", "count", "dtype", "peer", "op", "seq")

    def __init__(self, comm, kind, ptr, count, dtype, peer, op=None):
        self.comm, self.kind, self.ptr, self.count = comm, kind, ptr, count
        self.dtype, self.peer, self.op, self.seq = dtype, peer, op, None

    def describe(self):
        if self.kind == _ALLREDUCE:
            return f"allReduce of {self.count} x dtype {self.dtype}"
        where = "to" if self.kind == _SEND else "from"
        return f"{_KINDS[self.kind]} {where} rank {self.peer} of {self.count} x dtype {self.dtype}"


def _run(ops):
    """Run one group's operations: post every send, then match every receive, all under the deadline."""
    comms = []
    for op in ops:
        if op.comm not in comms:
            comms.append(op.comm)
    for comm in comms:
        comm._enter()
    try:
        for op in ops:
            op.comm._number(op)
        pending, receives = [], []
        for op in ops:
            if op.kind == _SEND:
                pending += op.comm._post_send(op, op.peer, op.seq, _view(op.ptr, op.count, op.dtype))
            elif op.kind == _RECV:
                receives.append((op, op.peer, op.seq))
            else:   # allReduce: exchange with every peer, combine in rank order
                data = _view(op.ptr[0], op.count, op.dtype)
                for peer in range(op.comm._size):
                    if peer != op.comm._rank:
                        sent, received = op.seq[peer]
                        pending += op.comm._post_send(op, peer, sent, data)
                        receives.append((op, peer, received))
        got = {}
        for op, peer, seq in receives:
            got[(id(op), peer)] = op.comm._receive(op, peer, seq)
        for comm in comms:
            comm._wait(pending, "sends of this group", receives=False)
        for op in ops:
            if op.kind == _ALLREDUCE:
                op.comm._combine(op, got)
    finally:
        for comm in comms:
            comm._leave()


class NcclCommunicator:
    """A communicator of ``ndev`` ranks; all of them call this with the same unique id."""

    def __init__(self, ndev, commId, rank):
        if not (isinstance(ndev, int) and ndev >= 1 and isinstance(rank, int) and 0 <= rank < ndev):
            raise NcclError(f"NcclCommunicator: rank {rank!r} is not in [0, {ndev!r})")
        raw = bytes(b % 256 for b in commId)
        if len(raw) != _UNIQUE_ID_BYTES:
            raise NcclError(f"NcclCommunicator: unique id of {len(raw)} bytes, expected 128")
        self._size, self._rank = ndev, rank
        self.timeout_s = _timeout()
        self._lock = threading.Lock()
        self._inside = None         # thread now inside an operation
        self._owner = None          # thread that issued the first operation
        self._state = "ok"
        self._sent = [0] * ndev     # per-peer sequence numbers
        self._received = [0] * ndev
        self._collectives = 0
        self._comm = self._join(raw)

    # -- set-up: find the other members through the unique id's root, make an MPI group --
    def _join(self, raw):
        world = MPI.COMM_WORLD
        root = int.from_bytes(raw[:4], "little")
        me = world.Get_rank()
        if self._size == 1:
            return MPI.COMM_SELF.Dup()
        token = np.frombuffer(raw[4:20], dtype=np.uint8)
        if me == root:
            members = {self._rank: me}
            start = time.perf_counter()
            while len(members) < self._size:
                status = MPI.Status()
                if not world.Iprobe(MPI.ANY_SOURCE, _JOIN_TAG, status):
                    if time.perf_counter() - start > self.timeout_s:
                        missing = sorted(set(range(self._size)) - set(members))
                        raise NcclError(f"NcclCommunicator init: rank(s) {missing} did not join "
                                        f"within {self.timeout_s:g} s")
                    time.sleep(1e-3)
                    continue
                info = np.empty(19, np.int64)
                world.Recv(info, source=status.Get_source(), tag=_JOIN_TAG)
                if not np.array_equal(info[3:].astype(np.uint8), token) or info[1] != self._size:
                    raise NcclRuleError(f"NcclCommunicator init: world rank {info[2]} joined with "
                                        f"another unique id or size ({info[1]} ranks)")
                if int(info[0]) in members:
                    raise NcclRuleError(f"NcclCommunicator init: rank {info[0]} joined twice")
                members[int(info[0])] = int(info[2])
            order = np.array([members[r] for r in range(self._size)], np.int64)
            for r in range(self._size):
                if order[r] != me:
                    world.Send(order, dest=int(order[r]), tag=_MEMBERS_TAG)
        else:
            info = np.concatenate([[self._rank, self._size, me], token]).astype(np.int64)
            world.Send(info, dest=root, tag=_JOIN_TAG)
            order = np.empty(self._size, np.int64)
            request = world.Irecv(order, source=root, tag=_MEMBERS_TAG)
            start = time.perf_counter()
            while not request.Test():
                if time.perf_counter() - start > self.timeout_s:
                    raise NcclError(f"NcclCommunicator init: root (world rank {root}) did not answer "
                                    f"within {self.timeout_s:g} s")
                time.sleep(1e-3)
        everyone = world.Get_group()
        group = everyone.Incl([int(r) for r in order])
        try:
            return world.Create_group(group, tag=_MEMBERS_TAG)
        finally:
            group.Free()
            everyone.Free()

    # -- the rules -----------------------------------------------------------------------
    def _usable(self, what):
        if self._state != "ok":
            raise NcclRuleError(f"{what} on a communicator after {self._state}")

    def _claim(self, what):
        """Check the thread rules for an operation issued now by this thread."""
        self._usable(what)
        me = threading.current_thread()
        with self._lock:
            if self._inside is not None and self._inside is not me:
                raise NcclRuleError(f"two threads inside one communicator at once: {what} from "
                                    f"thread {me.name!r} while thread {self._inside.name!r} is "
                                    "inside it")
            if self._owner is None:
                self._owner = me
            elif self._owner is not me:
                raise NcclRuleError(f"communicator used from two threads: {what} from thread "
                                    f"{me.name!r}, earlier operations from {self._owner.name!r} "
                                    "(their order across ranks is left to timing)")

    def _enter(self):
        me = threading.current_thread()
        with self._lock:
            if self._inside is not None and self._inside is not me:
                raise NcclRuleError(f"two threads inside one communicator at once: thread "
                                    f"{me.name!r} and thread {self._inside.name!r}")
            self._inside = me

    def _leave(self):
        with self._lock:
            self._inside = None

    def _queue(self, op):
        self._claim(op.describe())
        state = _group()
        if state.depth:
            state.ops.append(op)
        else:
            _run([op])

    def _number(self, op):
        if op.kind == _SEND:
            op.seq = self._sent[op.peer]
            self._sent[op.peer] += 1
        elif op.kind == _RECV:
            op.seq = self._received[op.peer]
            self._received[op.peer] += 1
        else:
            op.seq = {}
            for peer in range(self._size):
                if peer != self._rank:
                    op.seq[peer] = (self._sent[peer], self._received[peer])
                    self._sent[peer] += 1
                    self._received[peer] += 1
            op.op = (op.op, self._collectives)
            self._collectives += 1

    def _header(self, op, peer, seq):
        red, number = op.op if op.kind == _ALLREDUCE else (-1, -1)
        return np.array([op.kind, self._rank, peer, seq, op.count, op.dtype, number, red], np.int64)

    def _post_send(self, op, peer, seq, data):
        header = self._header(op, peer, seq)
        requests = [self._comm.Isend(header, dest=peer, tag=_HEADER_TAG)]
        if op.count:
            # Synchronous send: completes only when the receive has started, as in NCCL.
            requests.append(self._comm.Issend(data, dest=peer, tag=_PAYLOAD_TAG))
        return requests

    def _receive(self, op, peer, seq):
        """Take the next message from ``peer``, check it matches ``op``; return its payload."""
        header = np.empty(_HEADER_LEN, np.int64)
        self._wait([self._comm.Irecv(header, source=peer, tag=_HEADER_TAG)], op.describe())
        kind, sender, receiver, their_seq, count, dtype, number, red = (int(v) for v in header)
        expected_kind = _SEND if op.kind == _RECV else op.kind
        mine = (f"rank {self._rank}'s {op.describe()} (its operation no. {seq} with rank {peer})")
        theirs = (f"rank {sender}'s {_KINDS.get(kind, kind)} of {count} x dtype {dtype} "
                  f"(its operation no. {their_seq} with rank {receiver})")
        problem = None
        if kind != expected_kind or receiver != self._rank or their_seq != seq:
            problem = f"operation order differs between ranks: {mine} met {theirs}"
        elif op.kind == _ALLREDUCE and (number, red) != op.op[::-1]:
            problem = (f"operation order differs between ranks: {mine} (collective no. "
                       f"{op.op[1]}, op {op.op[0]}) met {theirs} (collective no. {number}, op {red})")
        elif count != op.count or dtype != op.dtype:
            problem = f"send and receive sizes differ: {mine} met {theirs}"
        if problem is not None:
            if count and dtype in _NUMPY:   # take the message, so the sender is not left hanging
                scratch = np.empty(count, _NUMPY[dtype])
                self._wait([self._comm.Irecv(scratch, source=peer, tag=_PAYLOAD_TAG)], op.describe())
            raise NcclRuleError(problem)
        if op.kind == _RECV:
            payload = _view(op.ptr, op.count, op.dtype)
        else:
            payload = np.empty(op.count, _NUMPY[op.dtype])
        if count:
            self._wait([self._comm.Irecv(payload, source=peer, tag=_PAYLOAD_TAG)], op.describe())
        return payload

    def _wait(self, requests, what, receives=True):
        requests = [r for r in requests if r != MPI.REQUEST_NULL]
        start = time.perf_counter()
        while not MPI.Request.Testall(requests):
            if self._state != "ok":
                if receives:
                    self._cancel(requests)
                raise NcclError(f"{what}: communicator {self._state} while the operation ran")
            if time.perf_counter() - start > self.timeout_s:
                if receives:
                    self._cancel(requests)
                raise NcclError(f"rank {self._rank}: {what} did not complete within "
                                f"{self.timeout_s:g} s (real NCCL would hang here: the peer "
                                "never posted the matching operation)")
            time.sleep(2e-4)

    @staticmethod
    def _cancel(requests):
        """Withdraw receives that will never match, so nothing writes the buffers later."""
        for request in requests:
            try:
                request.Cancel()
                request.Test()
            except MPI.Exception:
                pass

    def _combine(self, op, got):
        data = _view(op.ptr[0], op.count, op.dtype)
        out = _view(op.ptr[1], op.count, op.dtype)
        reduce = _REDUCE[op.op[0]]
        total = None
        for peer in range(self._size):     # rank order: the same float result on every rank
            part = data if peer == self._rank else got[(id(op), peer)]
            total = part.copy() if total is None else reduce(total, part)
        if op.count:
            out[...] = total

    # -- the NCCL surface ----------------------------------------------------------------
    def _check(self, count, datatype, peer=None):
        if not (isinstance(count, (int, np.integer)) and count >= 0):
            raise NcclError(f"count must be a non-negative integer, got {count!r}")
        if datatype not in _NUMPY:
            raise NcclError(f"unknown NCCL datatype {datatype!r}")
        if peer is not None and not (isinstance(peer, (int, np.integer)) and 0 <= peer < self._size):
            raise NcclError(f"peer {peer!r} is not a rank of this {self._size}-rank communicator")

    def send(self, sendbuf, count, datatype, peer, stream):
        """Send ``count`` elements at host address ``sendbuf`` to ``peer``."""
        self._check(count, datatype, peer)
        self._queue(_Op(self, _SEND, int(sendbuf), int(count), datatype, int(peer)))

    def recv(self, recvbuf, count, datatype, peer, stream):
        """Receive ``count`` elements from ``peer`` into host address ``recvbuf``."""
        self._check(count, datatype, peer)
        self._queue(_Op(self, _RECV, int(recvbuf), int(count), datatype, int(peer)))

    def allReduce(self, sendbuf, recvbuf, count, datatype, op, stream):
        """Reduce ``count`` elements over all ranks into ``recvbuf`` (in rank order)."""
        self._check(count, datatype)
        if op not in _REDUCE:
            raise NcclError(f"unknown NCCL reduction op {op!r}")
        self._queue(_Op(self, _ALLREDUCE, (int(sendbuf), int(recvbuf)), int(count), datatype,
                        None, op))

    def rank_id(self):
        self._usable("rank_id")
        return self._rank

    def size(self):
        self._usable("size")
        return self._size

    def device_id(self):
        self._usable("device_id")
        return -1

    def check_async_error(self):
        """Raise when the communicator was aborted (the only asynchronous error here)."""
        self._usable("check_async_error")

    def abort(self):
        """Abort: operations in flight on other threads fail, any later use raises."""
        self._usable("abort")
        if _group().depth and any(op.comm is self for op in _group().ops):
            raise NcclRuleError("abort inside an open group holding this communicator's operations")
        self._state = "abort"
        self._free()

    def destroy(self):
        """Free the communicator; it must be idle (no thread inside, no open group)."""
        self._usable("destroy")
        if self._inside is not None:
            raise NcclRuleError(f"destroy while thread {self._inside.name!r} is inside the communicator")
        if _group().depth and any(op.comm is self for op in _group().ops):
            raise NcclRuleError("destroy inside an open group holding this communicator's operations")
        self._state = "destroy"
        self._free()

    def _free(self):
        comm, self._comm = self._comm, None
        if comm is not None and self._inside is None:
            comm.Free()
