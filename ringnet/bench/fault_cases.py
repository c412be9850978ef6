"""The cases of ``python -m ringnet.bench faults``: each fault, how its run starts and what
must come out of it (the harness that runs them is :mod:`ringnet.bench.faults`)."""
import dataclasses
import os
import random
import re

from ringnet.errors import EXIT_STOPPED
from ringnet.parallel import distributed_modes

__all__ = ["Case", "Outcome", "MODES", "STOP_PHASES", "KILL_PHASES", "TRAIN", "DEFAULT_TIMEOUT",
           "all_cases", "quick_cases", "stop_case", "kill_case", "term_case", "mpmd_cases",
           "knob_cases", "bad_cases", "live_cases", "signal_cases", "collision_cases",
           "resume_cases", "concurrent_cases"]

MODES = tuple(distributed_modes())     # every mode that runs on several ranks
STOP_PHASES = ("setup", "step 3", "evaluation", "save", "save-write", "statistics", "shutdown")
KILL_PHASES = ("setup", "step 3", "evaluation", "save-write")
TRAIN = ["-m", "ringnet.train", "--steps", "6", "--batch-size", "16", "--no-eval",
         "--no-progress"]
DEFAULT_TIMEOUT = 8.0


@dataclasses.dataclass
class Case:
    """One fault: how to start the run, and what must come out of it."""
    name: str
    kind: str                   # stop, kill, mpmd, bad
    ranks: int = 1
    mode: str = None
    fault: str = None           # RINGNET_FAULT value
    args: tuple = ()            # extra train flags (``{dir}`` is the prepared files' folder)
    per_rank: tuple = None      # MPMD: one extra-flags tuple per rank
    env: dict = None
    code: int = None            # expected exit code (None: any non-zero)
    message: str = None         # regular expression the error line must match
    launcher_message: str = None    # ... or the launcher's output (kill cases)
    bound: str = "deadline"     # "deadline": 3 x timeout + startup; "quick": startup only
    command: tuple = None       # another command than train (datasets info)
    per_rank_env: tuple = None  # MPMD: one {variable: value} per rank
    trigger: str = None         # what the harness does once step 2 is reached (see TRIGGERS)
    at: float = None            # ... or this many seconds after the launch (signal cases)
    signal: str = None          # signal cases: TERM or USR1, sent to the launcher
    via: str = "mpirun"         # signal cases: the launcher, mpirun or ringnet.launch; srun
    #                             cases: ringnet.launch with --launcher 'srun --mpi=pmi2'
    forbid: str = None          # regular expression the output must not match


@dataclasses.dataclass
class Outcome:
    case: Case
    code: int
    seconds: float
    bound_s: float
    problems: list
    output: str

    @property
    def ok(self):
        return not self.problems


def _victim(phase, ranks):
    return 0 if phase.startswith("save") else ranks - 1


def _phase_re(phase):
    if phase.startswith("step"):
        return r"step \d+"
    return "save" if phase == "save-write" else re.escape(phase)


def stop_case(phase, ranks, mode):
    victim = _victim(phase, ranks)
    return Case(f"stop {phase} r{victim} {mode} N={ranks}", "stop", ranks, mode,
                fault=f"STOP:{phase}:{victim}", code=1,
                message=rf"^\[rank (?!{victim}\])\d+\] ringnet: error: rank {victim} did not "
                        rf"arrive at {_phase_re(phase)} within")


def kill_case(phase, ranks, mode):
    victim = _victim(phase, ranks)
    return Case(f"kill {phase} r{victim} {mode} N={ranks}", "kill", ranks, mode,
                fault=f"KILL:{phase}:{victim}", launcher_message=r"Killed \(signal 9\)",
                bound="quick")


def term_case(phase, ranks, mode):
    victim = _victim(phase, ranks)
    during = phase in ("setup", "step 3")       # else after the last step: the run is complete
    return Case(f"term {phase} r{victim} {mode} N={ranks}", "term", ranks, mode,
                fault=f"TERM:{phase}:{victim}", code=EXIT_STOPPED if during else 0,
                bound="quick")


KNOBS = (("RINGNET_BUCKET_BYTES", "0", "65536"), ("RINGNET_CPU_PROGRESS", "driven", "poll"),
         ("RINGNET_COMM_TIMEOUT", "8", "9"))


def knob_cases():
    return [Case(f"mpmd {name}", "mpmd", 2, "ring", per_rank=((), ()),
                 per_rank_env=({name: a}, {name: b}), code=2,
                 message=rf"^ringnet: error: ranks were started with different settings.*"
                         rf"{name} is '{re.escape(a)}' on rank 0 but '{re.escape(b)}' on rank\(s\) 1",
                 bound="quick") for name, a, b in KNOBS]


def live_cases():
    """Faults that come from outside the job while it runs: a full disk, the data file
    replaced, the launcher killed."""
    return [
        Case("disk full in a periodic save N=2", "disk", 2, "ring", fault="ENOSPC:save-write:0",
             args=("--save-every", "3"), code=2, bound="quick",
             message=r"^ringnet: error: rank 0: cannot write checkpoint \S*ck\.h5 "
                     r"\(\[Errno 28\] No space left on device\)"),
        Case("data file replaced, read from the file N=2", "replaced", 2, "ring",
             trigger="replace-data", env={"RINGNET_DATA_IN_MEMORY_MB": "0"},
             args=("--dataset", "{run}/live.h5", "--steps", "1000000", "--batch-size", "128"),
             code=2, bound="quick",
             message=r"ringnet: error: .*live\.h5 was replaced under the running job"),
        Case("data file replaced, held in memory N=2", "replaced", 2, "ring",
             trigger="replace-data", args=("--dataset", "{run}/live.h5", "--steps", "40",
                                           "--batch-size", "128"),
             code=0, bound="quick",
             launcher_message=r"note: data set file \S*live\.h5 was replaced on disk during the "
                              r"run; this run trains on the copy it read at the start"),
        Case("launcher killed N=2", "launcher", 2, "ring", trigger="kill-launcher",
             args=("--steps", "1000000"), code=None, bound="quick"),
    ]


def mpmd_cases():
    differ = [("--lr", "0.01", "0.02"), ("--seed", "0", "3"), ("--batch-size", "16", "32"),
              ("--steps", "6", "9"), ("--mode", "ring", "tree"), ("--delay", "0", "1"),
              ("--model", "digits", "lenet"), ("--dtype", "float32", "float64")]
    cases = []
    for flag, a, b in differ:
        cases.append(Case(f"mpmd {flag}", "mpmd", 2, None, per_rank=((flag, a), (flag, b)), code=2,
                          message=rf"^ringnet: error: ranks were started with different settings.*"
                                  rf"{re.escape(flag)} is '?{re.escape(a)}'? on rank 0 but "
                                  rf"'?{re.escape(b)}'? on rank\(s\) 1", bound="quick"))
    cases.append(Case("mpmd scrambled labels", "mpmd", 2, "ring",
                      per_rank=(("--dataset", "{dir}/digits.h5"), ("--dataset", "{dir}/scrambled.h5")),
                      code=2, message=r"data set content is sha256 \w+ on rank 0 but sha256 \w+ on "
                                      r"rank\(s\) 1", bound="quick"))
    return cases


def bad_cases():
    def bad(name, args, message, ranks=1, env=None, command=None):
        return Case(f"bad {name} N={ranks}", "bad", ranks, "ring" if ranks > 1 else None,
                    args=tuple(args), env=env, code=2, message="^ringnet: error: " + message,
                    bound="quick", command=command)
    return [
        bad("float NaN labels", ["--dataset", "{dir}/nan_labels.h5"], r".*labels must be integers", 2),
        bad("fractional labels", ["--dataset", "{dir}/fractional.h5"], r".*labels must be integers"),
        bad("classes not names", ["--dataset", "{dir}/classes_int.h5"],
            r".*attribute 'classes' must be a list of class names", 2),
        bad("group for data set", ["--dataset", "{dir}/group.h5"], r".*/train/labels must be a data set"),
        bad("not HDF5", ["--dataset", "{dir}/not_hdf5.h5"], r".*not a readable HDF5 file", 2),
        bad("truncated file", ["--dataset", "{dir}/truncated.h5"], r".*(not a readable HDF5|corrupt)"),
        bad("corrupt chunk (file-backed)", ["--dataset", "{dir}/corrupt_chunk.h5"],
            r".*(train/images|corrupt)", 2, env={"RINGNET_DATA_IN_MEMORY_MB": "0"}),
        bad("corrupt chunk: datasets info --verify", ["info", "--verify", "{dir}/corrupt_chunk.h5"],
            r".*/train/images \d+\.\.\d+ cannot be read", command=("-m", "ringnet.datasets")),
        bad("RINGNET_COMM_TIMEOUT=0", [], r"RINGNET_COMM_TIMEOUT='0' is not a positive", 2,
            env={"RINGNET_COMM_TIMEOUT": "0"}),
        bad("RINGNET_COMM_TIMEOUT=nan", [], r"RINGNET_COMM_TIMEOUT='nan' is not a positive",
            env={"RINGNET_COMM_TIMEOUT": "nan"}),
        bad("RINGNET_COMM_TIMEOUT=-1", [], r"RINGNET_COMM_TIMEOUT='-1' is not a positive",
            env={"RINGNET_COMM_TIMEOUT": "-1"}),
        bad("--lr inf", ["--lr", "inf"], r"--lr must be a finite number"),
        bad("--weight-decay nan", ["--weight-decay", "nan"], r"--weight-decay must be a finite number", 2),
        bad("--inter-link 0 MB/s", ["--inter-link", "100,0"], r"--inter-link 100,0: the microseconds "
            r"must be >= 0 and the MB/s > 0", 2),
        bad("resume non-finite", ["--resume", "{dir}/ck_nan.h5"], r".*holds 1 NaN or infinite", 2),
        bad("resume not a checkpoint", ["--resume", "{dir}/digits.h5"], r".*is not a ringnet checkpoint"),
        # Read first mid-run, by one rank: that rank speaks and the job is aborted.
        Case("bad late corrupt chunk (evaluation) N=2", "bad", 2, "ring",
             args=("--dataset", "{dir}/late_corrupt.h5"), env={"RINGNET_DATA_IN_MEMORY_MB": "0"},
             code=2, bound="quick",
             message=r"^\[rank 1\] ringnet: error: evaluation: \S*late_corrupt\.h5: /test/images "
                     r"\d+\.\.\d+ cannot be read, the file is corrupt"),
    ]


def signal_cases(seed=0, count=8):
    """SIGTERM or SIGUSR1 sent to the launcher (mpirun, or ringnet.launch) at a moment drawn
    at random in the run's first two seconds (one in each of ``count`` equal slots), as
    ``kill`` after starting a job would: from
    the imports on, every moment ends in the graceful stop (exit 75, the checkpoint written
    if a step was taken); the last two cases send the signal again once the stop's save is
    done, which still ends in 75. The moments come from ``seed``, so a rerun repeats them."""
    rng = random.Random(seed)
    cases = []
    for i in range(count):
        sig, via = ("TERM", "USR1")[i % 2], ("mpirun", "launch")[(i // 2) % 2]
        at = round((i + rng.random()) * 2.0 / count, 2)     # one in each 2/count s slot
        twice = i >= count - 2
        cases.append(Case(f"signal {sig}{' twice' if twice else ''} at {at:.2f} s via {via} N=2",
                          "signal", 2, "ring", args=("--steps", "1000000"), code=EXIT_STOPPED,
                          bound="quick", trigger="signal-twice" if twice else "signal", at=at,
                          signal=sig, via=via))
    return cases


def collision_cases():
    """Outputs that would destroy an input or each other, and outputs that are not regular
    files: refused before training, in one line naming both, the files left as they were."""
    def bad(name, args, message, ranks=2):
        return Case(f"collision {name} N={ranks}", "bad", ranks, "ring" if ranks > 1 else None,
                    args=tuple(args), code=2,
                    message=r"^ringnet: error: (rank \d+: )?" + message, bound="quick")
    cases = [
        bad("--save is --dataset", ["--dataset", "{run}/live.h5", "--save", "{run}/live.h5"],
            r"--dataset \S*live\.h5 and --save \S*live\.h5 are the same file: writing the "
            r"checkpoint would destroy the data set"),
        bad("--save is --dataset through --data-dir",
            ["--data-dir", "{run}", "--dataset", "live", "--save", "{run}/live.h5"],
            r"--dataset live \(\S*live\.h5\) and --save \S*live\.h5 are the same file"),
        bad("--json-file is --save", ["--json-file", "{run}/ck.h5"],
            r"--save \S*ck\.h5 and --json-file \S*ck\.h5 are the same file: the checkpoint and "
            r"the summary would overwrite each other", ranks=1),
        bad("--trace is --dataset", ["--dataset", "{run}/live.h5", "--trace", "{run}/live.h5"],
            r"--dataset \S*live\.h5 and --trace \S*live\.h5 are the same file: writing the "
            r"trace would destroy the data set"),
        bad("--save a FIFO", ["--save", "{dir}/fifo"],
            r"cannot write checkpoint \S*fifo \(--save\): it is a FIFO \(named pipe\), not a "
            r"regular file"),
        bad("--save ends in /", ["--save", "{run}/ck/notdir.h5/"],
            r"cannot write checkpoint \S*notdir\.h5/ \(--save\): it ends in '/'", ranks=1),
    ]
    if hasattr(os, "geteuid") and os.geteuid() == 0:       # mknod needs root
        cases.append(bad("--save a character device", ["--save", "{dir}/nul"],
                         r"cannot write checkpoint \S*nul \(--save\): it is a character "
                         r"device, not a regular file"))
    return cases


def resume_cases():
    """Ranks that resumed different checkpoints, or resumed on some ranks only: refused at
    start-up in one line naming each rank's path and step."""
    def mixed(name, first, second, message):
        return Case(f"resume {name}", "mpmd", 2, "ring", per_rank=(first, second), code=2,
                    message=r"^ringnet: error: ranks resumed different checkpoints: " + message,
                    bound="quick")
    return [
        mixed("same step, other content", ("--resume", "{dir}/ck.h5"),
              ("--resume", "{dir}/ck_other.h5"),
              r"rank 0 \S*ck\.h5 \(step 0, content \w+\); rank 1 \S*ck_other\.h5 \(step 0, "
              r"content \w+\)"),
        mixed("other steps", ("--resume", "{dir}/ck.h5"), ("--resume", "{dir}/ck_step3.h5"),
              r"rank 0 \S*ck\.h5 \(step 0\S*\); rank 1 \S*ck_step3\.h5 \(step 3\S*\)"),
        mixed("on one rank only", ("--resume", "{dir}/ck.h5"), (),
              r"rank 0 \S*ck\.h5 \(step 0\); rank 1 nothing"),
    ]


def concurrent_cases():
    """A second job with the same --save while the first runs: refused in one line naming the
    holder; the first goes on and stops gracefully (SIGTERM), its checkpoint its own."""
    return [Case("concurrent second job, same --save N=2", "concurrent", 2, "ring",
                 args=("--steps", "1000000"), code=EXIT_STOPPED, bound="quick",
                 trigger="second-job",
                 message=r"^ringnet: error: .*\S*ck\.h5 is in use by another run "
                         r"\(host \S+, process \d+; lock file \S+\)")]


SRUN = "srun --mpi=pmi2"
RELAUNCH = r"relaunch \d+ of \d+"


def srun_cases():
    """Under SLURM, ``ringnet.launch --launcher 'srun --mpi=pmi2'``: srun gives the other
    tasks of a job that one rank ended 137 (killed), whatever that rank's reason; the ranks
    note theirs beside the heartbeat, so the reason reaches the launcher: a usage or data
    error (2: a data set missing, or corrupt where one rank alone reads it), a divergence
    (3), a graceful stop (75) end the job with their code and are never relaunched; a rank
    killed is, once (--max-restarts 1)."""
    def srun(name, args, code, message=None, forbid=RELAUNCH, launcher_message=None, fault=None,
             trigger=None, env=None):
        return Case(f"srun {name} N=2", "srun", 2, "ring", args=tuple(args), code=code,
                    message=message, forbid=forbid, launcher_message=launcher_message,
                    fault=fault, trigger=trigger, env=env, via="srun", bound="quick")
    return [
        srun("diverged: exit 3", ["--model", "lenet", "--dataset", "synthetic", "--steps", "60",
                                  "--lr", "1e3", "--save-every", "1"], 3,
             message=r"^\[rank 0\] ringnet: error: loss is nan at step \d+ .*training diverged"),
        srun("missing data set: exit 2", ["--dataset", "{run}/missing.h5"], 2,
             message=r"^ringnet: error: .*missing\.h5"),
        srun("corrupt chunk read by rank 1 mid-run: exit 2", ["--dataset", "{dir}/late_corrupt.h5"],
             2, env={"RINGNET_DATA_IN_MEMORY_MB": "0"},
             message=r"^\[rank 1\] ringnet: error: evaluation: \S*late_corrupt\.h5: /test/images "
                     r"\d+\.\.\d+ cannot be read, the file is corrupt"),
        srun("SIGTERM to the launcher: exit 75", ["--steps", "1000000"], EXIT_STOPPED,
             trigger="terminate"),
        srun("a rank killed at step 3: relaunched", ["--save-every", "1"], None, forbid=None,
             fault="KILL:step 3:1", launcher_message=RELAUNCH),
    ]


def all_cases(slurm=False):
    """Return the full matrix: stop and kill at every phase, N = 2 and 4, every mode; MPMD; bad
    input; with ``slurm``, the cases under srun."""
    cases = []
    for ranks in (2, 4):
        for mode in MODES:
            cases += [stop_case(p, ranks, mode) for p in STOP_PHASES]
            cases += [kill_case(p, ranks, mode) for p in KILL_PHASES]
            cases += [term_case(p, ranks, mode) for p in STOP_PHASES]
    return (cases + mpmd_cases() + knob_cases() + bad_cases() + live_cases() + signal_cases()
            + collision_cases() + resume_cases() + concurrent_cases()
            + (srun_cases() if slurm else []))


def quick_cases(slurm=False):
    """Return the CI subset: every phase and mode once, both N, each kind (with ``slurm``,
    the srun cases too)."""
    picks = [stop_case("setup", 2, "ring"), stop_case("step 3", 4, "master"),
             stop_case("step 3", 2, "split-fc"), stop_case("evaluation", 4, "tree"),
             stop_case("save-write", 2, "ring"), stop_case("statistics", 2, "tree"),
             kill_case("step 3", 4, "ring"), kill_case("save-write", 2, "master")]
    picks += [term_case("setup", 2, "tree"), term_case("step 3", 4, "split-fc"),
              term_case("shutdown", 2, "ring")]
    mpmd = [c for c in mpmd_cases() if c.name in ("mpmd --lr", "mpmd --mode", "mpmd scrambled labels")]
    collisions = [c for c in collision_cases() if c.name.startswith("collision --save is --dataset N")]
    return (picks + mpmd + knob_cases()[:1] + bad_cases() + live_cases() + signal_cases()[-1:]
            + collisions + resume_cases()[-1:] + concurrent_cases()
            + (srun_cases() if slurm else []))
