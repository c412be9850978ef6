"""The machine a benchmark ran on, as every benchmark prints it.

At its start a benchmark prints one line naming the BLAS that runs (library, version, the
kernels it chose, its threads, and whether ``OPENBLAS_CORETYPE`` / ``OPENBLAS_L2_SIZE`` are
set: :func:`ringnet.blas.describe_line`) and the load average; at its end the load average
at start and end. A verdict (PASS / FAIL against a target) is withheld while the machine
was busy -- a 1-minute load average above :data:`BUSY_PER_CORE` per core at the start or
at the end -- and the output says why instead::

    from ringnet.bench import machine
    run = machine.begin()               # prints the BLAS line and the load at start
    ...                                 # the benchmark
    run.end()                           # prints the load at start and at end
    print(run.verdict(passed))          # PASS, FAIL, or "no verdict: load average 2.30 at
                                        #   end, above 1.5 for 2 cores"
    doc.update(run.facts())             # --json: {"blas": {...}, "load": {...}}

Nothing here sets or unsets an environment variable: the facts are reported as found.
"""
import os
import sys

from ringnet.blas import describe, describe_line

__all__ = ["BUSY_PER_CORE", "Machine", "begin", "load_average", "machine_cores"]

BUSY_PER_CORE = 0.75    # a load average above this many runnable processes per core is busy


def load_average():
    """Return the 1-minute load average, or None where the system does not give one."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


def machine_cores():
    """Return the machine's core count (the load average counts the whole machine's)."""
    return os.cpu_count() or 1


class Machine:
    """The facts of one benchmark run: its BLAS and the load average at start and end.

    ``threads``: the BLAS threads that ran where that is not this process's count (the ranks
    a benchmark launches with one thread each: ``threads=1, per_rank=True``).
    """

    def __init__(self, threads=None, per_rank=False):
        self.blas = describe()
        self.threads, self.per_rank = threads, per_rank
        self.cores = machine_cores()
        self.busy_above = BUSY_PER_CORE * self.cores
        self.load_start = load_average()
        self.load_end = None

    def header(self):
        """The first line a benchmark prints: the BLAS, and the load average now."""
        load = "unknown" if self.load_start is None else f"{self.load_start:.2f}"
        busy = self.load_start is not None and self.load_start > self.busy_above
        return (f"{describe_line(self.blas, self.threads, self.per_rank)}; load average "
                f"{load} at start ({self.cores} cores; busy above {self.busy_above:g})"
                + ("; BUSY: other programs share the cores, timings taken now are not "
                   "the machine's" if busy else ""))

    def end(self, out=None):
        """Record the load average at the end, print the load line to ``out`` (default
        stdout; False prints nothing) and return it."""
        self.load_end = load_average()
        loads = [("unknown" if v is None else f"{v:.2f}") for v in (self.load_start, self.load_end)]
        reason = self.busy()
        line = (f"load average {loads[0]} at start, {loads[1]} at end ({self.cores} cores: "
                + (f"busy, above {self.busy_above:g})" if reason else "quiet)"))
        if out is not False:
            print(line, file=out or sys.stdout, flush=True)
        return line

    def busy(self):
        """Return why the machine counts as busy ("load average 2.30 at end, above 1.5 for
        2 cores"), or None when it was quiet at start and at end. Reads the load now when
        :meth:`end` was not called."""
        end = self.load_end if self.load_end is not None else load_average()
        high = [f"{v:.2f} at {when}" for when, v in (("start", self.load_start), ("end", end))
                if v is not None and v > self.busy_above]
        if not high:
            return None
        return (f"load average {' and '.join(high)}, above {self.busy_above:g} for "
                f"{self.cores} cores")

    def verdict(self, passed):
        """Return "PASS" or "FAIL" for ``passed``, or "no verdict: <why>" while busy."""
        reason = self.busy()
        if reason:
            return f"no verdict: {reason}"
        return "PASS" if passed else "FAIL"

    def facts(self):
        """Return the same facts for a --json document: {"blas": ..., "load": ...}."""
        return {"blas": dict(self.blas, threads_ran=self.threads if self.threads is not None
                             else self.blas["threads"], per_rank=self.per_rank),
                "load": {"start": _rounded(self.load_start), "end": _rounded(self.load_end),
                         "cores": self.cores,
                         "busy_above": self.busy_above, "busy": self.busy()}}


def _rounded(value):
    return None if value is None else round(value, 3)


def begin(out=None, threads=None, per_rank=False):
    """Start a benchmark's record: print :meth:`Machine.header` to ``out`` (default stdout;
    a benchmark printing --json passes ``sys.stderr``, False prints nothing) and return the
    :class:`Machine`."""
    run = Machine(threads, per_rank)
    if out is not False:
        print(run.header(), file=out or sys.stdout, flush=True)
    return run
