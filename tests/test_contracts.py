"""Contracts of the public surfaces that no other test pins down."""
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
THREAD_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")


def _python(code, **env):
    base = {k: v for k, v in os.environ.items()
            if k not in THREAD_VARS and k != "RINGNET_BLAS_THREADS"}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=120, cwd=ROOT, env=dict(base, **env))
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_importing_ringnet_leaves_the_environment_alone():
    out = _python(
        "import json, os\n"
        "before = dict(os.environ)\n"
        "import ringnet, ringnet.parallel, ringnet.models, ringnet.data, ringnet.train, ringnet.stats\n"
        "changed = {k: os.environ.get(k) for k in set(before) | set(os.environ)\n"
        "           if before.get(k) != os.environ.get(k)}\n"
        "print(json.dumps(changed))\n")
    assert json.loads(out) == {}, "importing ringnet changed the environment"


def test_the_train_program_pins_blas_threads_before_numpy():
    out = _python(
        "import os, runpy, sys\n"
        "sys.argv = ['ringnet.train', '--help']\n"
        "try:\n"
        "    runpy.run_module('ringnet.train', run_name='__main__')\n"
        "except SystemExit:\n"
        "    pass\n"
        "print('PINNED', os.environ.get('OPENBLAS_NUM_THREADS'))\n",
        RINGNET_BLAS_THREADS="3")
    assert out.strip().splitlines()[-1] == "PINNED 3"
