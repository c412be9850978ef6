"""Training strategies: how one optimizer step uses the ranks, and the table of modes.

:data:`MODES` is the one list of training modes: the configuration checks ``--mode``,
``--delay`` and ``--topology`` against it and picks the default delay from it, ``--help``
describes the modes from it, the training loop and the benchmarks ask it which modes
are distributed, and the README's mode table is tested against it.
"""
import dataclasses
from dataclasses import dataclass
from typing import Optional

from ringnet.parallel.base import Strategy
from ringnet.parallel.delayed_update import COMPENSATIONS, Lookahead
from ringnet.parallel.delayed_update import compensation as lookahead_of
from ringnet.parallel.master import MasterStrategy
from ringnet.parallel.ring import RingStrategy
from ringnet.parallel.single import SingleStrategy
from ringnet.parallel.split_fc import SplitFCStrategy
from ringnet.parallel.traffic import StepTraffic
from ringnet.parallel.tree import TreeStrategy

__all__ = ["Mode", "MODES", "COMPENSATIONS", "Lookahead", "create", "mode_table", "step_traffic",
           "StepTraffic", "topology_choice", "distributed_modes", "hierarchical_modes"]


@dataclass(frozen=True)
class Mode:
    """One training mode: its strategy, the communicator it uses, its defaults and its description."""
    name: str
    strategy: type
    communicator: Optional[str]     # a key of ringnet.comm.COMMUNICATORS; None: no communication
    default_delay: int
    per_step: str                   # what happens in one step (README table, --help)
    update_work: str                # which ranks run the optimizer and on how much
    hierarchical: bool = False      # whether --topology hierarchical can run its exchange

    @property
    def distributed(self) -> bool:
        """Whether the mode runs over several ranks (it exchanges through a communicator)."""
        return self.communicator is not None


MODES = {mode.name: mode for mode in (
    Mode("single", SingleStrategy, None, 0,
         "one process, whole batch", "whole model"),
    Mode("ring", RingStrategy, "ring", 1,
         "ring reduce-scatter of gradients, each rank updates its 1/N shard, ring all-gather",
         "1/N per rank", hierarchical=True),
    Mode("tree", TreeStrategy, "tree", 0,
         "binary-tree reduce to rank 0, rank 0 updates, tree broadcast", "rank 0",
         hierarchical=True),
    Mode("master", MasterStrategy, "master", 0,
         "workers send gradients to rank 0, it updates and answers each", "rank 0"),
    Mode("split-fc", SplitFCStrategy, "ring", 0,
         "conv layers as `ring`; FC layers split by output neurons; activations gathered",
         "1/N per rank"),
)}


def distributed_modes():
    """Return the names of the modes that run over several ranks, in :data:`MODES`' order."""
    return [m.name for m in MODES.values() if m.distributed]


def hierarchical_modes():
    """Return the names of the modes whose exchange can run hierarchically, in order."""
    return [m.name for m in MODES.values() if m.hierarchical]


def mode_table():
    """Return the README's Markdown table of the modes (the README is tested against it)."""
    rows = ["| mode | per step | update work | default delay |", "|---|---|---|---|"]
    rows += [f"| `{m.name}` | {m.per_step} | {m.update_work} | {m.default_delay} |"
             for m in MODES.values()]
    return "\n".join(rows)


def _spec(mode: str) -> Mode:
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; choose one of {', '.join(MODES)}")
    return MODES[mode]


def step_traffic(mode: str, model, n: int, batch: int, delay: int = 0, buckets=None) -> StepTraffic:
    """Return what one step of ``mode`` sends over ``n`` ranks with global ``batch``: its
    strategy's :meth:`~ringnet.parallel.base.Strategy.step_traffic` over the mode's
    communicator (pure: no MPI run; ``buckets`` as there)."""
    spec = _spec(mode)
    return spec.strategy.step_traffic(model, n, batch, communicator=spec.communicator,
                                      delay=delay, buckets=buckets)


def topology_choice(mode: str, model, layout, asked: str = "auto", inter_link=None):
    """Return (topology, why) that ``mode`` runs ``model``'s exchange with over the node
    ``layout`` for ``--topology asked``: flat for modes without a hierarchical exchange,
    else :func:`ringnet.comm.hierarchical.choose_topology` for the exchanged bytes, the link
    between nodes priced as ``inter_link`` (``--inter-link``'s text; None: the default)."""
    from ringnet.comm.hierarchical import choose_topology
    spec = _spec(mode)
    if not spec.hierarchical:
        if asked == "hierarchical":
            raise ValueError(f"--topology hierarchical: mode {mode} has no hierarchical exchange "
                             f"({' and '.join(hierarchical_modes())} have one)")
        return "flat", "the mode's only exchange"
    size, _ = spec.strategy.exchange_region(model)
    per_node = [layout.ranks_on(i) for i in range(layout.nodes)]
    links = {}
    if inter_link is not None:
        from ringnet.comm.hierarchical import parse_inter_link
        links["inter"] = parse_inter_link(inter_link)
    return choose_topology(spec.communicator, size * model.dtype.itemsize, per_node, asked,
                           **links)


def create(mode: str, model, make_optimizer, world, delay: int = 0,
           transport: str = "auto", compensation: str = "none",
           warmup: Optional[int] = None, topology: str = "auto",
           inter_link: Optional[str] = None) -> Strategy:
    """Return the strategy of ``mode`` on ``world`` (an mpi4py communicator, or None for single).

    ``compensation``: the delay-1 compensation, a key of :data:`COMPENSATIONS`;
    ``warmup``: its synchronous warm-up steps (None: the compensation's default);
    ``topology``: auto, flat or hierarchical (:func:`topology_choice`, with ``inter_link``,
    ``--inter-link``'s text); the choice and why are in the transport's
    ``placement.topology`` and the communicator's ``topology``.
    """
    spec = _spec(mode)
    lookahead = lookahead_of(compensation)
    if warmup is not None and not lookahead.plain:
        lookahead = dataclasses.replace(lookahead, warmup=int(warmup))
    if not spec.distributed:
        return spec.strategy(model, make_optimizer, world, delay=delay)
    from ringnet import comm as ringcomm    # late: loading mpi4py initialises MPI
    if isinstance(transport, str):
        transport = ringcomm.make_transport(transport, mpi_comm=world)
    from ringnet.placement import layout_of
    chosen, why = topology_choice(mode, model, layout_of(transport), topology, inter_link)
    communicator = ringcomm.create(spec.communicator, transport=transport, mpi_comm=world,
                                   topology=chosen)
    communicator.topology = chosen
    if getattr(transport, "placement", None) is not None:
        shape = ""
        if chosen == "hierarchical" and hasattr(communicator, "describe"):
            size, _ = spec.strategy.exchange_region(model)
            shape = f"; {communicator.describe(size * model.dtype.itemsize)}"
        transport.placement.topology = f"{chosen} ({why}{shape})"
    return spec.strategy(model, make_optimizer, world, communicator, delay=delay,
                         lookahead=lookahead)
