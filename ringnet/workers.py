"""Long-lived worker threads for work that recurs: a loader's prefetch every epoch, rank 0's
checkpoint write every periodic save.

A thread started per epoch or per save costs native memory in an MPI process that is not
given back: with MPICH initialised (MPI_THREAD_MULTIPLE) every thread that ever ran keeps
about 290 bytes (a thread started and joined 20,000 times: +5.6 MB of RSS with mpi4py
imported, +4 KB without), so a run of many short epochs grew by about 1 KB/s a rank.
A :class:`Worker` runs its jobs one after another on one thread, which names itself
``NAME (idle)`` between jobs and ends after ``idle_s`` seconds without one (a worker no
longer used leaves no thread behind; the next job starts a new one).
"""
import atexit
import queue
import threading
import time
import traceback
import weakref

__all__ = ["Worker"]

_FINISH_AT_EXIT = weakref.WeakSet()


@atexit.register
def _finish_jobs():
    """At the interpreter's exit, let the jobs of workers that asked for it finish (their
    threads are daemons, which would otherwise stop wherever they are)."""
    for worker in list(_FINISH_AT_EXIT):
        worker.wait_idle()


class Worker:
    """One daemon thread that runs submitted jobs in order.

    ``finish_at_exit``: a job in flight when the interpreter exits is waited for (as for a
    non-daemon thread), so a checkpoint being written is completed.
    """

    IDLE_S = 30.0

    def __init__(self, name, idle_s=None, finish_at_exit=False):
        self.name = name
        self.idle_s = self.IDLE_S if idle_s is None else idle_s
        self._jobs = queue.Queue()
        self._lock = threading.Lock()
        self._thread = None
        self._last = None           # the Event of the job submitted last
        if finish_at_exit:
            _FINISH_AT_EXIT.add(self)

    def submit(self, job):
        """Run ``job()`` on the worker's thread; return an Event set once it returned or
        raised (what it raised is the job's to keep)."""
        done = threading.Event()
        with self._lock:
            self._jobs.put((job, done))
            self._last = done
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name=self.name, daemon=True)
                self._thread.start()
        return done

    def alive(self):
        """Whether the worker's thread runs (at the interpreter's exit a daemon thread may
        be gone with its job unfinished)."""
        thread = self._thread
        return thread is not None and thread.is_alive()

    def wait(self, done, timeout=None):
        """Wait for the job whose Event is ``done``; return whether it finished (False: the
        timeout passed, or the thread is gone)."""
        end = None if timeout is None else time.monotonic() + timeout
        while not done.wait(0.05):
            if not self.alive() and not done.is_set():
                return False
            if end is not None and time.monotonic() > end:
                return False
        return True

    def wait_idle(self, timeout=None):
        """Wait until every job submitted so far has finished; return whether they had."""
        last = self._last
        return True if last is None else self.wait(last, timeout)

    def _loop(self):
        me = threading.current_thread()
        while True:
            try:
                job, done = self._jobs.get(timeout=self.idle_s)
            except queue.Empty:
                with self._lock:        # no job came: end, unless one is being submitted
                    if self._jobs.empty():
                        self._thread = None
                        return
                continue
            me.name = self.name
            try:
                job()
            except BaseException:       # noqa: BLE001 - a job reports its own failures; a
                traceback.print_exc()   # bug in one is shown, and the worker goes on
            finally:
                me.name = f"{self.name} (idle)"
                done.set()
