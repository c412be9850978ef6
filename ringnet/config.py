"""Training configuration: one dataclass, filled from argparse, checked before any work."""
import argparse
import dataclasses
from dataclasses import dataclass

from ringnet.errors import UsageError
from ringnet.parallel import MODES

__all__ = ["TrainConfig", "MODES", "MODEL_DEFAULTS", "build_parser", "config_from_args"]

# Per-model defaults (learning rate, epochs) for runs that do not set them.
MODEL_DEFAULTS = {
    "digits": {"lr": 0.01, "epochs": 20, "dataset": "digits"},
    "lenet": {"lr": 0.01, "epochs": 10, "dataset": "mnist"},
    "cifar10_quick": {"lr": 0.001, "epochs": 10, "dataset": "cifar10"},
    "carnet": {"lr": 0.01, "epochs": 10, "dataset": "synthetic"},
}


@dataclass
class TrainConfig:
    """Everything a training run needs; see ``python -m ringnet.train --help``."""
    model: str = "digits"
    dataset: str = None
    mode: str = None
    delay: int = None
    epochs: int = None
    steps: int = None
    batch_size: int = 64
    lr: float = None
    lr_policy: str = "fixed"
    gamma: float = 0.1
    stepsize: int = 1000
    power: float = 0.75
    momentum: float = 0.9
    weight_decay: float = 5e-4
    seed: int = 0
    device: str = "auto"
    dtype: str = "float32"
    transport: str = "auto"
    shuffle: bool = True
    augment: bool = False
    save: str = None
    resume: str = None
    json: bool = False
    check_every: int = 0
    eval_every_epoch: bool = True
    data_dir: str = None
    synthetic_size: tuple = (2048, 512)
    progress: bool = True
    quiet: bool = False
    trace: str = None

    def resolved(self, world_size):
        """Return a copy with defaults filled in for ``world_size`` ranks; raise UsageError on bad values."""
        from ringnet.models import MODELS  # late: keeps --help fast
        cfg = dataclasses.replace(self)
        if cfg.model not in MODELS:
            raise UsageError(f"unknown model {cfg.model!r}; choose one of {', '.join(sorted(MODELS))}")
        defaults = MODEL_DEFAULTS.get(cfg.model, {"lr": 0.01, "epochs": 10, "dataset": "synthetic"})
        if cfg.dataset is None:
            cfg.dataset = defaults["dataset"]
        if cfg.mode is None:
            cfg.mode = "ring" if world_size > 1 else "single"
        if cfg.mode not in MODES:
            raise UsageError(f"unknown mode {cfg.mode!r}; choose one of {', '.join(MODES)}")
        if MODES[cfg.mode].communicator is None and world_size > 1:
            parallel = "|".join(m.name for m in MODES.values() if m.communicator)
            raise UsageError(f"--mode {cfg.mode} runs on one process, but {world_size} ranks were "
                             f"started; use --mode {parallel} or run without mpirun")
        if cfg.delay is None:
            cfg.delay = MODES[cfg.mode].default_delay
        if cfg.delay not in (0, 1):
            raise UsageError(f"--delay must be 0 or 1, got {cfg.delay}")
        if MODES[cfg.mode].communicator is None and cfg.delay != 0:
            parallel = ", ".join(m.name for m in MODES.values() if m.communicator)
            raise UsageError(f"--delay 1 needs a parallel mode ({parallel})")
        if cfg.lr is None:
            cfg.lr = defaults["lr"]
        if cfg.epochs is None and cfg.steps is None:
            cfg.epochs = defaults["epochs"]
        if cfg.batch_size <= 0:
            raise UsageError(f"--batch-size must be positive, got {cfg.batch_size}")
        if cfg.epochs is not None and cfg.epochs <= 0:
            raise UsageError(f"--epochs must be positive, got {cfg.epochs}")
        if cfg.steps is not None and cfg.steps <= 0:
            raise UsageError(f"--steps must be positive, got {cfg.steps}")
        if not cfg.lr > 0:
            raise UsageError(f"--lr must be positive, got {cfg.lr}")
        if not 0 <= cfg.momentum < 1:
            raise UsageError(f"--momentum must be in [0, 1), got {cfg.momentum}")
        if cfg.weight_decay < 0:
            raise UsageError(f"--weight-decay must be >= 0, got {cfg.weight_decay}")
        if cfg.lr_policy not in ("fixed", "step", "inv"):
            raise UsageError(f"--lr-policy must be fixed, step or inv, got {cfg.lr_policy!r}")
        if cfg.dtype not in ("float32", "float64"):
            raise UsageError(f"--dtype must be float32 or float64, got {cfg.dtype!r}")
        if cfg.device not in ("auto", "cpu", "gpu"):
            raise UsageError(f"--device must be auto, cpu or gpu, got {cfg.device!r}")
        if cfg.transport not in ("auto", "mpi", "nccl"):
            raise UsageError(f"--transport must be auto, mpi or nccl, got {cfg.transport!r}")
        if cfg.check_every < 0:
            raise UsageError(f"--check-every must be >= 0, got {cfg.check_every}")
        if cfg.batch_size % world_size:
            raise UsageError(f"--batch-size {cfg.batch_size} (the global batch) is not divisible "
                             f"by the {world_size} ranks; choose a multiple of {world_size}")
        return cfg


def _positive_int(text):
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


class _Parser(argparse.ArgumentParser):
    """ArgumentParser whose errors become one-line UsageErrors (printed once, exit 2)."""

    def error(self, message):
        raise UsageError(f"{message} (see `{self.prog} --help`)")


def build_parser():
    """Return the argument parser of ``python -m ringnet.train``."""
    p = _Parser(
        prog="python -m ringnet.train",
        description="Train a CNN with one process per GPU (or CPU core). Run alone for the "
                    "single-process reference, or under `mpirun -np N` for a parallel mode. "
                    "With no arguments: the digits model on the embedded UCI digits data set.",
        epilog="Examples:\n"
               "  python -m ringnet.train\n"
               "  mpirun -np 4 python -m ringnet.train --mode ring --delay 1\n"
               "  mpirun -np 2 python -m ringnet.train --model lenet --dataset mnist --json\n"
               "  python -m ringnet.train --model cifar10_quick --dataset synthetic --steps 50\n",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("model and data")
    g.add_argument("--model", default="digits",
                   help="digits (1x8x8), lenet (1x28x28), cifar10_quick (3x32x32), carnet (3x64x64); default digits")
    g.add_argument("--dataset", default=None,
                   help="digits (embedded), mnist, cifar10, synthetic, or a path to a ringnet .h5 file; "
                        "default: the model's usual data set (digits for digits, synthetic for carnet)")
    g.add_argument("--data-dir", default=None,
                   help="folder holding <name>.h5 data sets (default $RINGNET_DATA, then datasets/)")
    g.add_argument("--synthetic-size", type=_positive_int, nargs=2, metavar=("TRAIN", "TEST"),
                   default=(2048, 512), help="sample counts of --dataset synthetic (default 2048 512)")
    g.add_argument("--no-shuffle", dest="shuffle", action="store_false",
                   help="visit training samples in file order (default: seeded shuffle per epoch)")
    g.add_argument("--augment", action="store_true",
                   help="random crop (pad 4) and horizontal flip, seeded (for CIFAR-like data)")
    g = p.add_argument_group("parallel structure")
    g.add_argument("--mode", choices=list(MODES), default=None,
                   help="; ".join(f"{m.name}: {m.per_step.replace('`', '')} (default delay "
                                  f"{m.default_delay})" for m in MODES.values())
                        + ". Default: ring under mpirun, else single")
    g.add_argument("--delay", type=int, choices=(0, 1), default=None,
                   help="1: delayed model update, step t computes on the weights of step t-1 while "
                        "the exchange of step t-1 runs (default for ring); 0: synchronous")
    g.add_argument("--transport", choices=("auto", "mpi", "nccl"), default="auto",
                   help="how bytes move: nccl when every rank has its own GPU (auto), else mpi")
    g.add_argument("--device", choices=("auto", "cpu", "gpu"), default="auto",
                   help="gpu (CuPy) when available (auto), else cpu (NumPy)")
    g.add_argument("--check-every", type=int, default=0, metavar="K",
                   help="compare a checksum of the weights across ranks every K steps (always at the end)")
    g = p.add_argument_group("optimisation")
    g.add_argument("--epochs", type=_positive_int, default=None, help="passes over the training set (default: per model)")
    g.add_argument("--steps", type=_positive_int, default=None, help="optimizer steps; overrides --epochs")
    g.add_argument("--batch-size", type=_positive_int, default=64,
                   help="GLOBAL mini-batch; each of N ranks takes a disjoint B/N of it (default 64)")
    g.add_argument("--lr", type=float, default=None, help="base learning rate (default: per model)")
    g.add_argument("--lr-policy", choices=("fixed", "step", "inv"), default="fixed",
                   help="Caffe lr policies: fixed; step: lr*gamma^floor(it/stepsize); inv: lr*(1+gamma*it)^-power")
    g.add_argument("--gamma", type=float, default=0.1)
    g.add_argument("--stepsize", type=_positive_int, default=1000)
    g.add_argument("--power", type=float, default=0.75)
    g.add_argument("--momentum", type=float, default=0.9)
    g.add_argument("--weight-decay", type=float, default=5e-4)
    g.add_argument("--seed", type=int, default=0, help="seeds weights, shuffling, dropout and synthetic data")
    g.add_argument("--dtype", choices=("float32", "float64"), default="float32")
    g = p.add_argument_group("checkpoints and output")
    g.add_argument("--save", default=None, metavar="PATH.h5", help="write an HDF5 checkpoint at the end (atomically)")
    g.add_argument("--resume", default=None, metavar="PATH.h5", help="continue from a checkpoint (any mode)")
    g.add_argument("--json", action="store_true", help="print one JSON summary line at the end (rank 0)")
    g.add_argument("--trace", default=None, metavar="PATH.json",
                   help="write every rank's timeline as one Chrome trace file (Perfetto, chrome://tracing)")
    g.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    g.add_argument("--no-eval", dest="eval_every_epoch", action="store_false",
                   help="skip the per-epoch test evaluation (the final one still runs)")
    g.add_argument("--quiet", action="store_true", help="print nothing but errors and --json")
    return p


def config_from_args(argv=None):
    """Parse ``argv`` into a TrainConfig (defaults not yet resolved)."""
    args = build_parser().parse_args(argv)
    values = vars(args)
    values["synthetic_size"] = tuple(values["synthetic_size"])
    return TrainConfig(**values)
