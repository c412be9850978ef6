"""The options the benchmark commands share, each defined once: its flag, type and default,
and a help text whose per-command part (what the option means to that command) is a
parameter. Each ``add_*`` adds one option to a parser or an argument group and returns the
argparse action; the help ends with the default, written from the value itself
("(default 64)") or, where the value does not say it, from ``shown`` ("(default: train's)").

Here too: :func:`node_shapes`, the ``--nodes`` a command runs on, checked against the nodes
its launcher reaches (``bench scaling``, ``bench overlap``).

``python -m ringnet.bench model`` (:mod:`ringnet.perfmodel.cli`) defines its options itself:
the performance model sits below the benchmarks and imports nothing of them
(tests/test_structure.py); tests/bench/test_bench_options.py checks that its options of
these names keep the same type and default.
"""
import os

from ringnet import cluster
from ringnet.config import DEVICES, TRANSPORTS
from ringnet.errors import UsageError

__all__ = ["TRANSPORTS", "DEVICES", "DTYPES", "add_json", "add_markdown", "add_mpirun",
           "add_cluster", "node_shapes", "add_np", "add_model", "add_models", "add_dataset",
           "add_data_dir", "add_batch_size", "add_steps", "add_repeats", "add_epochs",
           "add_eval_every", "add_lr", "add_seed", "add_timeout", "add_transport", "add_device",
           "add_dtype", "add_plot"]

DTYPES = ("float32", "float64")             # the types a model computes in


def _value(v):
    return f"{v:g}" if isinstance(v, float) else str(v)


def _help(what, default=None, shown=None):
    """``what`` and its default: "(default 64)", "(default 1 2)" for a list, or
    "(default: <shown>)" where ``shown`` says it instead of the value."""
    if shown is not None:
        return f"{what} (default: {shown})"
    if default is None or default is False:
        return what
    text = " ".join(map(_value, default)) if isinstance(default, (list, tuple)) else _value(default)
    return f"{what} (default {text})"


def _many(default):
    """``nargs="+"`` where the default is a list: the option takes one value or several."""
    return {"nargs": "+"} if isinstance(default, list) else {}


# -- what a command prints ----------------------------------------------------------------
def add_json(p, what):
    """``--json``: ``what`` is what it prints ("print one JSON line per case")."""
    return p.add_argument("--json", action="store_true", help=what)


def add_markdown(p, what, detail=""):
    """``--markdown``: ``what`` prints "as Markdown, as in the README" (``detail`` after)."""
    return p.add_argument("--markdown", action="store_true",
                          help=f"{what} as Markdown, as in the README{detail}")


def add_plot(p, what):
    """``--plot PATH``: the picture a command draws (default: none)."""
    return p.add_argument("--plot", default=None, metavar="PATH", help=what)


# -- where the ranks run ------------------------------------------------------------------
def add_mpirun(p):
    """``--mpirun``: the launcher of the runs, ``$MPIRUN`` (read now) or mpirun."""
    return p.add_argument("--mpirun", default=os.environ.get("MPIRUN", "mpirun"),
                          help="launcher (default $MPIRUN or mpirun)")


def add_cluster(p, nodes_help, many=False):
    """The group "on a cluster of nodes": ``--launcher CMD`` and ``--nodes K`` (``many``:
    ``--nodes K [K ...]``), ``nodes_help`` saying what the command runs on them. Returns
    the group (for the command's own options of it). :func:`node_shapes` reads them."""
    g = p.add_argument_group("on a cluster of nodes")
    g.add_argument("--launcher", default=None, metavar="CMD",
                   help='what starts the ranks, e.g. "srun --mpi=pmi2" or "mpirun" (default: '
                        "--mpirun); with --nodes it is given the nodes and ranks per node")
    g.add_argument("--nodes", default=None, metavar="K", help=nodes_help,
                   **({"nargs": "+"} if many else {}))
    return g


def node_shapes(items, per_node, launcher):
    """The :class:`~ringnet.cluster.Shape` of each ``--nodes`` item (``K``: K nodes of
    ``per_node`` ranks; ``KxR``: K nodes of R ranks), checked against the nodes ``launcher``
    reaches: a UsageError names the shapes it does not ("--nodes 4x1: 'mpirun' reaches 2
    nodes") before anything runs."""
    shapes = cluster.parse_nodes(items, per_node)
    have = cluster.available_nodes(launcher)
    over = [repr(s) for s in shapes if s.nodes > have]
    if over:
        raise UsageError(f"--nodes {' '.join(over)}: {launcher!r} reaches {have} "
                         f"node{'s' if have != 1 else ''}")
    return shapes


def add_np(p, default, what="ranks"):
    """``--np``: one rank count, or several where ``default`` is a list."""
    return p.add_argument("--np", type=int, default=default, **_many(default),
                          help=_help(what, default))


def add_timeout(p, default=600, what="seconds per run before it is killed"):
    return p.add_argument("--timeout", type=float, default=default, help=_help(what, default))


# -- the training runs --------------------------------------------------------------------
def add_model(p, default, shown=None):
    """``--model``: the one model a command trains."""
    return p.add_argument("--model", default=default, help=_help("model to train", default, shown))


def add_models(p, verb, shown):
    """``--model`` repeatable, one of ringnet's models: the models a command times or counts."""
    from ringnet.models import MODELS
    return p.add_argument("--model", action="append", choices=sorted(MODELS),
                          help=_help(f"model to {verb}; repeatable", shown=shown))


def add_dataset(p, default, shown=None):
    return p.add_argument("--dataset", default=default, help=_help("data set", default, shown))


def add_data_dir(p):
    return p.add_argument("--data-dir", default=None,
                          help=_help("folder holding <name>.h5 data sets", shown="train's"))


def add_batch_size(p, default=64, what="global batch", shown=None):
    return p.add_argument("--batch-size", type=int, default=default,
                          help=_help(what, default, shown))


def add_steps(p, default, what="optimizer steps per run", shown=None):
    return p.add_argument("--steps", type=int, default=default, help=_help(what, default, shown))


def add_repeats(p, default=3, what="interleaved rounds"):
    return p.add_argument("--repeats", type=int, default=default, help=_help(what, default))


def add_epochs(p, default, what="epochs per run", type=int, shown=None):
    return p.add_argument("--epochs", type=type, default=default, help=_help(what, default, shown))


def add_eval_every(p, default, what, shown=None):
    return p.add_argument("--eval-every", type=int, default=default, metavar="K",
                          help=_help(what, default, shown))


def add_lr(p, default, what="learning rate", shown=None):
    """``--lr``: one learning rate, or several where ``default`` is a list."""
    return p.add_argument("--lr", type=float, default=default, **_many(default),
                          help=_help(what, default, shown))


def add_seed(p, default, what="training seed", shown=None):
    return p.add_argument("--seed", type=int, default=default, help=_help(what, default, shown))


def add_transport(p, what="train's --transport"):
    """``--transport`` (default auto), train's choices."""
    return p.add_argument("--transport", default="auto", choices=TRANSPORTS,
                          help=_help(what, "auto"))


def add_device(p, what="train's --device"):
    """``--device`` (default cpu), train's choices."""
    return p.add_argument("--device", default="cpu", choices=DEVICES, help=_help(what, "cpu"))


def add_dtype(p, default="float32", what="type of weights and activations", choices=DTYPES,
              shown=None):
    return p.add_argument("--dtype", default=default, choices=choices,
                          help=_help(what, default, shown))
