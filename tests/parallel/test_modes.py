"""The mode table (ringnet.parallel.MODES) is what the config, --help and README use."""
import dataclasses
import re
from pathlib import Path

import pytest

from ringnet import parallel
from ringnet.config import TrainConfig, build_parser
from ringnet.errors import UsageError

README = Path(__file__).resolve().parents[2] / "README.md"


def test_readme_mode_table_is_the_registry():
    text = README.read_text()
    start = text.index("| mode | per step |")
    table = text[start:].split("\n\n", 1)[0].strip()
    assert table == parallel.mode_table(), "README mode table differs from ringnet.parallel.MODES"


def test_help_describes_every_mode_with_its_default_delay():
    help_text = " ".join(build_parser().format_help().split())
    for mode in parallel.MODES.values():
        assert f"{mode.name}: {mode.per_step.replace('`', '')} (default delay {mode.default_delay})" \
            in help_text


@pytest.mark.parametrize("name", list(parallel.MODES))
def test_config_takes_the_default_delay_from_the_registry(name, monkeypatch):
    mode = parallel.MODES[name]
    ranks = 1 if mode.communicator is None else 2
    cfg = TrainConfig(mode=name, batch_size=4).resolved(ranks)
    assert cfg.delay == mode.default_delay
    # change the registry: the config follows it
    monkeypatch.setitem(parallel.MODES, name, parallel.Mode(
        mode.name, mode.strategy, mode.communicator, 1 - mode.default_delay, mode.per_step,
        mode.update_work))
    if mode.communicator is not None:
        assert TrainConfig(mode=name, batch_size=4).resolved(ranks).delay == 1 - mode.default_delay


def test_unknown_mode_is_refused_naming_the_modes():
    with pytest.raises(UsageError, match=re.escape(", ".join(parallel.MODES))):
        TrainConfig(mode="star").resolved(1)
    with pytest.raises(ValueError, match="unknown mode 'star'"):
        parallel.create("star", None, None, None)


def test_the_registry_says_which_modes_are_distributed_and_hierarchical():
    assert parallel.distributed_modes() == ["ring", "tree", "master", "split-fc"]
    assert parallel.hierarchical_modes() == ["ring", "tree"]
    assert [m.name for m in parallel.MODES.values() if not m.distributed] == ["single"]
    from ringnet.comm.factory import HIERARCHICAL
    for name in parallel.hierarchical_modes():      # each has a hierarchical communicator
        assert parallel.MODES[name].communicator in HIERARCHICAL, name


@pytest.mark.parametrize("fields, ranks, message", [
    (dict(mode="single"), 2, "--mode single runs on one process, but 2 ranks were started; "
                             "use --mode ring|tree|master|split-fc or run without mpirun"),
    (dict(mode="single", delay=1), 1, "--delay 1 needs a parallel mode (ring, tree, master, split-fc)"),
    (dict(mode="ring", delay=2), 2, "--delay must be 0 or 1, got 2"),
    (dict(mode="tree", delay_compensation="lookahead"), 2,
     "--delay-compensation lookahead applies to --delay 1 only"),
    (dict(mode="master", topology="hierarchical"), 2,
     "--topology hierarchical: mode master has no hierarchical exchange; use --mode ring or tree, "
     "or --topology auto|flat"),
])
def test_the_mode_rules_of_the_command_line(fields, ranks, message):
    with pytest.raises(UsageError) as error:
        TrainConfig(batch_size=4, **fields).resolved(ranks)
    assert str(error.value) == message


def test_the_config_and_the_strategies_follow_the_registrys_hierarchical_flag(monkeypatch):
    assert TrainConfig(mode="tree", topology="hierarchical", batch_size=4).resolved(2).topology \
        == "hierarchical"
    with pytest.raises(ValueError, match=r"mode split-fc has no hierarchical exchange \(ring and "
                                         r"tree have one\)"):
        parallel.topology_choice("split-fc", None, None, "hierarchical")
    tree = parallel.MODES["tree"]
    monkeypatch.setitem(parallel.MODES, "tree", dataclasses.replace(tree, hierarchical=False))
    with pytest.raises(UsageError, match="mode tree has no hierarchical exchange; use --mode ring,"):
        TrainConfig(mode="tree", topology="hierarchical", batch_size=4).resolved(2)
    with pytest.raises(ValueError, match=r"\(ring have one\)"):
        parallel.topology_choice("tree", None, None, "hierarchical")
    assert parallel.topology_choice("tree", None, None, "auto") == ("flat", "the mode's only exchange")
