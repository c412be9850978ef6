"""The layout of the package: every import goes down the layers (lazy ones too), and no
module outgrows one concept.

The layers are DESIGN.md's, bottom up. A module may import from its own layer and from
the layers under it, never from one above: a transport that imported the training loop,
or an error type that imported a transport, would tie the lower layer to the upper one.
"""
import ast
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "ringnet"

# Bottom up. A module's layer is that of the longest prefix listed here.
LAYERS = [
    ("foundation", ["ringnet", "ringnet.errors", "ringnet.blas", "ringnet.backend",
                    "ringnet.stats", "ringnet.progress", "ringnet.shutdown", "ringnet.placement",
                    "ringnet.shards", "ringnet.tables", "ringnet.workers"]),
    ("control plane", ["ringnet.control", "ringnet.cli", "ringnet.trace"]),
    ("compute", ["ringnet.layers", "ringnet.models", "ringnet.optim", "ringnet.graphs"]),
    ("communication", ["ringnet.comm"]),
    ("strategies", ["ringnet.parallel"]),
    ("data and state", ["ringnet.data", "ringnet.checkpoint", "ringnet.autosave"]),
    ("runs", ["ringnet.config", "ringnet.environment", "ringnet.stopping", "ringnet.resume",
              "ringnet.hosts", "ringnet.attempt", "ringnet.evaluation", "ringnet.cluster",
              "ringnet.jobs"]),
    ("programs", ["ringnet.train", "ringnet.launch", "ringnet.datasets", "ringnet.data.__main__"]),
    ("testing", ["ringnet.testing"]),
    # the performance model: a package of its own that uses the library, never a benchmark
    ("performance model", ["ringnet.perfmodel"]),
    ("benchmarks", ["ringnet.bench"]),
]
MAX_LINES = 600
# The imports up the layers, each of testing code (as numpy.testing is) and lazy (inside a
# function: test_the_imports_up_the_layers_are_lazy): the NCCL transport loads the stand-in
# of CUDA and NCCL only when RINGNET_NCCL=standin asks for it, and the kernel launcher the
# kernels' NumPy emulations only when it is handed NumPy arrays (the tests; the layers
# launch kernels only on CuPy arrays).
ALLOWED_UP = {("ringnet.comm.nccl_transport", "ringnet.testing.nccl_standin"),
              ("ringnet.layers.cuda_registry", "ringnet.testing.cuda_emulation")}


def _module(path):
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _layer(name):
    best = None
    for index, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if (name == prefix or name.startswith(prefix + ".")) and \
                    (best is None or len(prefix) > len(best[1])):
                best = (index, prefix)
    assert best is not None, f"{name} is in no layer of {__file__}"
    return best[0]


def _imports(path, loading=False):
    """Every ringnet module ``path`` imports, at module level or inside a function (only
    those its loading imports, outside every function, with ``loading``): [(line, module)];
    ``from ringnet.x import y`` counts as ringnet.x.y where that is a module."""
    found = []
    tree = ast.parse(path.read_text(), str(path))
    lazy = {id(node) for fn in ast.walk(tree) if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef))
            for node in ast.walk(fn)} if loading else set()
    for node in ast.walk(tree):
        if id(node) in lazy:
            continue
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and \
                (node.module == "ringnet" or node.module.startswith("ringnet.")):
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                as_path = PACKAGE.parent / full.replace(".", "/")
                is_module = as_path.with_suffix(".py").exists() or (as_path / "__init__.py").exists()
                found.append((node.lineno, full if is_module else node.module))
        elif isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if a.name.startswith("ringnet")]
    return found


SOURCES = sorted(PACKAGE.rglob("*.py"))


def test_the_layers_name_every_module():
    assert SOURCES
    for path in SOURCES:
        _layer(_module(path))


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(PACKAGE.parent)))
def test_imports_go_down_the_layers(path):
    name = _module(path)
    mine = _layer(name)
    upward = [f"line {line}: {target} ({LAYERS[_layer(target)][0]})"
              for line, target in _imports(path)
              if _layer(target) > mine and (name, target) not in ALLOWED_UP]
    assert not upward, f"{name} ({LAYERS[mine][0]}) imports from above: " + "; ".join(upward)


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(PACKAGE.parent)))
def test_no_module_outgrows_one_concept(path):
    lines = len(path.read_text().splitlines())
    assert lines <= MAX_LINES, f"{path.relative_to(PACKAGE.parent)} has {lines} lines"


@pytest.mark.parametrize("importer,target", sorted(ALLOWED_UP))
def test_the_imports_up_the_layers_are_lazy(importer, target):
    """Loading a library module loads no testing code: each import up is in a function."""
    path = PACKAGE.parent / (importer.replace(".", "/") + ".py")
    assert target in [t for _, t in _imports(path)]
    assert target not in [t for _, t in _imports(path, loading=True)]


def test_the_checks_catch_an_upward_import_and_a_long_module(tmp_path):
    """The checks themselves: an error type importing a transport is upward, a transport
    importing an error type is not."""
    assert _layer("ringnet.errors") < _layer("ringnet.comm.transport") < _layer("ringnet.train")
    assert _layer("ringnet.data.__main__") > _layer("ringnet.data.loader")
    assert _layer("ringnet.train") < _layer("ringnet.perfmodel.profiling") < _layer("ringnet.bench")
    fake = PACKAGE / "errors.py"
    imports = _imports(fake)
    assert all(_layer(t) <= _layer("ringnet.errors") for _, t in imports)
    probe = tmp_path / "probe.py"
    probe.write_text("def f():\n    from ringnet import placement\n    from ringnet.train import train\n")
    assert [t for _, t in _imports(probe)] == ["ringnet.placement", "ringnet.train"]
    probe.write_text("from ringnet import errors\n\ndef f():\n    from ringnet import train\n")
    assert [t for _, t in _imports(probe, loading=True)] == ["ringnet.errors"]


def _cycles(package):
    """The import circles among ``package``'s modules (lazy imports too; the package's own
    ``__init__``, which re-exports them, left out): [[module, ..., module]]."""
    modules = {_module(p): p for p in SOURCES if _module(p).startswith(package + ".")}
    edges = {m: {t for _, t in _imports(p) if t in modules and t != m} for m, p in modules.items()}
    order = sorted(modules)
    found = []

    def walk(start, node, path):
        for target in sorted(edges[node]):
            if target == start:
                found.append(path + [start])
            elif target not in path and order.index(target) > order.index(start):
                walk(start, target, path + [target])
    for start in order:
        walk(start, start, [start])
    return found


def test_the_communication_modules_import_in_no_circle():
    """A communicator is handed its transport: nothing in ringnet.comm imports the factory
    that imports the communicators."""
    assert _cycles("ringnet.comm") == []


def test_no_modules_import_in_a_circle():
    """Nowhere in the package: the kernels' registry below the kernels, a System by name
    above the calibration, the stand-in's buffers' devices in its devices module."""
    assert _cycles("ringnet") == []


def test_the_circle_check_finds_a_circle(monkeypatch):
    """The check itself: a lazy import back from the registry to the kernels is a circle."""
    real = _imports
    registry = PACKAGE / "layers" / "cuda_registry.py"

    def imports(path, loading=False):
        found = real(path, loading)
        return found + ([(0, "ringnet.layers.cuda_kernels")]
                        if path == registry and not loading else [])
    monkeypatch.setattr(sys.modules[__name__], "_imports", imports)
    assert ["ringnet.layers.cuda_kernels", "ringnet.layers.cuda_registry",
            "ringnet.layers.cuda_kernels"] in _cycles("ringnet.layers")


def _private_imports(path):
    """[(line, module, name)]: ``from ringnet.x import _name`` in ``path`` (another module's
    private name; ``import public as _alias`` is not one)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("ringnet"):
            found += [(node.lineno, node.module, alias.name) for alias in node.names
                      if alias.name.startswith("_") and not alias.name.startswith("__")]
    return found


def test_no_module_imports_another_s_private_name(tmp_path):
    taken = [(str(p.relative_to(PACKAGE.parent)), *hit) for p in SOURCES for hit in _private_imports(p)]
    assert taken == [], taken
    probe = tmp_path / "probe.py"          # the check itself
    probe.write_text("from ringnet.comm import stream as _stream\n"
                     "from ringnet.comm.cost import (ALPHA,\n    _fold)\n")
    assert _private_imports(probe) == [(2, "ringnet.comm.cost", "_fold")]
