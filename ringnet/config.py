"""Training configuration: one dataclass, filled from argparse, checked before any work."""
import argparse
import dataclasses
import math
import os
from dataclasses import dataclass
from typing import Optional

from ringnet import graphs
from ringnet.errors import TransportUnavailable, UsageError
from ringnet.cli import ArgumentParser
from ringnet.parallel import MODES, distributed_modes, hierarchical_modes
from ringnet.parallel.delayed_update import COMPENSATIONS, WARMUP_SPANS, lookahead_warmup

__all__ = ["TrainConfig", "MODES", "MODEL_DEFAULTS", "DEFAULTS", "build_parser", "config_from_args",
           "default_batch_size", "synopsis", "TRANSPORT_ADVICE", "transport_usage_error",
           "TRANSPORTS", "DEVICES"]

TRANSPORTS = ("auto", "mpi", "nccl")        # --transport
DEVICES = ("auto", "cpu", "gpu")            # --device

# Per-model defaults (learning rate, epochs, data set) for runs that do not set them.
MODEL_DEFAULTS = {
    "digits": {"lr": 0.01, "epochs": 20, "dataset": "digits"},
    "lenet": {"lr": 0.01, "epochs": 10, "dataset": "mnist"},
    "cifar10_quick": {"lr": 0.001, "epochs": 10, "dataset": "cifar10"},
    "carnet": {"lr": 0.01, "epochs": 10, "dataset": "synthetic"},
}

# Defaults of the optimisation settings. They are None in TrainConfig until resolved, so
# that a --resume can tell a flag given on the command line from one left out: left-out
# settings continue with the checkpoint's values, and only then with these.
DEFAULTS = {"batch_size": 64, "lr_policy": "fixed", "gamma": 0.1, "stepsize": 1000,
            "power": 0.75, "momentum": 0.9, "weight_decay": 5e-4, "seed": 0}


# The flags to change, by the reason a transport or device was refused
# (ringnet.errors.TransportUnavailable.reason).
TRANSPORT_ADVICE = {
    "cpu-device": "use --transport mpi (or auto)",
    "no-gpu": "use --device cpu (or auto)",
    "shared-gpu": "use --transport mpi or start at most one rank per GPU",
    "no-nccl": "use --transport mpi",
}


def transport_usage_error(exc: TransportUnavailable) -> UsageError:
    """Return the one-line command-line error for ``exc``: the library's words and the flag to change."""
    return UsageError(f"{exc}; {TRANSPORT_ADVICE[exc.reason]}")


def default_batch_size(world_size):
    """Return the multiple of ``world_size`` nearest to the default global batch (64)."""
    base = DEFAULTS["batch_size"]
    return max(world_size, int(base / world_size + 0.5) * world_size)


@dataclass
class TrainConfig:
    """Everything a training run needs; see ``python -m ringnet.train --help``."""
    model: str = None             # None: "digits", or the checkpoint's under --resume
    dataset: str = None
    mode: str = None
    delay: int = None
    delay_compensation: str = None
    warmup_steps: int = None      # None: lookahead_warmup(momentum) with lookahead, else 0
    epochs: int = None
    steps: int = None
    batch_size: int = None        # None: DEFAULTS, or the checkpoint's under --resume
    lr: float = None              # None: MODEL_DEFAULTS, or the checkpoint's under --resume
    lr_policy: str = None
    gamma: float = None
    stepsize: int = None
    power: float = None
    momentum: float = None
    weight_decay: float = None
    seed: int = None
    device: str = "auto"
    cuda_graphs: str = "auto"
    dtype: str = None             # None: float32, or the checkpoint's under --resume
    transport: str = "auto"
    topology: str = "auto"
    inter_link: Optional[str] = None
    shuffle: bool = None          # None: True, or the checkpoint's under --resume
    augment: bool = None          # None: False, or the checkpoint's under --resume
    save: str = None
    save_every: int = 0
    resume: str = None
    json: bool = False
    json_file: str = None
    check_every: int = 0
    eval_every_epoch: bool = True
    eval_every: int = 0
    data_dir: str = None
    synthetic_size: tuple = (2048, 512)
    progress: bool = True
    quiet: bool = False
    trace: str = None

    def resolved(self, world_size):
        """Return a copy with defaults filled in for ``world_size`` ranks; raise UsageError on bad values."""
        from ringnet.models import MODELS  # late: keeps --help fast
        cfg = dataclasses.replace(self)
        if cfg.model is None:
            cfg.model = "digits"
        if cfg.model not in MODELS:
            raise UsageError(f"unknown model {cfg.model!r}; choose one of {', '.join(sorted(MODELS))}")
        defaults = MODEL_DEFAULTS.get(cfg.model, {"lr": 0.01, "epochs": 10, "dataset": "synthetic"})
        if cfg.dataset is None:
            cfg.dataset = defaults["dataset"]
        for name, value in (("dtype", "float32"), ("shuffle", True), ("augment", False)):
            if getattr(cfg, name) is None:
                setattr(cfg, name, value)
        if cfg.mode is None:
            cfg.mode = "ring" if world_size > 1 else "single"
        if cfg.mode not in MODES:
            raise UsageError(f"unknown mode {cfg.mode!r}; choose one of {', '.join(MODES)}")
        mode = MODES[cfg.mode]
        if not mode.distributed and world_size > 1:
            raise UsageError(f"--mode {cfg.mode} runs on one process, but {world_size} ranks were "
                             f"started; use --mode {'|'.join(distributed_modes())} or run without "
                             "mpirun")
        _settle_delay(cfg, mode)
        if cfg.lr is None:
            cfg.lr = defaults["lr"]
        for name, value in DEFAULTS.items():
            if getattr(cfg, name) is None:
                setattr(cfg, name, default_batch_size(world_size) if name == "batch_size" else value)
        if cfg.epochs is None and cfg.steps is None:
            cfg.epochs = defaults["epochs"]
        if cfg.batch_size <= 0:
            raise UsageError(f"--batch-size must be positive, got {cfg.batch_size}")
        if cfg.epochs is not None and cfg.epochs <= 0:
            raise UsageError(f"--epochs must be positive, got {cfg.epochs}")
        if cfg.steps is not None and cfg.steps <= 0:
            raise UsageError(f"--steps must be positive, got {cfg.steps}")
        for flag, value in (("--lr", cfg.lr), ("--momentum", cfg.momentum),
                            ("--weight-decay", cfg.weight_decay), ("--gamma", cfg.gamma),
                            ("--power", cfg.power)):
            if not math.isfinite(value):
                raise UsageError(f"{flag} must be a finite number, got {value}")
        if not cfg.lr > 0:
            raise UsageError(f"--lr must be positive, got {cfg.lr}")
        if not 0 <= cfg.momentum < 1:
            raise UsageError(f"--momentum must be in [0, 1), got {cfg.momentum}")
        _settle_warmup(cfg)
        if cfg.weight_decay < 0:
            raise UsageError(f"--weight-decay must be >= 0, got {cfg.weight_decay}")
        if cfg.lr_policy not in ("fixed", "step", "inv"):
            raise UsageError(f"--lr-policy must be fixed, step or inv, got {cfg.lr_policy!r}")
        if cfg.dtype not in ("float32", "float64"):
            raise UsageError(f"--dtype must be float32 or float64, got {cfg.dtype!r}")
        if cfg.device not in ("auto", "cpu", "gpu"):
            raise UsageError(f"--device must be auto, cpu or gpu, got {cfg.device!r}")
        if cfg.cuda_graphs not in graphs.CHOICES:
            raise UsageError(f"--cuda-graphs must be auto, on or off, got {cfg.cuda_graphs!r}")
        if cfg.cuda_graphs == "on" and cfg.device == "cpu":
            raise UsageError("--cuda-graphs on needs the GPU path; --device cpu runs NumPy "
                             "(use --cuda-graphs auto or off)")
        if cfg.transport not in ("auto", "mpi", "nccl"):
            raise UsageError(f"--transport must be auto, mpi or nccl, got {cfg.transport!r}")
        if cfg.topology not in ("auto", "flat", "hierarchical"):
            raise UsageError(f"--topology must be auto, flat or hierarchical, got {cfg.topology!r}")
        if cfg.inter_link is not None:
            from ringnet.comm.hierarchical import parse_inter_link
            try:
                parse_inter_link(cfg.inter_link)
            except ValueError as exc:
                raise UsageError(str(exc)) from None
        if cfg.topology == "hierarchical" and not mode.hierarchical:
            raise UsageError(f"--topology hierarchical: mode {cfg.mode} has no hierarchical "
                             f"exchange; use --mode {' or '.join(hierarchical_modes())}, or "
                             "--topology auto|flat")
        if cfg.save_every < 0:
            raise UsageError(f"--save-every must be >= 0, got {cfg.save_every}")
        if cfg.resume == "auto" and not cfg.save:
            raise UsageError("--resume auto needs --save PATH.h5: it resumes from that checkpoint "
                             "when it exists, and starts fresh when it does not")
        if cfg.save_every and not cfg.save:
            raise UsageError("--save-every needs --save PATH.h5 (the checkpoint it rewrites)")
        if cfg.eval_every < 0:
            raise UsageError(f"--eval-every must be >= 0, got {cfg.eval_every}")
        if cfg.check_every < 0:
            raise UsageError(f"--check-every must be >= 0, got {cfg.check_every}")
        if cfg.seed < 0:
            raise UsageError(f"--seed must be >= 0, got {cfg.seed}")
        data_dir = None if cfg.data_dir is None else os.path.expanduser(cfg.data_dir)
        if data_dir is not None and not os.path.isdir(data_dir):
            what = "is not a folder" if os.path.exists(data_dir) else "does not exist"
            from ringnet.data.catalog import DOWNLOADABLE     # late: an error path only
            if cfg.dataset in DOWNLOADABLE and what == "does not exist":
                what += (f"; get {cfg.dataset} into it with: python -m ringnet.datasets "
                         f"download {cfg.dataset} --dir {cfg.data_dir}")
            raise UsageError(f"--data-dir {cfg.data_dir} {what}")
        if cfg.batch_size % world_size:
            raise UsageError(f"--batch-size {cfg.batch_size} (the global batch) is not divisible "
                             f"by the {world_size} ranks; choose a multiple of {world_size}")
        return cfg


def _settle_delay(cfg, mode):
    """Fill in and check ``cfg.delay`` (the default: ``mode``'s, a :class:`~ringnet.parallel.Mode`)
    and ``cfg.delay_compensation``. Raises UsageError."""
    if cfg.delay is None:
        cfg.delay = mode.default_delay
    if cfg.delay not in (0, 1):
        raise UsageError(f"--delay must be 0 or 1, got {cfg.delay}")
    if not mode.distributed and cfg.delay != 0:
        raise UsageError(f"--delay 1 needs a parallel mode ({', '.join(distributed_modes())})")
    if cfg.delay_compensation is None:
        cfg.delay_compensation = "lookahead" if cfg.delay else "none"
    if cfg.delay_compensation not in COMPENSATIONS:
        raise UsageError(f"--delay-compensation must be one of {', '.join(COMPENSATIONS)}, "
                         f"got {cfg.delay_compensation!r}")
    if cfg.delay_compensation != "none" and not cfg.delay:
        raise UsageError(f"--delay-compensation {cfg.delay_compensation} applies to --delay 1 only")


def _settle_warmup(cfg):
    """Fill in and check ``cfg.warmup_steps`` (after ``cfg.momentum`` is checked)."""
    if cfg.warmup_steps is None:
        cfg.warmup_steps = (lookahead_warmup(cfg.momentum)
                            if cfg.delay_compensation == "lookahead" else 0)
    elif cfg.warmup_steps < 0:
        raise UsageError(f"--warmup-steps must be >= 0, got {cfg.warmup_steps}")
    elif cfg.warmup_steps and cfg.delay_compensation != "lookahead":
        raise UsageError(f"--warmup-steps {cfg.warmup_steps} applies to --delay 1 with "
                         f"--delay-compensation lookahead only")


def _positive_int(text):
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _model_defaults_text():
    lines = ["Per-model defaults (when --dataset, --lr or --epochs is not given):"]
    for name, d in MODEL_DEFAULTS.items():
        lines.append(f"  {name:14s} --dataset {d['dataset']:9s} --lr {d['lr']:<6g} --epochs {d['epochs']}")
    return "\n".join(lines)


EXAMPLES = (
    "python -m ringnet.train",
    "mpirun -np 4 python -m ringnet.train --mode ring --delay 1",
    "python -m ringnet.train --model lenet --dataset synthetic --steps 50",
    "python -m ringnet.train --model cifar10_quick --dataset synthetic --steps 150 --lr 0.01",
    "mpirun -np 2 python -m ringnet.train --model lenet --dataset mnist --json",
    "mpirun -np 4 python -m ringnet.train --save ck.h5 --save-every 100 --resume auto",
)


_LA = COMPENSATIONS["lookahead"]

# Optimisation flags that default to None and resolve from DEFAULTS (see there):
# (flag, type, metavar, what it sets); the key in DEFAULTS is the flag's name.
_TUNED = (
    ("--gamma", float, "G", "factor of the step and inv policies"),
    ("--stepsize", _positive_int, "K", "steps between lr drops of the step policy"),
    ("--power", float, "P", "exponent of the inv policy"),
    ("--momentum", float, "M", "SGD momentum, in [0, 1)"),
    ("--weight-decay", float, "WD", "L2 weight decay added to the gradient"),
    ("--seed", int, "S", "seeds weights, shuffling, dropout and synthetic data"),
)


def build_parser():
    """Return the argument parser of ``python -m ringnet.train``."""
    d = DEFAULTS
    p = ArgumentParser(
        prog="python -m ringnet.train",
        description="Train a CNN with one process per GPU (or CPU core). Run alone for the\n"
                    "single-process reference, or under `mpirun -np N` for a parallel mode.\n"
                    "With no arguments: the digits model on the embedded UCI digits data set.",
        epilog=_model_defaults_text() + "\n\n"
               "mnist and cifar10 are downloaded once with "
               "`python -m ringnet.datasets download NAME`.\n"
               "A --resume continues with the checkpoint's model, data set, batch size, lr, lr "
               "policy, momentum,\nweight decay, seed, dtype, shuffling and augmentation; a flag "
               "given on the command line\noverrides the checkpoint's value (the run says so). "
               "A data set whose content changed\nsince the checkpoint is refused unless "
               "--dataset is given.\n\n"
               "SIGTERM or SIGUSR1 (a time limit, scancel, preemption) stops every rank at the "
               "next step boundary;\nthe run writes its --save checkpoint and exits 75, so "
               "the same command with --resume auto\ncontinues it. Exit codes: 0 done, 1 "
               "failure, 2 bad input, 3 diverged, 75 stopped, 130 Ctrl-C.\n\n"
               "Examples:\n" + "".join(f"  {e}\n" for e in EXAMPLES),
        formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("model and data")
    g.add_argument("--model", default=None, metavar="|".join(MODEL_DEFAULTS),
                   help="digits (1x8x8), lenet (1x28x28), cifar10_quick (3x32x32), carnet "
                        "(3x64x64); the last layer has one output per class of the data set "
                        "(default digits; under --resume the checkpoint's)")
    g.add_argument("--dataset", default=None, metavar="NAME|PATH.h5",
                   help="digits (embedded), mnist, cifar10, synthetic, a name with <name>.h5 in "
                        "--data-dir, or a path to a ringnet .h5 file (default: per model, below)")
    g.add_argument("--data-dir", default=None, metavar="DIR",
                   help="folder holding <name>.h5 data sets (default $RINGNET_DATA, then datasets/)")
    g.add_argument("--synthetic-size", type=_positive_int, nargs=2, metavar=("TRAIN", "TEST"),
                   default=(2048, 512), help="image counts of --dataset synthetic (default 2048 512)")
    g.add_argument("--no-shuffle", dest="shuffle", action="store_const", const=False,
                   default=None,
                   help="visit training samples in file order (default: seeded shuffle per epoch; "
                        "a --resume keeps the checkpoint's)")
    g.add_argument("--augment", action="store_const", const=True, default=None,
                   help="random crop (pad 4) and horizontal flip, seeded, for CIFAR-like data "
                        "(default off; a --resume keeps the checkpoint's)")
    g = p.add_argument_group("parallel structure")
    g.add_argument("--mode", choices=list(MODES), default=None,
                   help="; ".join(f"{m.name}: {m.per_step.replace('`', '')} (default delay "
                                  f"{m.default_delay})" for m in MODES.values())
                        + ". Default: ring under mpirun, else single")
    g.add_argument("--delay", type=int, choices=(0, 1), default=None,
                   help="1: delayed model update, step t computes on the weights of step t-1 while "
                        "the exchange of step t-1 runs; 0: synchronous (default 1 for ring, "
                        "0 otherwise)")
    g.add_argument("--delay-compensation", choices=list(COMPENSATIONS), default=None,
                   help=f"with --delay 1: lookahead (default) computes step t's gradient at "
                        f"w[t-1] + {_LA.c:g} (w[t-1] - w[t-2]) and runs momentum 1 - (1 - M)/k "
                        f"at lr LR/k (the same long-run step LR/(1 - M)), k the smallest that makes "
                        f"the delayed update stable wherever synchronous SGD is (on a quadratic; "
                        f"k = {_LA.k_for(0.9):.2f} at M 0.9); none: the plain recurrence, gradient "
                        f"at w[t-1], momentum M, lr LR (default lookahead at delay 1, none at delay 0)")
    g.add_argument("--warmup-steps", type=int, default=None, metavar="W",
                   help=f"with --delay-compensation lookahead: the first W steps are synchronous "
                        f"(momentum M, lr LR, the exchange waited for: no overlap), then the "
                        f"compensated recurrence continues from their momentum; 0 starts delayed "
                        f"(default ceil({WARMUP_SPANS:g} / (1 - M)): "
                        f"{lookahead_warmup(0.9)} at M 0.9; a --resume keeps the checkpoint's)")
    g.add_argument("--transport", choices=TRANSPORTS, default="auto",
                   help="how bytes move (default auto: nccl when every rank has its own GPU, "
                        "else mpi)")
    g.add_argument("--topology", choices=("auto", "flat", "hierarchical"), default="auto",
                   help="how ring and tree exchanges cross nodes: flat (one ring or tree over "
                        "all ranks, the ring ordered by node); hierarchical (reduce within each "
                        "node to one leader, ring or tree between the leaders, back within the "
                        "node); default auto: whichever the cost model says is faster for the "
                        "model's bytes and the placement (flat on one node)")
    g.add_argument("--inter-link", metavar="US,MB/S",
                   help="the link between nodes as --topology auto prices it: microseconds per "
                        "message and megabytes per second each way (default 40,1250: 10 Gbit/s "
                        "Ethernet); `python -m ringnet.bench model --calibrate` run across the "
                        "nodes prints the pair it measured")
    g.add_argument("--device", choices=DEVICES, default="auto",
                   help="where layers run (default auto: gpu with CuPy when available, else cpu "
                        "with NumPy)")
    g.add_argument("--cuda-graphs", choices=graphs.CHOICES, default="auto",
                   help="on a GPU, capture each step's device work once as a CUDA graph and "
                        "replay it (one launch instead of dozens). The step is captured after 2 "
                        "eager steps and its replay checked against the eager step bit for bit. "
                        "Default auto: on where it captures (not split-fc, not on the CPU) and "
                        "off, saying why, if the replay differs; on: the same, but either case "
                        "stops the run")
    g.add_argument("--check-every", type=int, default=0, metavar="K",
                   help="compare a checksum of the weights across ranks every K steps (default 0: "
                        "only at the end)")
    g = p.add_argument_group("optimisation")
    g.add_argument("--epochs", type=_positive_int, default=None, metavar="E",
                   help="passes over the training set (default: per model, below)")
    g.add_argument("--steps", type=_positive_int, default=None, metavar="S",
                   help="total optimizer steps, counted from step 0 also under --resume; "
                        "overrides --epochs (default: from --epochs)")
    g.add_argument("--batch-size", type=_positive_int, default=None, metavar="B",
                   help=f"GLOBAL mini-batch; each of N ranks takes a disjoint B/N of it; must be "
                        f"divisible by N (default {d['batch_size']}, or the nearest multiple of N)")
    g.add_argument("--lr", type=float, default=None, metavar="LR",
                   help="base learning rate (default: per model, below)")
    g.add_argument("--lr-policy", choices=("fixed", "step", "inv"), default=None,
                   help="Caffe lr policies: fixed: lr; step: lr*gamma^floor(it/stepsize); inv: "
                        f"lr*(1+gamma*it)^-power (default {d['lr_policy']})")
    for flag, kind, metavar, text in _TUNED:
        g.add_argument(flag, type=kind, default=None, metavar=metavar,
                       help=f"{text} (default {d[flag[2:].replace('-', '_')]:g})")
    g.add_argument("--dtype", choices=("float32", "float64"), default=None,
                   help="floating-point type of weights and activations (default float32; a "
                        "--resume keeps the checkpoint's)")
    g = p.add_argument_group("checkpoints and output")
    g.add_argument("--save", default=None, metavar="PATH.h5",
                   help="write an HDF5 checkpoint at the end, atomically; missing folders are "
                        "created (default: none)")
    g.add_argument("--save-every", type=_positive_int, default=0, metavar="K",
                   help="also write the --save checkpoint every K steps, so a run that dies "
                        "loses at most K steps (see python -m ringnet.launch; default: only at "
                        "the end)")
    g.add_argument("--resume", default=None, metavar="PATH.h5|auto",
                   help="continue from a checkpoint, in any mode and at any rank count; auto: "
                        "from --save when it holds one, else start fresh (what a requeued job "
                        "repeats). A run refuses to start when its first save would replace a "
                        "--save checkpoint that is further along (default: none)")
    g.add_argument("--json", action="store_true",
                   help="print one JSON summary line on stdout at the end (rank 0); the log then "
                        "goes to stderr")
    g.add_argument("--json-file", default=None, metavar="PATH.json",
                   help="write the same JSON summary to PATH at the end (rank 0; written whole "
                        "under another name, then renamed): under sbatch, where srun can put a "
                        "log line inside a long stdout line, this keeps it whole (default: none)")
    g.add_argument("--trace", default=None, metavar="PATH.json",
                   help="write every rank's timeline as one Chrome trace file for Perfetto or "
                        "chrome://tracing (default: none)")
    g.add_argument("--no-progress", dest="progress", action="store_false",
                   help="no progress bar or lines (default: a bar on stderr when it is a terminal, "
                        "else a line per epoch and every $RINGNET_PROGRESS_SECONDS)")
    g.add_argument("--no-eval", dest="eval_every_epoch", action="store_false",
                   help="skip the per-epoch test evaluation (the final one still runs)")
    g.add_argument("--eval-every", type=int, default=0, metavar="K",
                   help="also evaluate test accuracy every K steps; --json then lists them as "
                        "'evals': [step, epoch, train seconds (evaluations excluded), accuracy] "
                        "(default 0: only per epoch)")
    g.add_argument("--quiet", action="store_true", help="print nothing but errors and --json")
    return p


def synopsis(width=96):
    """Return the README's usage block, built from the parser: every flag, choices as a|b."""
    items = []
    for action in build_parser()._actions:
        if not action.option_strings or action.dest == "help":
            continue
        flag = action.option_strings[0]
        if action.nargs == 0:
            items.append(f"[{flag}]")
        elif action.choices is not None:
            items.append(f"[{flag} {'|'.join(map(str, action.choices))}]")
        else:
            metavar = action.metavar or action.dest.upper()
            items.append(f"[{flag} {' '.join(metavar) if isinstance(metavar, tuple) else metavar}]")
    head = "python -m ringnet.train "
    lines, line = [], head
    for item in items:
        if len(line) + len(item) > width and line.strip() != head.strip():
            lines.append(line.rstrip())
            line = " " * len(head)
        line += item + " "
    lines.append(line.rstrip())
    return "\n".join(lines)


def config_from_args(argv=None):
    """Parse ``argv`` into a TrainConfig (defaults not yet resolved)."""
    args = build_parser().parse_args(argv)
    values = vars(args)
    values["synthetic_size"] = tuple(values["synthetic_size"])
    return TrainConfig(**values)
