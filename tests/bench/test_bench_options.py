"""The options the benchmark commands share (ringnet.bench.options): one definition, the same
flag, type and default in every command that has it, and one check of ``--nodes``."""
import argparse
import importlib

import pytest

from ringnet import cluster
from ringnet.bench import options
from ringnet.bench.__main__ import COMMANDS
from ringnet.errors import UsageError

# every parser of python -m ringnet.bench NAME, and the DDP peer of bench scaling --vs ddp
PARSERS = dict({name: module for name, (module, _) in COMMANDS.items()}, ddp="ringnet.bench.ddp")


def _parsers():
    return {name: importlib.import_module(module).build_parser() for name, module in PARSERS.items()}


def _option(parser, flag):
    return next((a for a in parser._actions if flag in a.option_strings), None)


def _shared():
    """{flag: the action options.add_* makes} on a parser of its own (the common defaults)."""
    p = argparse.ArgumentParser()
    for add in (options.add_json, options.add_markdown, options.add_plot):
        add(p, "x")
    options.add_mpirun(p)
    options.add_cluster(p, "x")
    options.add_timeout(p)
    options.add_transport(p)
    options.add_device(p)
    options.add_dtype(p)
    options.add_data_dir(p)
    for add in (options.add_np, options.add_model, options.add_dataset, options.add_batch_size,
                options.add_steps, options.add_repeats, options.add_epochs, options.add_lr,
                options.add_seed):
        add(p, 1)
    options.add_eval_every(p, 0, "x")
    return {a.option_strings[0]: a for a in p._actions if a.option_strings}


def test_every_command_s_launcher_is_mpirun_or_MPIRUN_read_when_its_parser_is_built(monkeypatch):
    """--mpirun's default in every command that has one, the model's included."""
    monkeypatch.delenv("MPIRUN", raising=False)
    have = {n: _option(p, "--mpirun").default for n, p in _parsers().items() if _option(p, "--mpirun")}
    assert set(have) == {"curves", "delay", "elastic", "faults", "overlap", "scaling", "soak", "model"}
    assert set(have.values()) == {"mpirun"}, have
    monkeypatch.setenv("MPIRUN", "/opt/mpich/bin/mpirun")
    assert {_option(p, "--mpirun").default for n, p in _parsers().items() if n in have} == \
        {"/opt/mpich/bin/mpirun"}


# where a command's option of a shared name is another kind of value, and why
OTHER_KIND = {("--model", "budget"): "the models it counts: repeatable",
              ("--model", "layers"): "the models it times: repeatable",
              ("--epochs", "delay"): "fractions of an epoch",
              ("--plot", "model"): "metavar PNG: the model's own definition"}
SHARED_FLAGS = ["--json", "--markdown", "--plot", "--mpirun", "--launcher", "--nodes",
                "--timeout", "--transport", "--device", "--dtype", "--data-dir", "--np",
                "--model", "--dataset", "--batch-size", "--steps", "--repeats", "--epochs",
                "--eval-every", "--lr", "--seed"]


@pytest.mark.parametrize("flag", SHARED_FLAGS)
def test_a_shared_option_is_the_same_kind_of_value_in_every_command(flag):
    """A flag takes one kind of value everywhere: the same action, type and metavar in every
    command that has it (its default and help are the command's own), as options.add_*
    defines it. The model command defines its own (the performance model imports nothing
    of the benchmarks) and is held to the same."""
    kinds = {}
    for name, parser in _parsers().items():
        a = _option(parser, flag)
        if a is not None and (flag, name) not in OTHER_KIND:
            kinds.setdefault((type(a).__name__, a.type, a.metavar), []).append(name)
    assert len(kinds) == 1, kinds
    shared = _shared().get(flag)
    if shared is not None:
        assert (type(shared).__name__, shared.type, shared.metavar) in kinds, (kinds, shared)


@pytest.mark.parametrize("flag, default", [("--json", False), ("--markdown", False),
                                           ("--launcher", None), ("--data-dir", None),
                                           ("--transport", "auto")])
def test_a_shared_default_is_the_same_in_every_command(flag, default):
    for name, parser in _parsers().items():
        a = _option(parser, flag)
        if a is not None:
            assert a.default == default, (name, flag, a.default)


def test_a_help_ends_with_the_default_it_has():
    p = argparse.ArgumentParser()
    assert options.add_np(p, [1, 2], "rank counts").help == "rank counts (default 1 2)"
    assert options.add_timeout(p, 8.0, "seconds").help == "seconds (default 8)"
    assert options.add_lr(p, None, shown="the model's").help == "learning rate (default: the model's)"
    assert options.add_seed(p, None).help == "training seed"
    assert p.parse_args(["--np", "3", "4"]).np == [3, 4]


def test_nodes_beyond_the_launcher_s_reach_are_named_in_one_wording(monkeypatch):
    """bench scaling (several --nodes) and bench overlap (one) refuse a shape the launcher
    does not reach with the same line, before anything runs."""
    monkeypatch.setattr(cluster, "available_nodes", lambda launcher: 2)
    got = options.node_shapes(["1", "2x2"], 1, "mpirun")
    assert [repr(s) for s in got] == ["1x1", "2x2"]
    with pytest.raises(UsageError, match=r"^--nodes 4x1 3x2: 'mpirun' reaches 2 nodes$"):
        options.node_shapes(["2", "4", "3x2"], 1, "mpirun")
    monkeypatch.setattr(cluster, "available_nodes", lambda launcher: 1)
    with pytest.raises(UsageError, match=r"^--nodes 2x1: 'srun' reaches 1 node$"):
        options.node_shapes(["2"], 1, "srun")
    from ringnet.bench import overlap, scaling
    for main, argv in ((scaling.main, ["--nodes", "1", "2"]), (overlap.main, ["--nodes", "2"])):
        with pytest.raises(UsageError, match=r"^--nodes 2x1: 'mpirun' reaches 1 node$"):
            main(["--launcher", "mpirun", *argv])


@pytest.mark.parametrize("flag", ["--transport", "--device"])
def test_every_command_takes_train_s_choices_and_refuses_others_before_running(flag, capsys):
    """A benchmark that hands --transport or --device on to train takes exactly train's
    choices, so a typo ends at parsing (exit 2), not in the first training run."""
    from ringnet.config import build_parser
    train = set(_option(build_parser(), flag).choices)
    for name, parser in _parsers().items():
        a = _option(parser, flag)
        if a is None:
            continue
        assert set(a.choices) == train, (name, a.choices)
        try:                    # a parser exits 2, or raises the UsageError main exits 2 on
            parser.parse_args([flag, "tpu"])
            raise AssertionError(f"{name} took {flag} tpu")
        except SystemExit as stop:
            assert stop.code == 2
            error = capsys.readouterr().err
        except UsageError as e:
            error = str(e)
        assert f"argument {flag}: invalid choice: 'tpu'" in error, (name, error)
