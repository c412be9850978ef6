"""OpenBLAS kernel choice made before NumPy loads (ringnet.blas.configure_blas_kernels)."""
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

from ringnet.blas import openblas_coretype

ROOT = Path(__file__).resolve().parents[1]


def cpuinfo(vendor, family, flags, processors=2):
    block = (f"processor\t: {{}}\nvendor_id\t: {vendor}\ncpu family\t: {family}\n"
             f"model\t\t: 17\nflags\t\t: fpu sse2 {flags} avx2\n\n")
    return "".join(block.format(i) for i in range(processors))


@pytest.mark.parametrize("vendor, family, flags, expected", [
    ("AuthenticAMD", 25, "avx512f avx512bw", "Haswell"),     # Zen 4: the measured case
    ("AuthenticAMD", 25, "fma", None),                       # Zen 3: OpenBLAS picks AVX2 itself
    ("AuthenticAMD", 26, "avx512f avx512bw", None),          # Zen 5: not measured
    ("AuthenticAMD", 23, "fma", None),                       # Zen 1/2
    ("GenuineIntel", 6, "avx512f avx512bw", None),           # Skylake-X and later
    ("GenuineIntel", 25, "avx512f", None),
])
def test_coretype_only_on_zen4(vendor, family, flags, expected):
    assert openblas_coretype(cpuinfo(vendor, family, flags)) == expected


def test_coretype_reads_the_first_processor_and_survives_odd_text():
    mixed = cpuinfo("GenuineIntel", 6, "avx512f", 1) + cpuinfo("AuthenticAMD", 25, "avx512f", 1)
    assert openblas_coretype(mixed) is None
    assert openblas_coretype("") is None
    assert openblas_coretype("garbage\nno fields here\n") is None
    assert openblas_coretype(cpuinfo("AuthenticAMD", 25, "avx512fx avx512_bf16")) is None


def _run(code, **env):
    base = {k: v for k, v in os.environ.items() if k != "OPENBLAS_CORETYPE"}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=120, cwd=ROOT, env=dict(base, **env))
    assert result.returncode == 0, result.stderr
    return result.stdout.strip().splitlines()[-1]


# Pretend to be a Zen 4 (or an Intel CPU), run the programs' setup, then load NumPy and ask
# OpenBLAS which kernels it chose.
PROBE = (
    "import os, ringnet.blas as t\n"
    "t._cpuinfo = lambda: {info!r}\n"
    "t.configure_blas_threads()\n"
    "import numpy\n"
    "try:\n"
    "    from threadpoolctl import threadpool_info\n"
    "    arch = [i.get('architecture') for i in threadpool_info() if i.get('internal_api') == 'openblas']\n"
    "except ImportError:\n"
    "    arch = []\n"
    "print(os.environ.get('OPENBLAS_CORETYPE'), arch[0] if arch else None)\n")


def test_setup_sets_coretype_before_numpy_and_keeps_a_users_choice():
    zen4 = cpuinfo("AuthenticAMD", 25, "avx512f")
    coretype, arch = _run(PROBE.format(info=zen4)).split()
    assert coretype == "Haswell"
    if arch != "None":                        # threadpoolctl and an OpenBLAS NumPy present
        assert arch == "Haswell"
    coretype, arch = _run(PROBE.format(info=zen4), OPENBLAS_CORETYPE="Sandybridge").split()
    assert coretype == "Sandybridge"          # the user's value wins
    if arch != "None":
        assert arch == "Sandybridge"
    coretype, _ = _run(PROBE.format(info=cpuinfo("GenuineIntel", 6, "avx512f"))).split()
    assert coretype == "None"


@pytest.mark.skipif(platform.machine() != "x86_64", reason="x86 CPU detection")
def test_bench_layers_header_names_the_coretype():
    out = subprocess.run([sys.executable, "-m", "ringnet.bench", "layers", "--model", "lenet",
                          "--iters", "1", "--batch-size", "2"], capture_output=True, text=True,
                         timeout=300, cwd=ROOT,
                         env=dict(os.environ, OPENBLAS_CORETYPE="Sandybridge"))
    assert out.returncode == 0, out.stderr
    assert "OPENBLAS_CORETYPE=Sandybridge" in out.stdout.splitlines()[0]
