"""Periodic checkpoints (``--save-every K``) and the heartbeat ``python -m ringnet.launch`` reads
(the step a run last reached, so a relaunch knows how far the saves got).

A run with ``--save-every K`` rewrites its ``--save`` checkpoint after every K-th step,
so a run that loses a rank loses at most K steps. The checkpoint of step k holds the
whole optimizer state (weights, momentum, and under delay 1 the weights the next step
computes on), so a run resumed from it at any rank count continues the trajectory an
uninterrupted run takes from that checkpoint.

One save: every rank takes part in collecting the state (``strategy.full_state()``
drains the exchange in flight, and split-fc gathers the FC slices), then rank 0 writes
the file on a background thread (the same one for every save) while every rank trains on.
Whether the write worked is agreed by all ranks at the next save (or at the end of the
run), except for the first periodic save, which is agreed at once: a checkpoint that
cannot be written stops the run there with exit 2, not after the whole run.
``python -m ringnet.bench elastic`` measures this against rank 0 writing while the others
wait.

When ``RINGNET_HEARTBEAT`` names a file, rank 0 writes the number of steps finished to
it after every step (one ``pwrite``); the launcher uses it to say how many steps a
failure cost, to recognise a failure that recurs at the same step, and to notice a
stalled job.
"""
import os

from ringnet.control import collective
from ringnet.workers import Worker

__all__ = ["PeriodicSaver", "Heartbeat", "read_heartbeat", "HEARTBEAT_ENV"]

HEARTBEAT_ENV = "RINGNET_HEARTBEAT"
_WIDTH = 24     # bytes of one heartbeat record: a right-aligned step count and a newline


class Heartbeat:
    """Rank 0 writes the step count to ``$RINGNET_HEARTBEAT``; a no-op elsewhere."""

    def __init__(self, rank, path=None):
        path = os.environ.get(HEARTBEAT_ENV) if path is None else path
        self.fd = None
        if rank == 0 and path:
            try:
                self.fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
            except OSError:
                self.fd = None      # the launcher then knows less; training goes on

    def beat(self, step):
        """Record that ``step`` steps are finished."""
        if self.fd is not None:
            os.pwrite(self.fd, f"{step:{_WIDTH - 1}d}\n".encode(), 0)

    def close(self):
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def read_heartbeat(path):
    """Return the step count last written to ``path``, or None when nothing was written."""
    try:
        with open(path, "rb") as f:
            text = f.read(_WIDTH)
    except OSError:
        return None
    try:
        return int(text)
    except ValueError:
        return None


class PeriodicSaver:
    """Checkpoint every ``every`` steps and at the end; see the module docstring.

    ``collect()`` returns the state to save (collective); ``write(state, step)`` writes it
    (called on rank 0 only, may raise UsageError). ``background=False`` makes every save
    synchronous: rank 0 writes while the other ranks wait for the agreement; by default it
    is False unless ``RINGNET_SAVE_SYNC=1`` (what ``bench elastic`` compares).
    """

    def __init__(self, world, every, collect, write, background=None):
        self.world = world
        self.rank = world.Get_rank()
        self.every = every
        self.collect = collect
        self.write = write
        if background is None:      # RINGNET_SAVE_SYNC=1: the benchmark's comparison
            background = os.environ.get("RINGNET_SAVE_SYNC", "0") in ("", "0")
        self.background = background
        self.heartbeat = Heartbeat(self.rank)
        self.saves = 0          # periodic saves started
        self._done = None       # the write in flight (rank 0): set when it ended
        # one thread for every write (a thread per save costs native memory under MPI,
        # ringnet.workers); a write in flight at the interpreter's exit is finished
        self._writer = (Worker("ringnet-checkpoint", finish_at_exit=True) if self.rank == 0
                        else None)
        self._guard = None
        self._error = None

    def start(self, step):
        """Record the step the run starts at (resumed runs: the checkpoint's)."""
        self.heartbeat.beat(step)

    def after_step(self, step, total_steps):
        """Call after each finished step: beat, and save when ``step`` is a multiple of K."""
        self.heartbeat.beat(step)
        if self.every and step % self.every == 0 and step < total_steps:
            self.save(step, wait=not self.background or self.saves == 0)
            self.saves += 1

    def save(self, step, wait=True):
        """Write the checkpoint of ``step`` (collective). ``wait``: agree on the outcome now."""
        self.wait()
        state = self.collect()
        if self.rank == 0:
            if wait:
                self._run_write(state, step)
            else:
                from ringnet.checkpoint import temporaries_guard
                self._guard = temporaries_guard().__enter__()   # a signal removes its temporary
                self._done = self._writer.submit(lambda: self._run_write(state, step))
        if wait:
            self.wait()

    def wait(self):
        """Finish rank 0's write in flight; every rank learns whether it worked (collective)."""
        def outcome():
            self._join()
            error, self._error = self._error, None
            if error is not None:
                raise error
        collective(self.world, outcome)

    def finish(self, step):
        """Write the final checkpoint (collective, synchronous) and stop the heartbeat."""
        self.save(step, wait=True)
        self.heartbeat.close()

    def close(self):
        """Wait for a write in flight without agreeing (the run is ending anyway)."""
        self._join()
        self.heartbeat.close()

    def _join(self):
        if self._done is not None:
            self._writer.wait(self._done)
            self._done = None
        if self._guard is not None:
            self._guard.__exit__(None, None, None)
            self._guard = None

    def _run_write(self, state, step):
        try:
            self.write(state, step)
        except Exception as exc:    # noqa: BLE001 - reported by wait() on every rank
            self._error = exc
