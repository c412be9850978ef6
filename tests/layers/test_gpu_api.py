"""The array code that runs on the GPU uses only what CuPy has: checked without a GPU.

Every ``xp.NAME`` / ``xp.a.b`` chain in ringnet (``xp`` is the array module, NumPy or CuPy)
must resolve on the installed CuPy, which imports without a GPU. A name NumPy has and CuPy
lacks would fail only on a GPU machine; this finds it on any machine with the gpu extra.
"""
import ast
import os

import pytest

cupy = pytest.importorskip("cupy", reason="CuPy not installed (pip install -e \".[gpu-cuda12]\")")

ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "ringnet")


def _chains(tree, root="xp"):
    """Yield (lineno, 'a.b.c') for each outermost attribute chain rooted at Name ``root``."""
    inner = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute):
            inner.add(id(node.value))
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute) or id(node) in inner:
            continue
        parts, cur = [], node
        while isinstance(cur, ast.Attribute):
            parts.append(cur.attr)
            cur = cur.value
        if isinstance(cur, ast.Name) and cur.id == root:
            yield node.lineno, ".".join(reversed(parts))


def _uses():
    for folder, _, files in os.walk(ROOT):
        for name in sorted(files):
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                with open(path) as f:
                    tree = ast.parse(f.read(), path)
                for lineno, chain in _chains(tree):
                    yield os.path.relpath(path, os.path.dirname(ROOT)), lineno, chain


def _missing(uses):
    """Return one line per chain whose module-level part CuPy does not have."""
    missing = []
    for path, lineno, chain in uses:
        obj = cupy
        for part in chain.split("."):
            if not hasattr(obj, part):
                missing.append(f"{path}:{lineno}: xp.{chain} ({part} missing in CuPy "
                               f"{cupy.__version__})")
                break
            obj = getattr(obj, part)
            if not isinstance(obj, type(cupy)):
                break           # past the modules: a function or class CuPy has
    return missing


def test_every_xp_name_exists_in_cupy():
    uses = list(_uses())
    assert len(uses) > 30, "the scan found almost no xp.NAME: is ROOT right?"
    missing = _missing(uses)
    assert not missing, "\n".join(missing)


def test_the_scan_catches_a_name_cupy_lacks():
    source = ("def f(xp, a):\n"
              "    b = xp.lib.stride_tricks.as_strided(a, (2,), (8,))\n"
              "    return xp.lib.stride_tricks.no_such_view(b), xp.no_such_function(a), xp.maximum(a, 0)\n")
    uses = [("f.py", n, c) for n, c in _chains(ast.parse(source))]
    assert sorted(c for _, _, c in uses) == ["lib.stride_tricks.as_strided",
                                             "lib.stride_tricks.no_such_view", "maximum",
                                             "no_such_function"]
    found = _missing(uses)
    assert len(found) == 2 and "no_such_view" in " ".join(found) and "no_such_function" in " ".join(found)
