"""The mode table (ringnet.parallel.MODES) is what the config, --help and README use."""
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
