"""The stand-in's NCCL: groups, launching operations on streams in each device's launch
order, and :class:`NcclCommunicator` with its rules; see :mod:`ringnet.testing.nccl_standin`."""
import collections
import itertools
import secrets
import threading
import time

import numpy as np
from mpi4py import MPI

from ringnet.testing.nccl_standin.common import (
    ALLREDUCE, HEADER_LEN, HEADER_TAG, JOIN_TAG, KINDS, MEMBERS_TAG, NUMPY, ORDER_WINDOW,
    PAYLOAD_TAG, RECV, REDUCE, SEND, UNIQUE_ID_BYTES, NcclError, NcclRuleError, thread_state, state_lock,
    default_timeout_s)
from ringnet.testing.nccl_standin.devices import check_use, current_device, queue_of
from ringnet.testing.nccl_standin.memory import land, outgoing, release, Write, pending_writes

# -- groups (per thread, as in NCCL) -------------------------------------------------------
def _group():
    state = thread_state
    if not hasattr(state, "depth"):
        state.depth, state.ops = 0, []
    return state


def groupStart():
    """Open a group on this thread: operations until the matching groupEnd launch together."""
    check_use("ncclGroupStart")
    _group().depth += 1


def groupEnd():
    """Close this thread's group; the outermost groupEnd enqueues the queued operations."""
    check_use("ncclGroupEnd")
    state = _group()
    if state.depth == 0:
        raise NcclRuleError("groupEnd without a matching groupStart on this thread")
    state.depth -= 1
    if state.depth == 0:
        ops, state.ops = state.ops, []
        comms = list(dict.fromkeys(op.comm for op in ops))
        try:
            if ops:
                _launch(ops)
        finally:
            for comm in comms:
                comm._leave()


class _Op:
    __slots__ = ("comm", "kind", "ptr", "count", "dtype", "peer", "op", "seq", "queue",
                 "owner", "write", "device_seq")

    def __init__(self, comm, kind, ptr, count, dtype, peer, op=None):
        self.comm, self.kind, self.ptr, self.count = comm, kind, ptr, count
        self.dtype, self.peer, self.op, self.seq = dtype, peer, op, None
        self.queue = self.write = self.device_seq = None
        self.owner = None

    def describe(self):
        if self.kind == ALLREDUCE:
            return f"allReduce of {self.count} x dtype {self.dtype}"
        where = "to" if self.kind == SEND else "from"
        return f"{KINDS[self.kind]} {where} rank {self.peer} of {self.count} x dtype {self.dtype}"

    def output(self):
        """The address this operation writes, or None."""
        if self.kind == RECV:
            return self.ptr
        return self.ptr[1] if self.kind == ALLREDUCE else None


_device_launches = collections.Counter()     # device -> NCCL launches so far


def _launch(ops):
    """Enqueue one group on its stream, numbering it in this device's launch order."""
    queues = list(dict.fromkeys(op.queue for op in ops))
    if len(queues) > 1:
        raise NcclRuleError("one NCCL group on two streams: the stand-in runs a group on one stream")
    queue = queues[0]
    comms = list(dict.fromkeys(op.comm for op in ops))
    with state_lock:
        _device_launches[queue.device] += 1
        device_seq = _device_launches[queue.device]
        turns = {}
        for comm in comms:
            turns[comm] = comm._launched
            comm._launched += 1
        writes = []
        for op in ops:
            op.device_seq = device_seq
            op.comm._number(op)
            out = op.output()
            if out is not None and op.owner is not None and op.count:
                nbytes = op.count * np.dtype(NUMPY[op.dtype]).itemsize
                op.write = Write(queue, op.comm, int(out), int(out) + nbytes, op.owner,
                                  op.describe())
                writes.append(op.write)
                pending_writes.append(op.write)
        position = queue.put(lambda: _execute(ops, turns))
        for write in writes:
            write.seq = position


def _execute(ops, turns):
    """Run one group on its stream's thread: post every send, then match every receive."""
    comms = list(turns)
    try:
        for comm in comms:
            comm._await_turn(turns[comm])
        pending, receives, inputs = [], [], {}
        for op in ops:
            if op.kind == SEND:
                data = inputs[id(op)] = outgoing(op, op.ptr, op.count)
                pending += op.comm._post_send(op, op.peer, op.seq, data)
            elif op.kind == RECV:
                receives.append((op, op.peer, op.seq))
            else:   # allReduce: exchange with every peer, combine in rank order
                data = inputs[id(op)] = outgoing(op, op.ptr[0], op.count)
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
            if op.kind == RECV:
                land(op, op.ptr, got[(id(op), op.peer)])
            elif op.kind == ALLREDUCE:
                land(op, op.ptr[1], op.comm._combine(op, inputs[id(op)], got))
    except BaseException as exc:  # noqa: BLE001 - asynchronous: kept for check_async_error
        error = exc if isinstance(exc, NcclError) else NcclError(f"{type(exc).__name__}: {exc}")
        for comm in comms:
            comm._fail(error)
        with state_lock:
            for op in ops:
                if op.write is not None and op.write in pending_writes:
                    pending_writes.remove(op.write)
    finally:
        for comm in comms:
            comm._ran_one()


# -- launch order across the communicators of one device -------------------------------------
_order_pairs = {}       # (device, peer world rank) -> recent (mine, theirs, comm, what)


def _check_launch_order(comm, op, peer_world, theirs):
    """Compare the device-wide launch number of ``op`` and of its peer's match with those of
    the other communicators' operations met with that peer."""
    mine = op.device_seq
    with state_lock:
        pairs = _order_pairs.setdefault((comm._device, peer_world),
                                        collections.deque(maxlen=ORDER_WINDOW))
        for m, t, other, what in pairs:
            if other is not comm and m != mine and t != theirs and (m < mine) != (t < theirs):
                me = MPI.COMM_WORLD.Get_rank()
                first, second = ((what, other), (op.describe(), comm)) if m < mine \
                    else ((op.describe(), comm), (what, other))
                raise NcclRuleError(
                    f"operations on two communicators of device {comm._device} are launched in "
                    f"different orders: rank {me} launched {first[0]} ({first[1].name}) before "
                    f"{second[0]} ({second[1].name}), rank {peer_world} their matches the other "
                    "way round; NCCL kernels of one device can then wait on each other for ever "
                    "(launch them in one order on every rank)")
        pairs.append((mine, theirs, comm, op.describe()))


# -- communicators ---------------------------------------------------------------------------
_live = []                  # communicators not destroyed or aborted, in creation order
_created = itertools.count(1)


def get_unique_id():
    """Return a 128-entry tuple naming a new communicator (its creator's rank is its root)."""
    raw = MPI.COMM_WORLD.Get_rank().to_bytes(4, "little") + secrets.token_bytes(16)
    return tuple(raw + bytes(UNIQUE_ID_BYTES - len(raw)))


class NcclCommunicator:
    """A communicator of ``ndev`` ranks; all of them call this with the same unique id."""

    def __init__(self, ndev, commId, rank):
        if not (isinstance(ndev, int) and ndev >= 1 and isinstance(rank, int) and 0 <= rank < ndev):
            raise NcclError(f"NcclCommunicator: rank {rank!r} is not in [0, {ndev!r})")
        raw = bytes(b % 256 for b in commId)
        if len(raw) != UNIQUE_ID_BYTES:
            raise NcclError(f"NcclCommunicator: unique id of {len(raw)} bytes, expected 128")
        check_use("ncclCommInitRank")
        self._device = current_device()
        self.name = f"communicator #{next(_created)}"
        with state_lock:
            for other in _live:
                if other._device == self._device and other._launched > other._ran:
                    raise NcclRuleError(
                        f"{self.name} made while {other.name} of device {self._device} has "
                        f"{other._launched - other._ran} operation(s) in flight: making a "
                        "communicator allocates device memory, which can deadlock with NCCL "
                        "kernels running (synchronize the device first)")
        self._size, self._rank = ndev, rank
        self.timeout_s = default_timeout_s()
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._inside = None         # thread now inside an operation or an open group
        self._owner = None          # thread that issued the first operation
        self._state = "ok"
        self._error = None          # the asynchronous error, once one happened
        self._sent = [0] * ndev     # per-peer sequence numbers
        self._received = [0] * ndev
        self._collectives = 0
        self._launched = self._ran = 0
        # What its first use would still connect: p2p with every peer and the collectives.
        self._cold = {(kind, peer) for kind in ("send", "recv") for peer in range(ndev)
                      if peer != rank}
        if ndev > 1:
            self._cold.add(("collective", None))
        self._comm, self._world = self._join(raw)
        with state_lock:
            _live.append(self)

    # -- set-up: find the other members through the unique id's root, make an MPI group --
    def _join(self, raw):
        world = MPI.COMM_WORLD
        root = int.from_bytes(raw[:4], "little")
        me = world.Get_rank()
        if self._size == 1:
            return MPI.COMM_SELF.Dup(), [me]
        token = np.frombuffer(raw[4:20], dtype=np.uint8)
        if me == root:
            members = {self._rank: me}
            start = time.perf_counter()
            while len(members) < self._size:
                status = MPI.Status()
                if not world.Iprobe(MPI.ANY_SOURCE, JOIN_TAG, status):
                    if time.perf_counter() - start > self.timeout_s:
                        missing = sorted(set(range(self._size)) - set(members))
                        raise NcclError(f"NcclCommunicator init: rank(s) {missing} did not join "
                                        f"within {self.timeout_s:g} s")
                    time.sleep(1e-3)
                    continue
                info = np.empty(19, np.int64)
                world.Recv(info, source=status.Get_source(), tag=JOIN_TAG)
                if not np.array_equal(info[3:].astype(np.uint8), token) or info[1] != self._size:
                    raise NcclRuleError(f"NcclCommunicator init: world rank {info[2]} joined with "
                                        f"another unique id or size ({info[1]} ranks)")
                if int(info[0]) in members:
                    raise NcclRuleError(f"NcclCommunicator init: rank {info[0]} joined twice")
                members[int(info[0])] = int(info[2])
            order = np.array([members[r] for r in range(self._size)], np.int64)
            for r in range(self._size):
                if order[r] != me:
                    world.Send(order, dest=int(order[r]), tag=MEMBERS_TAG)
        else:
            info = np.concatenate([[self._rank, self._size, me], token]).astype(np.int64)
            world.Send(info, dest=root, tag=JOIN_TAG)
            order = np.empty(self._size, np.int64)
            request = world.Irecv(order, source=root, tag=MEMBERS_TAG)
            start = time.perf_counter()
            while not request.Test():
                if time.perf_counter() - start > self.timeout_s:
                    raise NcclError(f"NcclCommunicator init: root (world rank {root}) did not answer "
                                    f"within {self.timeout_s:g} s")
                time.sleep(1e-3)
        everyone = world.Get_group()
        group = everyone.Incl([int(r) for r in order])
        try:
            return world.Create_group(group, tag=MEMBERS_TAG), [int(r) for r in order]
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
        if self._error is not None:
            raise NcclError(f"{what} on {self.name}, which failed before: {self._error}")
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
            self._inside = me

    def _leave(self):
        with self._lock:
            self._inside = None

    def _check_warm(self, op):
        """Refuse ``op`` while another communicator of this device is cold; note what it warms."""
        with state_lock:
            for other in _live:
                if other is not self and other._device == self._device and other._cold:
                    missing = ", ".join(
                        "run a collective" if kind == "collective"
                        else f"{kind} {'to' if kind == 'send' else 'from'} rank {peer}"
                        for kind, peer in sorted(other._cold, key=str))
                    raise NcclRuleError(
                        f"{op.describe()} on {self.name} while {other.name} of device "
                        f"{self._device} is not warmed up (it has yet to {missing}): its first "
                        "use connects ranks and allocates device memory, which can deadlock "
                        "with NCCL kernels running; use every communicator once, with every "
                        "peer and one collective, when it is made")
            if op.kind == ALLREDUCE:
                self._cold.discard(("collective", None))
            else:
                self._cold.discard(("send" if op.kind == SEND else "recv", op.peer))

    def _queue(self, op, stream):
        what = op.describe()
        check_use(f"nccl {what}", self._device)
        op.queue = queue_of(stream, self._device)
        self._claim(what)
        try:
            self._check_warm(op)
        except BaseException:
            self._leave()
            raise
        state = _group()
        if state.depth:
            state.ops.append(op)        # inside until groupEnd
            return
        try:
            _launch([op])
        finally:
            self._leave()

    def _number(self, op):
        if op.kind == SEND:
            op.seq = self._sent[op.peer]
            self._sent[op.peer] += 1
        elif op.kind == RECV:
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

    # -- on the stream's thread ----------------------------------------------------------
    def _await_turn(self, turn):
        """Operations of one communicator run in launch order, whatever streams they are on."""
        with self._cond:
            if not self._cond.wait_for(lambda: self._ran >= turn, self.timeout_s):
                raise NcclError(f"{self.name}: operation no. {turn} waited {self.timeout_s:g} s "
                                "for the one launched before it")

    def _ran_one(self):
        with self._cond:
            self._ran += 1
            self._cond.notify_all()
            idle = self._ran >= self._launched
        if idle and self._state != "ok":
            self._free()

    def _fail(self, error):
        if self._error is None:
            self._error = error

    def _header(self, op, peer, seq):
        red, number = op.op if op.kind == ALLREDUCE else (-1, -1)
        return np.array([op.kind, self._rank, peer, seq, op.count, op.dtype, number, red,
                         op.device_seq], np.int64)

    def _post_send(self, op, peer, seq, data):
        header = self._header(op, peer, seq)
        requests = [self._comm.Isend(header, dest=peer, tag=HEADER_TAG)]
        if op.count:
            # Synchronous send: completes only when the receive has started, as in NCCL.
            requests.append(self._comm.Issend(data, dest=peer, tag=PAYLOAD_TAG))
        return requests

    def _receive(self, op, peer, seq):
        """Take the next message from ``peer``, check it matches ``op``; return its payload."""
        header = np.empty(HEADER_LEN, np.int64)
        self._wait([self._comm.Irecv(header, source=peer, tag=HEADER_TAG)], op.describe())
        kind, sender, receiver, their_seq, count, dtype, number, red, launched = (int(v) for v in header)
        expected_kind = SEND if op.kind == RECV else op.kind
        mine = (f"rank {self._rank}'s {op.describe()} (its operation no. {seq} with rank {peer})")
        theirs = (f"rank {sender}'s {KINDS.get(kind, kind)} of {count} x dtype {dtype} "
                  f"(its operation no. {their_seq} with rank {receiver})")
        problem = None
        if kind != expected_kind or receiver != self._rank or their_seq != seq:
            problem = f"operation order differs between ranks: {mine} met {theirs}"
        elif op.kind == ALLREDUCE and (number, red) != op.op[::-1]:
            problem = (f"operation order differs between ranks: {mine} (collective no. "
                       f"{op.op[1]}, op {op.op[0]}) met {theirs} (collective no. {number}, op {red})")
        elif count != op.count or dtype != op.dtype:
            problem = f"send and receive sizes differ: {mine} met {theirs}"
        if problem is not None:
            if count and dtype in NUMPY:   # take the message, so the sender is not left hanging
                scratch = np.empty(count, NUMPY[dtype])
                self._wait([self._comm.Irecv(scratch, source=peer, tag=PAYLOAD_TAG)], op.describe())
            raise NcclRuleError(problem)
        payload = np.empty(op.count, NUMPY[op.dtype])
        if count:
            self._wait([self._comm.Irecv(payload, source=peer, tag=PAYLOAD_TAG)], op.describe())
        _check_launch_order(self, op, self._world[peer], launched)
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

    def _combine(self, op, data, got):
        reduce = REDUCE[op.op[0]]
        total = None
        for peer in range(self._size):     # rank order: the same float result on every rank
            part = data if peer == self._rank else got[(id(op), peer)]
            total = part.copy() if total is None else reduce(total, part)
        return total if total is not None else np.empty(0, NUMPY[op.dtype])

    # -- the NCCL surface ----------------------------------------------------------------
    def _check_args(self, count, datatype, peer=None):
        if not (isinstance(count, (int, np.integer)) and count >= 0):
            raise NcclError(f"count must be a non-negative integer, got {count!r}")
        if datatype not in NUMPY:
            raise NcclError(f"unknown NCCL datatype {datatype!r}")
        if peer is not None and not (isinstance(peer, (int, np.integer)) and 0 <= peer < self._size):
            raise NcclError(f"peer {peer!r} is not a rank of this {self._size}-rank communicator")

    def send(self, sendbuf, count, datatype, peer, stream):
        """Send ``count`` elements at host address ``sendbuf`` to ``peer`` on ``stream``."""
        self._check_args(count, datatype, peer)
        op = _Op(self, SEND, int(sendbuf), int(count), datatype, int(peer))
        op.owner = getattr(sendbuf, "owner", None)
        self._queue(op, stream)

    def recv(self, recvbuf, count, datatype, peer, stream):
        """Receive ``count`` elements from ``peer`` into host address ``recvbuf`` on ``stream``."""
        self._check_args(count, datatype, peer)
        op = _Op(self, RECV, int(recvbuf), int(count), datatype, int(peer))
        op.owner = getattr(recvbuf, "owner", None)
        self._queue(op, stream)

    def allReduce(self, sendbuf, recvbuf, count, datatype, op, stream):
        """Reduce ``count`` elements over all ranks into ``recvbuf`` (in rank order)."""
        self._check_args(count, datatype)
        if op not in REDUCE:
            raise NcclError(f"unknown NCCL reduction op {op!r}")
        operation = _Op(self, ALLREDUCE, (int(sendbuf), int(recvbuf)), int(count), datatype,
                        None, op)
        operation.owner = getattr(recvbuf, "owner", None)
        self._queue(operation, stream)

    def rank_id(self):
        self._usable("rank_id")
        return self._rank

    def size(self):
        self._usable("size")
        return self._size

    def device_id(self):
        self._usable("device_id")
        return self._device

    def check_async_error(self):
        """Raise the asynchronous error of an operation that failed on its stream, if any."""
        check_use("ncclCommGetAsyncError", self._device)
        self._usable("check_async_error")
        if self._error is not None:
            raise self._error

    def abort(self):
        """Abort: operations in flight fail (their streams go on), any later use raises."""
        check_use("ncclCommAbort", self._device)
        self._usable("abort")
        if _group().depth and any(op.comm is self for op in _group().ops):
            raise NcclRuleError("abort inside an open group holding this communicator's operations")
        self._state = "abort"
        self._retire()

    def destroy(self):
        """Free the communicator; it must be idle (no thread inside, no open group, nothing in
        flight)."""
        check_use("ncclCommDestroy", self._device)
        self._usable("destroy")
        if self._inside is not None:
            raise NcclRuleError(f"destroy while thread {self._inside.name!r} is inside the communicator")
        if _group().depth and any(op.comm is self for op in _group().ops):
            raise NcclRuleError("destroy inside an open group holding this communicator's operations")
        if self._launched > self._ran:
            raise NcclRuleError(f"destroy of {self.name} with {self._launched - self._ran} "
                                "operation(s) in flight: synchronize their streams first")
        self._state = "destroy"
        self._retire()

    def _retire(self):
        with state_lock:
            if self in _live:
                _live.remove(self)
            for write in [w for w in pending_writes if w.comm is self and w.state != "pending"]:
                release(write)
        with self._cond:
            idle = self._ran >= self._launched
        if idle:
            self._free()

    def _free(self):
        with self._cond:
            comm, self._comm = self._comm, None
        if comm is not None:
            comm.Free()
