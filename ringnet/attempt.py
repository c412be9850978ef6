"""One launch of a training job as ``python -m ringnet.launch`` runs it: its command, exit
code and last step, and the lines of its output that say why it ended (:class:`Attempt`),
copied through as they come by :func:`pump`."""
import collections
import os
import re

__all__ = ["Attempt", "EXPLAINS", "pump"]


class Attempt:
    """One run of the job: its command, exit code, last step, and the lines that explain a failure."""

    def __init__(self, ranks, command, resume_step):
        self.ranks = ranks
        self.command = command
        self.resume_step = resume_step       # step the job starts from
        self.returncode = None               # the ranks' own, where they noted one (see shutdown.note_exit)
        self.launcher_code = None            # the launcher's code, where it differed
        self.reached = None                  # steps finished when it ended (heartbeat)
        self.stalled = False
        self.interrupted = False
        self.started = None
        self.ended = None
        self.first_step_at = None            # when the first new step was finished
        self.lost = None                     # steps finished after the checkpoint resumed from
        self.relaunch_s = None               # seconds from the previous failure to a new step
        self.errors = collections.deque(maxlen=20)   # job lines that explain a failure

    def reason(self):
        """Say in a few words why the job ended: a killed process first, then the job's error."""
        if self.stalled:
            return f"no step finished for {self.stalled:g} s (a rank stalled)"
        for line in self.errors:
            match = (re.search(r"EXIT STRING: (.*signal.*)", line)
                     or re.search(r"srun: error: .*(task \d+: .*)", line))
            if match:
                return f"a rank ended: {match.group(1).strip()}"
        for line in reversed(self.errors):
            if "ringnet: error:" in line:
                return line.strip()
        code = self.returncode
        if code is not None and code < 0:
            return f"killed by signal {-code}"
        if code is not None and code > 128:
            return f"a rank was killed by signal {code - 128} (exit {code})"
        return f"exit code {code}"


EXPLAINS = re.compile(r"error|EXIT STRING|killed|signal|MPI_Abort", re.IGNORECASE)


def pump(stream, out, keep):
    """Copy the job's output to ``out`` as it comes (progress bars too); keep the lines that
    explain a failure."""
    partial = b""
    while True:
        chunk = os.read(stream.fileno(), 65536)
        if not chunk:
            break
        out.write(chunk)
        out.flush()
        lines = re.split(rb"[\r\n]", partial + chunk)
        partial = lines.pop()[-4096:]
        for line in lines:
            text = line.decode(errors="replace")
            if EXPLAINS.search(text):
                keep.append(text)
    stream.close()
