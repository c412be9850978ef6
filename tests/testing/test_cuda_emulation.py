"""The NumPy emulations of the CUDA kernels (ringnet/testing/cuda_emulation.py) against the
kernels' declarations (ringnet/layers/cuda_kernels.py) and their shared index arithmetic.

Every declared kernel has exactly one emulation, with its parameters; every expression of
a CUDA body appears in its emulation (an index typo in the CUDA source fails here, without
a GPU), the index arithmetic the bodies share as the call of the helper that emulates it;
the helpers themselves against their definitions. What the emulations compute is checked
against the NumPy layers in tests/layers/test_cuda_kernels.py and test_loss_kernel.py.
"""
import inspect
import re
import subprocess
import sys

import numpy as np
import pytest

from ringnet.layers import cuda_kernels
from ringnet.testing import cuda_emulation
from ringnet.testing.cuda_emulation import gather, taps, unravel, windows


def test_every_kernel_has_one_emulation_with_its_parameters():
    assert sorted(cuda_emulation.EMULATIONS) == sorted(cuda_kernels.KERNELS)
    for name, (params, body) in cuda_kernels.KERNELS.items():
        emulation = cuda_emulation.EMULATIONS[name]
        assert [p for p, _ in params] == list(inspect.signature(emulation).parameters), name
        for pname, _ in params:
            assert pname in body, f"{name}: {pname} unused in the CUDA body"


def test_a_kernel_takes_no_second_emulation_nor_declaration():
    before = dict(cuda_emulation.EMULATIONS), dict(cuda_kernels.KERNELS)
    with pytest.raises(ValueError, match="maxpool_fwd"):
        cuda_emulation.emulates("maxpool_fwd")(lambda: None)
    with pytest.raises(ValueError, match="maxpool_fwd"):
        cuda_kernels.declare_kernel("maxpool_fwd", [], "")
    assert (cuda_emulation.EMULATIONS, cuda_kernels.KERNELS) == before


# --- each CUDA body's expressions in its emulation

def _normal(text):
    """Return C or Python text with casts, blanks and parentheses removed, C operators as
    Python's: a typo-level fingerprint of an expression."""
    for cast in ("(unsigned long long)", "(long long)", "(unsigned char)", "(int)", "(T)"):
        text = text.replace(cast, "")
    text = text.replace("||", "|").replace("&&", "&").replace("/", "//").replace("////", "//")
    return "".join(ch for ch in text if ch not in " \n()")


# The index arithmetic the bodies share, and the helper call that emulates each fragment.
_FOR = r" *for \(int (?P<i>\w+) = 0; (?P=i) < (?P<k>\w+); \+\+(?P=i)\) \{\n"
_SHARED = [
    (re.compile(_FOR + r" *int (?P<r>\w+) = (?P<out>\w+) \* (?P<s>\w+) \+ (?P=i) - (?P<p>\w+);\n"
                r" *if \((?P=r) < 0 \|\| (?P=r) >= (?P<size>\w+)\) continue;\n"),
     "for {i}, {r}, lane_{i} in taps({out}, {k}, {s}, {p}, {size})"),
    (re.compile(_FOR + r" *int (?P<d>\w+) = (?P<pos>\w+) \+ (?P<p>\w+) - (?P=i);\n"
                r" *if \((?P=d) < 0 \|\| (?P=d) % (?P<s>\w+) != 0\) continue;\n"
                r" *int (?P<o>\w+) = (?P=d) / (?P=s);\n"
                r" *if \((?P=o) >= (?P<size>\w+)\) continue;\n"),
     "for {i}, {o}, lane_{i} in windows({pos}, {k}, {s}, {p}, {size})"),
]
_SPLIT = re.compile(r" *int (\w+) = \(int\)\(idx % (\w+)\);\n *long long rest = idx / \2;\n"
                    r"((?: *int \w+ = \(int\)\(rest % \w+\);\n *rest /= \w+;\n)*)"
                    r" *int (\w+) = \(int\)\(rest % (\w+)\);\n *long long (\w+) = rest / \5;\n")


def _unravel(match):
    """The :func:`unravel` call of a CUDA split of the thread index; None unless every
    ``rest /=`` divides by the size just taken the remainder of."""
    middle = re.findall(r"int (\w+) = \(int\)\(rest % (\w+)\);\n *rest /= (\w+);", match[3])
    if any(size != divisor for _, size, divisor in middle):
        return None
    parts = [(match[1], match[2])] + [(name, size) for name, size, _ in middle] + \
        [(match[4], match[5])]
    names = [match[6]] + [name for name, _ in reversed(parts)]
    sizes = [size for _, size in reversed(parts)]
    return f"{', '.join(names)} = unravel(lanes(n), {', '.join(sizes)})"


def _shared(body):
    """Return (the body without its shared index arithmetic, the helper calls for it)."""
    calls = []

    def cut(call):
        calls.append(call)
        return ""
    for pattern, call in _SHARED:
        body = pattern.sub(lambda m, call=call: cut(call.format(**m.groupdict())), body)
    body = _SPLIT.sub(lambda m: cut(_unravel(m)) if _unravel(m) else m[0], body)
    return body, calls


def _cuda_statements(body):
    """Yield the expressions of a CUDA body that its emulation must contain: the helper
    calls of its shared index arithmetic, loop bounds, conditions, integer right-hand sides
    and every subscript."""
    body, calls = _shared(body)
    yield from calls
    for var, bound in re.findall(r"for \(int (\w+) = 0; \1 < (\w+); \+\+\1\)", body):
        yield f"for {var} in range({bound})"
    for line in body.splitlines():
        match = re.search(r"\bif \((.*)\)", line)
        if match:
            yield re.sub(r"\) (continue;|acc \+=.*|\{)$", "", match.group(1))
        match = re.match(r"\s*(?:int|long long) \w+ = (.*);", line) or \
            re.match(r"\s*(\w+ /= .*);", line)
        if match and not re.fullmatch(r"\d+", match.group(1)):
            yield match.group(1)
        for index in re.findall(r"\w+\[([^\]]+)\]", line):
            if index != "idx":
                yield index


def _emulated(name):
    source = inspect.getsource(cuda_emulation.EMULATIONS[name])
    return _normal(source[source.index("\ndef "):])          # after the decorator


ELEMENTWISE = {  # kernel -> the expressions its CUDA body and its emulation both contain
    "relu_fwd": ["v = x[idx]", "v > (T)0 || v != v"],
    "relu_bwd": ["dy[idx] * (T)(y[idx] > (T)0)"],
    "relu_bwd_bias": ["idx = (o * n + c) * inner + t", "dy[idx] * (T)(y[idx] > (T)0)",
                      "dx[idx] = g", "acc += g", "dbias[c] = acc"],
    "xent_total": ["acc += row_loss[b]", "count += hit[b]",
                   "acc / (T)B"],
    "step_record": ["ring_loss[slot] = loss[0]", "ring_correct[slot] = correct[0]"],
}
SPLITS = ["maxpool_fwd", "maxpool_bwd", "avgpool_fwd", "avgpool_bwd", "col2im", "im2col"]


@pytest.mark.parametrize("name", [k for k in cuda_kernels.KERNELS
                                  if k != "dropout_mask" and k not in ELEMENTWISE])
def test_cuda_bodies_and_emulations_compute_the_same_expressions(name):
    # The emulation is what the CPU tests run against the NumPy layers; each expression of
    # the CUDA body must appear in it (casts, blanks, parentheses and operator spelling
    # aside; the shared index arithmetic as its helper's call), so an index typo in the
    # CUDA source fails here, without a GPU.
    params, body = cuda_kernels.KERNELS[name]
    statements = list(_cuda_statements(body))
    assert len(statements) >= 4, statements
    if name in SPLITS:                                    # the thread index split is shared
        assert any("= unravel(" in s for s in statements), statements
    missing = [s for s in statements if _normal(s) not in _emulated(name)]
    assert not missing, f"{name}: not in the emulation: {missing}"


@pytest.mark.parametrize("name", list(ELEMENTWISE))
def test_elementwise_bodies_and_emulations_compute_the_same_expressions(name):
    params, body = cuda_kernels.KERNELS[name]
    for expr in ELEMENTWISE[name]:
        assert expr in body, f"{name}: {expr!r} not in the CUDA body"
        assert _normal(expr) in _emulated(name), f"{name}: {expr!r} not in the emulation"


def test_a_typo_in_the_shared_index_arithmetic_of_a_body_is_caught():
    params, body = cuda_kernels.KERNELS["maxpool_fwd"]
    emulated = _emulated("maxpool_fwd")
    for good, typo in [("rest /= Wo;", "rest /= Ho;"), ("idx / B;", "idx / Wo;"),
                       ("ox * sw + j - pw", "ox * sw + j - ph"), ("r >= H", "r >= W"),
                       ("rest / Ho;", "rest / Wo;")]:
        assert good in body
        broken = [s for s in _cuda_statements(body.replace(good, typo))
                  if _normal(s) not in emulated]
        assert broken, typo
    params, body = cuda_kernels.KERNELS["col2im"]
    for good, typo in [("dq % sw", "dq % sh"), ("ox >= Wo", "ox >= Ho"), ("r + ph - i", "r + pw - i")]:
        assert good in body
        assert [s for s in _cuda_statements(body.replace(good, typo))
                if _normal(s) not in _emulated("col2im")], typo


# --- the shared helpers against their definitions

def test_unravel_splits_as_the_row_major_index_does():
    idx = np.arange(7 * 4 * 5 * 3, dtype=np.int64)
    np.testing.assert_array_equal(np.stack(unravel(idx, 4, 5, 3)),
                                  np.stack(np.unravel_index(idx, (7, 4, 5, 3))))
    np.testing.assert_array_equal(unravel(idx, 3)[0], idx // 3)     # the outermost unbounded
    c, i, j, oy, ox, b = unravel(idx, 2, 3, 2, 5, 1)
    np.testing.assert_array_equal(((((c * 2 + i) * 3 + j) * 2 + oy) * 5 + ox) * 1 + b, idx)


@pytest.mark.parametrize("k,stride,pad,size", [(3, 2, 1, 7), (2, 2, 0, 8), (4, 3, 2, 9),
                                               (1, 1, 0, 1), (3, 1, 1, 5), (2, 3, 1, 6)])
def test_taps_and_windows_walk_each_window_from_both_ends(k, stride, pad, size):
    # taps: the window at output o reads inputs o*stride - pad + i (those inside [0, size));
    # windows: for each input, the (tap, output) pairs that read it, the inverse relation.
    outs = -(-(size + 2 * pad - k) // stride) + 1
    out = np.arange(outs)
    read = {(int(o), i, int(r[o])) for i, r, lane in taps(out, k, stride, pad, size)
            for o in out[lane]}
    assert read == {(o, i, o * stride - pad + i) for o in range(outs) for i in range(k)
                    if 0 <= o * stride - pad + i < size}
    pos = np.arange(size)
    covered = {(int(o[p]), i, int(p)) for i, o, lane in windows(pos, k, stride, pad, outs)
               for p in pos[lane]}
    assert covered == read


def test_gather_reads_only_the_active_lanes():
    a = np.array([10.0, 11.0, 12.0])
    lane = np.array([True, False, True, False])
    got = gather(a, lane, np.array([2, 99, 1, -7]))         # masked lanes: any index
    np.testing.assert_array_equal(got[lane], [12.0, 11.0])
    np.testing.assert_array_equal(got[~lane], [10.0, 10.0])


def test_a_training_step_on_numpy_loads_no_testing_code():
    # launch imports the emulations only for NumPy arrays, and the layers call the kernels
    # only on CuPy arrays: the CPU path of a training step never loads ringnet.testing.
    code = ("import sys\nimport numpy as np\nfrom ringnet import models, train, optim\n"
            "for name in ('carnet', 'lenet'):\n"
            "    m = models.build_model(name, seed=0)\n"
            "    x = np.random.default_rng(0).normal(size=(4,) + m.input_shape).astype(m.dtype)\n"
            "    m.loss_and_grad(x, np.arange(4) % m.num_classes)\n"
            "print(sorted(k for k in sys.modules if k.startswith('ringnet.testing')))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
