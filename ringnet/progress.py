"""Training progress on rank 0: a tqdm bar in a terminal, plain lines in a job log; and
the --json summary, printed or written to a file.

Without a terminal (a SLURM job, output piped to a file) a bar would be noise, so
:class:`Progress` prints one line at the end of every epoch and, on long epochs, one
every ``RINGNET_PROGRESS_SECONDS`` (default 60) seconds::

    step 120/440  epoch 5.45  loss 0.4123 (rank 0, mean of last 20 steps)  2510 images/s  ETA 0:00:31

(``epoch`` counts epochs done; ``loss`` is the mean training loss of the steps since the
previous line, as the label says: on one rank that rank's, under several ranks rank 0's
alone (its share of the global batch), so it is not the epoch line's mean over every rank
of the whole epoch; ``images/s`` is the global rate since the previous line.) The bar shows
the loss of the last step (rank 0's), labelled the same way.
"""
import json
import os
import sys
import time

__all__ = ["Progress", "progress_interval", "print_summary", "write_summary", "write_json"]


def progress_interval(environ=None):
    """Return the seconds between progress lines: ``RINGNET_PROGRESS_SECONDS`` or 60."""
    environ = os.environ if environ is None else environ
    text = environ.get("RINGNET_PROGRESS_SECONDS", "")
    if not text:
        return 60.0
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value >= 0:
        from ringnet.errors import UsageError
        raise UsageError(f"RINGNET_PROGRESS_SECONDS={text!r} is not a number of seconds >= 0")
    return value


def _clock(seconds):
    seconds = int(round(seconds))
    return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


class Progress:
    """Report steps done out of ``total``; a bar when ``interactive``, else lines to ``file``."""

    def __init__(self, total, initial, batch_size, steps_per_epoch, interactive,
                 interval=None, file=None, clock=time.perf_counter, ranks=1):
        self.total, self.batch_size, self.steps_per_epoch = total, batch_size, steps_per_epoch
        self.ranks = ranks      # more than one: the losses are rank 0's, and the line says so
        self.file = file or sys.stderr
        self.interval = progress_interval() if interval is None else interval
        self.clock = clock
        self.bar = None
        if interactive:
            from tqdm import tqdm
            self.bar = tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True,
                            leave=False, file=self.file)
        self.start_step = self.mark_step = initial
        self.start_time = self.mark_time = clock()
        self.losses = []

    def update(self, step, loss):
        """Record that ``step`` steps are done, the last one with training loss ``loss``."""
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix({"epoch": (step - 1) // self.steps_per_epoch + 1,  # 1-based, running
                                  f"loss ({self.loss_label(1)})": f"{loss:.4f}"}, refresh=False)
            return
        self.losses.append(loss)
        now = self.clock()
        if step % self.steps_per_epoch == 0 or step >= self.total \
                or now - self.mark_time >= self.interval:
            self._line(step, now)

    def _line(self, step, now):
        steps = step - self.mark_step
        rate = steps * self.batch_size / (now - self.mark_time) if now > self.mark_time else 0.0
        per_step = (now - self.start_time) / max(1, step - self.start_step)
        eta = _clock(per_step * (self.total - step))
        loss = sum(self.losses) / len(self.losses)
        # One write of the whole line, newline included: print() writes the text and its
        # newline apart, and a Ctrl-C between the two left the line open, so that the
        # interrupted() line of the rank's exit was joined to it ("step 3/... ringnet: error:
        # interrupted") and, under ringnet.launch, not recognised as the job's own.
        self.file.write(f"step {step}/{self.total}  epoch {step / self.steps_per_epoch:.2f}  "
                        f"loss {loss:.4f} ({self.loss_label(len(self.losses))})  "
                        f"{rate:.0f} images/s  ETA {eta}\n")
        self.file.flush()
        self.mark_step, self.mark_time, self.losses = step, now, []

    def loss_label(self, steps):
        """What a line's loss over ``steps`` steps is: 'mean of last 20 steps', 'last step',
        with 'rank 0, ' before it under several ranks."""
        what = "last step" if steps == 1 else f"mean of last {steps} steps"
        return f"rank 0, {what}" if self.ranks > 1 else what

    def close(self):
        if self.bar is not None:
            self.bar.close()


# Launchers whose ranks' stderr is a pipe to them: a person watches when theirs is a terminal.
_LAUNCHERS = ("mpiexec", "mpirun", "orterun", "prterun", "prte")


def _launcher_on_a_terminal(pid=None, depth=4):
    """Whether the MPI launcher that started this process (an ancestor on this node, at
    most ``depth`` generations up: mpiexec, then its proxy) writes its stderr to a terminal."""
    pid = os.getppid() if pid is None else pid
    for _ in range(depth):
        try:
            with open(f"/proc/{pid}/comm") as f:
                name = f.read().strip()
            if name.startswith(_LAUNCHERS):
                return os.readlink(f"/proc/{pid}/fd/2").startswith(("/dev/pts/", "/dev/tty"))
            with open(f"/proc/{pid}/stat") as f:
                pid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            return False
        if pid <= 1:
            return False
    return False


def interactive():
    """Return True when a person watches: stderr is a terminal, or (under mpirun, where
    stderr is a pipe to the launcher, which Hydra starts in a session without a terminal)
    the process still has a controlling terminal or its launcher writes to one."""
    if sys.stderr.isatty():
        return True
    try:
        with open("/dev/tty", "rb"):
            return True
    except OSError:
        pass
    return _launcher_on_a_terminal()


def print_summary(summary):
    """Print the --json summary line on stdout after every other line of this run (rank 0)."""
    from ringnet.shutdown import wait_until_read
    sys.stderr.flush()
    wait_until_read((sys.stderr.fileno(),), 2.0)
    print(json.dumps(summary), flush=True)


def write_summary(path, summary):
    """Write the --json summary to ``path`` whole, one line (--json-file, rank 0)."""
    write_json(path, summary, "--json-file", end="\n")


def write_json(path, document, what, end="", **dump):
    """Write ``document`` as JSON (``json.dump`` options ``dump``, then ``end``) to ``path``
    whole: into a file beside it, then renamed, so a reader finds the old file or the new
    one, never a part; missing folders are made. SetupError names ``what`` when the file
    system refuses, and no temporary file is left."""
    from ringnet.errors import SetupError
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(tmp, "w") as f:
            json.dump(document, f, **dump)
            f.write(end)
        os.replace(tmp, path)
    except OSError as exc:
        raise SetupError(f"cannot write {what} {path} ({exc})") from None
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
