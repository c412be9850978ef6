"""What can go wrong, as types, and the exit codes a job ends with.

* :class:`UsageError` — bad command-line input (flags, data files, a world size a mode
  cannot use, ranks started with different settings). Exit code 2 with one line
  ``ringnet: error: ...``.
* library errors the entry points report the same way: :class:`InputError`
  (a ``ValueError``: input the library cannot use, e.g. a model split-fc cannot split)
  and :class:`SetupError` (a ``RuntimeError``: the machine cannot run what was asked).
  Library modules raise these in their own words; only entry points speak of flags.
* :class:`TrainingError` — a run that cannot go on (NaN loss, replicas that diverged, a
  rank that stopped answering, a data chunk that cannot be read mid-training:
  :class:`RunInputError`, exit code 2). The rank that saw it prints one line naming the
  step or phase and the rank(s) at fault, then the whole MPI job is aborted.
* Ctrl-C (SIGINT) — rank 0 prints ``ringnet: error: interrupted`` and every rank
  exits 130 (:data:`EXIT_INTERRUPTED`); SIGTERM/SIGUSR1 stop at a step boundary with a
  checkpoint saved and exit 75 (:data:`EXIT_STOPPED`).
* any other exception — a bug. The failing rank prints its traceback once, prefixed
  with its rank, and the whole MPI job is aborted (``MPI_Abort``).

How an entry point turns these into its exit is :func:`ringnet.cli.run_main`; how ranks
agree under deadlines is :mod:`ringnet.control`; how a rank ends the job is
:mod:`ringnet.shutdown`. This module imports nothing else from ringnet.
"""

__all__ = ["UsageError", "InputError", "SetupError", "TransportUnavailable", "USER_ERRORS",
           "TrainingError", "RunInputError", "StallError", "DivergedError", "EXIT_USAGE",
           "EXIT_FAILURE", "EXIT_DIVERGED", "EXIT_INTERRUPTED", "EXIT_STOPPED"]

EXIT_USAGE = 2
EXIT_FAILURE = 1
EXIT_DIVERGED = 3     # non-finite loss: a rerun from the same weights diverges again
EXIT_INTERRUPTED = 130  # 128 + SIGINT: what shells report for a program ended by Ctrl-C
EXIT_STOPPED = 75     # SIGTERM/SIGUSR1: stopped at a step boundary, checkpoint saved (EX_TEMPFAIL:
                      # try again later, i.e. requeue and --resume)


class UsageError(Exception):
    """Bad input from the user: reported in one line, exit code 2."""


class InputError(ValueError):
    """Input a library function cannot use, said in the library's words."""


class SetupError(RuntimeError):
    """The machine or installation cannot run what was asked (no usable GPU, NCCL missing)."""


class TransportUnavailable(SetupError):
    """A transport or device asked for cannot run on this rank.

    ``reason`` says which rule refused it, so that an entry point can name the setting
    to change: ``"cpu-device"`` (a GPU transport with the buffers on the CPU),
    ``"no-gpu"`` (the GPU asked for is not usable), ``"shared-gpu"`` (ranks share a GPU,
    which NCCL cannot run), ``"no-nccl"`` (NCCL does not load on every rank).
    ``transport`` is the transport asked for (None where the device was the problem).
    """

    REASONS = ("cpu-device", "no-gpu", "shared-gpu", "no-nccl")

    def __init__(self, message, reason, transport=None):
        if reason not in self.REASONS:
            raise ValueError(f"unknown reason {reason!r}: choose {', '.join(self.REASONS)}")
        super().__init__(message)
        self.reason, self.transport = reason, transport


# What an entry point reports in one line with exit code 2 (no traceback).
USER_ERRORS = (UsageError, InputError, SetupError)


class TrainingError(RuntimeError):
    """A run that cannot go on (NaN loss, replicas that diverged): one line, job aborted."""


class DivergedError(TrainingError):
    """The loss became NaN or infinite: deterministic, so the job ends with EXIT_DIVERGED."""
    exit_code = EXIT_DIVERGED


class RunInputError(TrainingError):
    """Bad input met during the run by some ranks only (a data chunk first read mid-training
    that cannot be read): the rank that met it prints one line, the job is aborted, exit 2."""
    exit_code = EXIT_USAGE


class StallError(TrainingError):
    """Ranks that did not arrive at a phase within the deadline.

    ``speaker``: the world rank that reports it (the lowest rank that did arrive), or None.
    ``who``: the missing ranks as the message names them (default 'rank 3' / 'ranks 2, 3';
    :func:`ringnet.control.stall_error` adds their nodes).
    """

    def __init__(self, missing, phase, seconds, detail=None, speaker=None, who=None):
        self.missing, self.phase, self.seconds = list(missing), phase, seconds
        self.speaker = speaker
        if who is None:
            who = (f"rank {self.missing[0]}" if len(self.missing) == 1
                   else f"ranks {', '.join(map(str, self.missing))}")
        text = (f"{who} did not arrive at {phase} within {seconds:.3g} s "
                f"(stopped, hung or far slower than the others; deadline: RINGNET_COMM_TIMEOUT)")
        super().__init__(text + (f"; {detail}" if detail else ""))
