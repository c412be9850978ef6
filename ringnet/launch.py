"""python -m ringnet.launch — run a training job and relaunch it from its checkpoint when a rank dies.

    python -m ringnet.launch -n 4 --shrink -- --mode ring --steps 2000 --save ck.h5 --save-every 100

runs ``mpirun -np 4 python -m ringnet.train ...`` (inside a SLURM allocation:
``srun --ntasks 4 ...``). When the job fails, the launcher relaunches it with
``--resume`` of the newest checkpoint the job wrote, up to ``--max-restarts`` times:

* on the same rank count (a transient failure), or with ``--shrink`` one rank fewer;
  under SLURM never more than the tasks the allocation still has;
* always the largest count ``n >= --min-ranks`` that divides the global batch, so every
  rank keeps a disjoint B/n share and the run continues the trajectory it would have
  taken from that checkpoint at n ranks;
* the mode, delay and global batch are pinned to the first launch's values.

Across nodes (``srun`` in an allocation of several nodes, or ``mpirun`` with hosts) it
probes every node after a failure and relaunches on those that answer, at most as many
ranks on each as the first launch placed there (see ``ringnet.hosts``).

It does not relaunch a job that failed on bad input (exit code 2: a bad flag, a
missing or corrupt file, an unwritable checkpoint), a job whose loss became NaN or
infinite (exit code 3: the same weights and batches diverge again), or a failure that
recurs at the step where the previous launch failed (a bad sample): those stop at once
with the job's own message and exit code. The code is the ranks' own, noted beside the
heartbeat (:func:`ringnet.shutdown.note_exit`), where srun reports another (137 for the
task it killed after a rank's MPI_Abort). At each relaunch it says what was lost (the
steps since the last checkpoint) and why.

SIGTERM or SIGUSR1 (a time limit, scancel, SLURM's ``--signal``) is passed on to the job
(to srun as SIGUSR1: srun ends a step on SIGTERM):
its ranks stop at the next step boundary, write the checkpoint and exit 75, and the
launcher exits 75 without a relaunch (a requeued job's ``--resume auto`` continues).
Ctrl-C stops the job without a relaunch: the launcher passes it on to the job once
(the job runs in a process group of its own), the job's rank 0 prints
``ringnet: error: interrupted`` and the launcher exits 130. SIGHUP stops the job with
SIGTERM, also without a relaunch.

The job reports its progress through ``$RINGNET_HEARTBEAT`` (see ``ringnet.autosave``);
with ``--stall-timeout S`` a job whose step count has not moved for S seconds is
stopped and relaunched like one that lost a rank.
"""
if __name__ == "__main__":     # the program: note stop signals from its first line
    from ringnet.early_signals import hold
    hold()

import argparse
import dataclasses
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

from ringnet import early_signals
from ringnet.autosave import HEARTBEAT_ENV, read_heartbeat
from ringnet.checkpoint import stored_step as checkpoint_step
from ringnet.errors import EXIT_DIVERGED, EXIT_INTERRUPTED, EXIT_STOPPED, EXIT_USAGE, UsageError
from ringnet.cli import ArgumentParser
from ringnet.attempt import Attempt, pump
from ringnet.hosts import JobNodes, slurm_tasks_alive
from ringnet.shutdown import noted_exit
from ringnet.placement import allocation_tasks_per_node

__all__ = ["main", "relaunch_size", "Attempt", "Launcher", "slurm_tasks_alive"]

PROG = "python -m ringnet.launch"
# Rank 0's step count when a job ends on one rank's error at step s lies in [s - 1, s + 1]
# (the other ranks run on until the abort reaches them), so two failures whose counts
# differ by at most this are taken for the same failure.
SAME_STEP = 2
INTERRUPTED_LINE = "ringnet: error: interrupted"    # what the job prints after Ctrl-C
# After passing Ctrl-C on, wait this long for the job to end by itself before stopping it.
INTERRUPT_GRACE_S = 30.0
# After passing SIGTERM/SIGUSR1 on, the job may take its deadline plus this to save and end.
STOP_GRACE_S = 60.0


def _say(text):
    print(f"ringnet.launch: {text}", file=sys.stderr, flush=True)


class Terminated(KeyboardInterrupt):
    """SIGTERM (scancel, kill, a time limit), SIGUSR1 (SLURM's --signal) or SIGHUP (the
    terminal closed) reached the launcher."""

    def __init__(self, signum=signal.SIGTERM):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


# -- which rank count a relaunch uses --------------------------------------------------
def relaunch_size(previous, batch_size, min_ranks=1, shrink=False, available=None,
                  usable=lambda n: True):
    """Return the rank count of the next launch, or None when no count qualifies.

    The largest ``n`` with ``min_ranks <= n <= cap`` that divides ``batch_size`` and that
    ``usable(n)`` accepts; ``cap`` is ``previous`` (``previous - 1`` with ``shrink``),
    and at most ``available`` (the tasks a SLURM allocation still has) when given.
    """
    cap = previous - 1 if shrink else previous
    if available is not None:
        cap = min(cap, available)
    for n in range(cap, max(1, min_ranks) - 1, -1):
        if batch_size % n == 0 and usable(n):
            return n
    return None


class Launcher:
    """Run ``python -m ringnet.train`` under ``launch_cmd`` and relaunch it; see the module docstring."""

    def __init__(self, ranks, train_args, *, launch_cmd, batch_size, checkpoint=None,
                 resume=None, min_ranks=1, max_restarts=3, shrink=False, stall_timeout=0.0,
                 usable=lambda n: True, available=lambda: None, python=sys.executable,
                 env=None, nodes=None):
        self.ranks = ranks
        self.train_args = list(train_args)
        self.launch_cmd = list(launch_cmd)
        self.batch_size = batch_size
        self.checkpoint = checkpoint
        self.resume = resume
        self.min_ranks = min_ranks
        self.max_restarts = max_restarts
        self.shrink = shrink
        self.stall_timeout = stall_timeout
        self.usable = usable
        self.available = available
        self.python = python
        self.env = dict(os.environ if env is None else env)
        self.attempts = []
        self._initial = _file_id(checkpoint)
        self.nodes = nodes                      # JobNodes, or None (one node, or not known)
        self.placed = list(nodes.names) if nodes else None     # the nodes launches use now

    # -- commands ---------------------------------------------------------------------
    def command(self, ranks, resume):
        """Return the command line that starts the job on ``ranks`` ranks."""
        launcher = self.launch_cmd
        if self.nodes is not None and self.placed != self.nodes.names:
            launcher = self.nodes.on(self.placed)
        name = os.path.basename(launcher[0])
        if name == "srun":
            count = [f"--ntasks={ranks}", "--kill-on-bad-exit=1"]
        else:
            count = ["-np", str(ranks)]
        extra = ["--resume", resume] if resume else []
        return [*launcher, *count, self.python, "-m", "ringnet.train",
                *self.train_args, *extra]

    def _checkpoint_step(self):
        """Return the step of the checkpoint this launcher's jobs wrote, or None."""
        if not self.checkpoint or _file_id(self.checkpoint) in (None, self._initial):
            return None
        return checkpoint_step(self.checkpoint)

    # -- the loop ---------------------------------------------------------------------
    def run(self):
        """Run the job until it succeeds or must not be relaunched; return its exit code."""
        ranks, resume = self.ranks, self.resume
        resume_step = self._resume_step(resume)
        with tempfile.TemporaryDirectory(prefix="ringnet-launch-") as tmp:
            while True:
                attempt = Attempt(ranks, self.command(ranks, resume), resume_step)
                self.attempts.append(attempt)
                self._run_one(attempt, os.path.join(tmp, f"heartbeat-{len(self.attempts)}"))
                if len(self.attempts) > 1:
                    self._report_relaunch_time(attempt)
                code = attempt.returncode
                if code == 0:
                    if len(self.attempts) > 1:
                        self._summary()
                    return 0
                if code == EXIT_STOPPED:
                    where = f" at step {attempt.reached}" if attempt.reached is not None else ""
                    _say(f"the job stopped on {attempt.interrupted or 'a signal'}{where} with its "
                         f"checkpoint written (exit {EXIT_STOPPED}): not relaunching")
                    return code
                if attempt.interrupted:
                    # After Ctrl-C the job's rank 0 said "interrupted" itself; one line is enough.
                    if not any(line.strip() == INTERRUPTED_LINE for line in attempt.errors):
                        _say("interrupted: the job was stopped, not relaunching")
                    return EXIT_INTERRUPTED if attempt.interrupted == "SIGINT" else code or 130
                if code == EXIT_USAGE:
                    _say("the job stopped on bad input (exit 2): not relaunching")
                    return code
                if code == EXIT_DIVERGED:
                    _say("the training diverged (exit 3); a relaunch from the same checkpoint "
                         "would diverge again: not relaunching")
                    return code
                saved = self._checkpoint_step()
                if saved is not None:
                    resume, resume_step = self.checkpoint, saved
                lost = (attempt.reached - resume_step
                        if attempt.reached is not None and resume_step is not None else None)
                attempt.lost = lost
                previous = self.attempts[-2] if len(self.attempts) > 1 else None
                if (previous is not None and previous.reached is not None
                        and attempt.reached is not None
                        and abs(attempt.reached - previous.reached) <= SAME_STEP):
                    _say(f"the job failed again at step {attempt.reached}, where the previous "
                         f"launch failed ({attempt.reason()}): the failure repeats, not relaunching")
                    return code
                restarts = len(self.attempts) - 1
                if restarts >= self.max_restarts:
                    _say(f"the job failed ({attempt.reason()}) after {restarts} relaunch(es): "
                         f"--max-restarts {self.max_restarts} reached, giving up")
                    return code
                available = self.available()
                if self.nodes is not None:
                    answering = self._probe_nodes()
                    if not answering:
                        _say(f"the job failed ({attempt.reason()}) and no node of the job "
                             "answers: not relaunching")
                        return code
                    on_nodes = len(answering) * self.nodes.per_node
                    available = on_nodes if available is None else min(available, on_nodes)
                new_ranks = relaunch_size(ranks, self.batch_size, self.min_ranks, self.shrink,
                                          available, self.usable)
                if new_ranks is None:
                    cap = ranks - 1 if self.shrink else ranks
                    cap = cap if available is None else min(cap, available)
                    _say(f"the job failed ({attempt.reason()}); no rank count from "
                         f"{self.min_ranks} to {cap} divides the global batch {self.batch_size}"
                         f"{'' if available is None else f' ({available} tasks left)'}: "
                         "not relaunching")
                    return code
                where = (f"at step {attempt.reached}" if attempt.reached is not None
                         else "before its first step")
                origin = (f"checkpoint {resume} (step {resume_step})" if resume
                          else "the start (no checkpoint yet" + ("" if self.checkpoint else
                                ": pass --save PATH.h5 --save-every K") + ")")
                lost_text = f"{lost} step(s) lost" if lost is not None else "steps lost unknown"
                on = (f" on node(s) {', '.join(self.placed)}"
                      if self.nodes is not None and self.placed != self.nodes.names else "")
                _say(f"the job on {ranks} rank(s) failed {where}: {attempt.reason()}. "
                     f"{lost_text}; relaunch {restarts + 1} of {self.max_restarts} on "
                     f"{new_ranks} rank(s){on} from {origin}")
                ranks = new_ranks

    def _probe_nodes(self):
        """After a failure: run one task on each node the failed launch used; leave out
        those that do not answer (saying why). Return the answering nodes."""
        answering, why = self.nodes.probe(self.placed)
        for node in self.placed:
            if node in why:
                _say(f"node {node} does not answer ({why[node]}): relaunching without it")
        self.placed = answering
        return answering

    @staticmethod
    def _resume_step(resume):
        return checkpoint_step(resume) if resume else 0

    def _run_one(self, attempt, heartbeat):
        env = dict(self.env, **{HEARTBEAT_ENV: heartbeat})
        attempt.started = time.monotonic()
        try:
            # The job runs in a process group of its own, so that a terminal's Ctrl-C
            # reaches it once, passed on by this launcher, and not also directly: MPICH's
            # mpirun takes a second Ctrl-C for "kill everything now". No stdin: a process
            # group that is not the terminal's foreground would be stopped reading it.
            proc = subprocess.Popen(attempt.command, stdin=subprocess.DEVNULL,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    bufsize=0, env=env, **_OWN_PROCESS_GROUP)
        except OSError as exc:
            raise UsageError(f"cannot start {attempt.command[0]}: {exc.strerror}") from None
        pumps = [threading.Thread(target=pump, args=(proc.stdout, _binary(sys.stdout), attempt.errors), daemon=True),
                 threading.Thread(target=pump, args=(proc.stderr, _binary(sys.stderr), attempt.errors), daemon=True)]
        for thread in pumps:
            thread.start()
        last, moved = None, time.monotonic()
        try:
            while True:
                try:
                    proc.wait(timeout=0.1)
                    break
                except subprocess.TimeoutExpired:
                    pass
                step = read_heartbeat(heartbeat)
                now = time.monotonic()
                if step != last:
                    last, moved = step, now
                    if (attempt.first_step_at is None and step is not None
                            and attempt.resume_step is not None and step > attempt.resume_step):
                        attempt.first_step_at = now
                elif (self.stall_timeout and last is not None
                      and now - moved > self.stall_timeout):
                    attempt.stalled = self.stall_timeout
                    _stop(proc)
                    break
        except Terminated as exc:
            attempt.interrupted = signal.Signals(exc.signum).name
            if exc.signum == signal.SIGHUP:
                _stop(proc)
            else:
                self._stop_gracefully(proc, exc.signum)
        except KeyboardInterrupt:
            attempt.interrupted = "SIGINT"
            self._interrupt(proc)
        for thread in pumps:
            thread.join(timeout=10)
        attempt.returncode = proc.returncode
        # the ranks' own verdict where it forbids a relaunch (bad input, divergence, a
        # stop), whatever srun made of their exit codes (137 after one rank's MPI_Abort)
        noted = noted_exit(heartbeat)
        if noted in (EXIT_USAGE, EXIT_DIVERGED, EXIT_STOPPED) and proc.returncode not in (0, noted):
            attempt.launcher_code, attempt.returncode = proc.returncode, noted
        attempt.reached = read_heartbeat(heartbeat)
        attempt.ended = time.monotonic()

    @staticmethod
    def _stop_gracefully(proc, signum):
        """Pass SIGTERM or SIGUSR1 on to the job: the ranks stop at the next step boundary,
        write their checkpoint and exit 75. mpirun sends either to every rank; srun sends
        SIGUSR1 on, but on SIGTERM ends the step itself (SIGKILL after SLURM's KillWait), so
        it is given SIGUSR1, which the ranks take for the same stop. Wait for that up to the
        job's deadline plus STOP_GRACE_S, then stop it."""
        from ringnet.control import default_timeout
        try:
            limit = default_timeout() + STOP_GRACE_S
        except ValueError:
            limit = 300.0 + STOP_GRACE_S
        end = time.monotonic() + limit
        if os.path.basename(proc.args[0]) == "srun":
            signum = signal.SIGUSR1
        if proc.poll() is None:
            proc.send_signal(signum)
        while proc.poll() is None and time.monotonic() < end:
            try:
                time.sleep(0.05)
            except Terminated:      # a second signal: the ranks note it and go on saving
                continue
        _stop(proc)

    @staticmethod
    def _interrupt(proc):
        """Pass Ctrl-C on to the job and wait for it to end: mpirun gives each rank SIGINT,
        the ranks end themselves and rank 0 says so. srun takes one SIGINT for a status
        report, so it is stopped as on SIGTERM. Another Ctrl-C is passed on too (mpirun
        then kills the ranks at once); a job still running after INTERRUPT_GRACE_S is stopped."""
        if os.path.basename(proc.args[0]) == "srun":
            _stop(proc)
            return
        end = time.monotonic() + INTERRUPT_GRACE_S
        while True:
            try:
                if proc.poll() is None:
                    proc.send_signal(signal.SIGINT)
                while proc.poll() is None and time.monotonic() < end:
                    time.sleep(0.05)
                break
            except Terminated:
                break
            except KeyboardInterrupt:
                continue
        _stop(proc)

    def _report_relaunch_time(self, attempt):
        previous = self.attempts[-2]
        if attempt.first_step_at is not None:
            attempt.relaunch_s = attempt.first_step_at - previous.ended
            _say(f"training again on {attempt.ranks} rank(s) {attempt.relaunch_s:.1f} s after "
                 f"the failure")

    def _summary(self):
        failed = self.attempts[:-1]
        lost = [a.lost for a in failed if a.lost is not None]
        times = [a.relaunch_s for a in self.attempts[1:] if a.relaunch_s is not None]
        text = f"done after {len(failed)} relaunch(es)"
        if lost:
            text += f": {sum(lost)} step(s) lost in all"
        if times:
            text += f", {sum(times) / len(times):.1f} s from a failure to training again (mean)"
        _say(text)


def _own_group_tied_to_us():
    """In the job's process, before it runs mpirun/srun: a process group of its own, and on
    Linux SIGTERM when this launcher dies (even by SIGKILL), so the job stops gracefully
    (checkpoint written, exit 75) instead of training on with nobody watching."""
    os.setpgrp()
    if sys.platform.startswith("linux"):
        try:
            import ctypes
            ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM))  # PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            pass


# Popen arguments that start the job in a new process group tied to this launcher.
_OWN_PROCESS_GROUP = {"preexec_fn": _own_group_tied_to_us}


def _binary(stream):
    stream.flush()
    return getattr(stream, "buffer", stream)


def _checkpoint_attr(path, name):
    """Return attribute ``name`` of checkpoint ``path`` (read without its tensors), or None."""
    import h5py
    try:
        with h5py.File(path, "r") as f:
            return f.attrs[name].item() if hasattr(f.attrs[name], "item") else f.attrs[name]
    except (OSError, KeyError, ValueError, TypeError):
        return None


def _file_id(path):
    """Return what tells a rewritten file from the old one (inode, size, mtime), or None."""
    try:
        st = os.stat(path)
    except (OSError, TypeError):
        return None
    return (st.st_ino, st.st_size, st.st_mtime_ns)


def _stop(proc, grace=10):
    """Ask the job to stop (SIGTERM to mpirun/srun, which pass it on), then kill it."""
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


# -- command line -------------------------------------------------------------------------
def build_parser():
    """Return the argument parser of ``python -m ringnet.launch`` (training flags follow ``--``)."""
    p = ArgumentParser(
        prog=PROG,
        usage=f"{PROG} -n N [--min-ranks M] [--max-restarts R] [--shrink] "
              "[--stall-timeout S] [--launcher CMD] -- <python -m ringnet.train flags>",
        description="Run python -m ringnet.train on N ranks and relaunch it from its newest "
                    "checkpoint (--save, written every --save-every K steps) when a rank dies "
                    "or stalls; when a node no longer answers, on the nodes that do. Inside a "
                    "SLURM allocation the job runs under srun.",
        epilog="Example:\n"
               f"  {PROG} -n 4 --shrink -- --mode ring --steps 2000 --save ck.h5 --save-every 100\n",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-n", "--np", dest="ranks", type=int, required=True, metavar="N",
                   help="ranks of the first launch")
    p.add_argument("--min-ranks", type=int, default=1, metavar="M",
                   help="never relaunch on fewer than M ranks (default 1)")
    p.add_argument("--max-restarts", type=int, default=3, metavar="R",
                   help="relaunch at most R times (default 3; 0: run once)")
    p.add_argument("--shrink", action="store_true",
                   help="relaunch on one rank fewer than the failed launch (default: the same "
                        "count, for transient failures)")
    p.add_argument("--stall-timeout", type=float, default=0.0, metavar="S",
                   help="stop and relaunch a job whose step count has not moved for S seconds "
                        "(default 0: off; the job's own transfer deadline RINGNET_COMM_TIMEOUT "
                        "still ends a stalled job)")
    p.add_argument("--launcher", default=None, metavar="CMD",
                   help="command that starts the ranks, e.g. 'srun --mpi=pmix' or 'mpiexec "
                        "-hosts a,b' (the rank count is added: -np N, or --ntasks=N for srun); "
                        "default srun inside a SLURM allocation, else $MPIRUN or mpirun")
    return p


def _split(argv):
    if "--" in argv:
        cut = argv.index("--")
        return argv[:cut], argv[cut + 1:]
    return argv, []


def _default_launcher(env):
    if env.get("SLURM_JOB_ID") and shutil.which("srun"):
        return ["srun"]
    return [env.get("MPIRUN") or "mpirun"]


def _pins(cfg, ranks):
    """Return (flags that fix mode, delay and global batch across relaunches, batch size)."""
    resolved = cfg.resolved(ranks)
    batch = cfg.batch_size
    if batch is None and cfg.resume:            # a resumed run keeps the checkpoint's batch
        batch = _checkpoint_attr(cfg.resume, "batch_size")
    batch = int(batch) if batch else resolved.batch_size
    flags = ["--mode", resolved.mode, "--delay", str(resolved.delay), "--batch-size", str(batch)]
    return flags, batch, resolved


def main(argv=None):
    """Entry point of ``python -m ringnet.launch``."""
    from ringnet.config import config_from_args
    argv = list(sys.argv[1:] if argv is None else argv)
    own, train_args = _split(argv)
    parser = build_parser()
    if "--" in argv:
        args = parser.parse_args(own)
    else:
        args, train_args = parser.parse_known_args(own)
    if args.ranks < 1:
        raise UsageError(f"-n must be at least 1, got {args.ranks}")
    if args.min_ranks < 1 or args.min_ranks > args.ranks:
        raise UsageError(f"--min-ranks must be between 1 and -n {args.ranks}, got {args.min_ranks}")
    if args.max_restarts < 0:
        raise UsageError(f"--max-restarts must be >= 0, got {args.max_restarts}")
    if not args.stall_timeout >= 0:
        raise UsageError(f"--stall-timeout must be >= 0 seconds, got {args.stall_timeout}")
    cfg = config_from_args(train_args)      # the job's own message for a bad training flag
    if cfg.resume == "auto":                # the job decides the same way at its start
        cfg = dataclasses.replace(cfg, resume=cfg.save if cfg.save and os.path.exists(cfg.save)
                                  else None)
    pins, batch, resolved = _pins(cfg, args.ranks)

    pinned = dataclasses.replace(cfg, mode=resolved.mode, delay=resolved.delay, batch_size=batch)

    def usable(n):
        try:
            pinned.resolved(n)
            return True
        except UsageError:
            return False

    env = os.environ
    launch_cmd = shlex.split(args.launcher) if args.launcher else _default_launcher(env)
    if not launch_cmd or shutil.which(launch_cmd[0]) is None:
        raise UsageError(f"launcher {launch_cmd[0] if launch_cmd else args.launcher!r} not found: "
                         "pip install mpich (or load your MPI), or pass --launcher CMD")
    available = lambda: None     # noqa: E731
    if os.path.basename(launch_cmd[0]) == "srun" and env.get("SLURM_JOB_ID"):
        per_node = allocation_tasks_per_node(env)
        if per_node:
            available = lambda: slurm_tasks_alive(env["SLURM_JOB_ID"], per_node)  # noqa: E731
    def terminated(signum, frame):  # SIGTERM, SIGUSR1: a graceful stop; SIGHUP: stop; no relaunch
        raise Terminated(signum)
    for signum in (signal.SIGTERM, signal.SIGUSR1, signal.SIGHUP):
        signal.signal(signum, terminated)
    early = early_signals.take()
    if early is not None:       # stopped before the job started: no step taken, nothing to save
        print(f"ringnet.launch: stopped by {early} before the job started: no step taken, "
              "nothing to save; the same command starts it", file=sys.stderr, flush=True)
        return EXIT_STOPPED
    launcher = Launcher(args.ranks, [*train_args, *pins], launch_cmd=launch_cmd, batch_size=batch,
                        checkpoint=cfg.save, resume=cfg.resume, min_ranks=args.min_ranks,
                        max_restarts=args.max_restarts, shrink=args.shrink,
                        stall_timeout=args.stall_timeout, usable=usable, available=available,
                        nodes=JobNodes.of(launch_cmd, args.ranks, env))
    return launcher.run()


if __name__ == "__main__":
    try:
        code = main()
    except UsageError as exc:
        print(f"ringnet: error: {exc}", file=sys.stderr, flush=True)
        code = EXIT_USAGE
    except KeyboardInterrupt:
        code = EXIT_INTERRUPTED
    except Terminated:          # a stop signal between the job's end and here
        code = EXIT_STOPPED
    early_signals.hold()        # the exit code stands, whatever signal comes while exiting
    early_signals.settle()
    sys.exit(code)
