"""ringnet.allocator: glibc's thresholds fixed at program start, the user's settings kept."""
import os
import subprocess
import sys
import textwrap

import pytest

from ringnet.allocator import KEEP_BYTES, configure_allocator


class _Libc:
    """A C library stand-in that records mallopt calls (glibc: has gnu_get_libc_version)."""

    def __init__(self, glibc=True, accepts=True):
        self.calls = []
        if glibc:
            self.gnu_get_libc_version = lambda: b"2.36"

        def mallopt(option, value):          # a function: ctypes' argtypes can be set on it
            self.calls.append((option, value))
            return 1 if accepts else 0
        self.mallopt = mallopt


def test_thresholds_are_fixed_mmap_first():
    libc = _Libc()
    assert configure_allocator({}, libc) is True
    assert libc.calls == [(-3, KEEP_BYTES), (-1, KEEP_BYTES)]


@pytest.mark.parametrize("environ", [{"RINGNET_MALLOC": "0"}, {"MALLOC_ARENA_MAX": "2"},
                                     {"MALLOC_TRIM_THRESHOLD_": "0"},
                                     {"GLIBC_TUNABLES": "glibc.malloc.tcache_count=0"}])
def test_the_users_choice_is_kept(environ):
    libc = _Libc()
    assert configure_allocator(environ, libc) is False and libc.calls == []


def test_other_c_libraries_and_refusals_change_nothing():
    libc = _Libc(glibc=False)
    assert configure_allocator({}, libc) is False and libc.calls == []
    assert configure_allocator({}, _Libc(accepts=False)) is False


_ROUNDS = textwrap.dedent("""
    import resource, sys
    import numpy as np
    if sys.argv[1] == "on":
        from ringnet.allocator import configure_allocator
        assert configure_allocator()
    sizes = [3 << 20, 9 << 20, 5 << 20, 12 << 20, 2 << 20, 7 << 20]
    def step():
        live = [np.ones(s // 8) for s in sizes]     # a step's arrays, then all freed
        del live
    for _ in range(3):
        step()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(10):
        step()
    print((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 10)
""")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc on Linux")
def test_a_steps_freed_arrays_come_back_without_page_faults():
    """Arrays of 2-12 MiB live together, then freed, step after step: with glibc's
    defaults the heap's top goes back to the system and every step faults its pages in
    again (about 2,000 faults here); with the thresholds fixed, none."""
    env = {k: v for k, v in os.environ.items()
           if k != "RINGNET_MALLOC" and not k.startswith("MALLOC_") and k != "GLIBC_TUNABLES"}
    faults = {}
    for mode in ("off", "on"):
        out = subprocess.run([sys.executable, "-c", _ROUNDS, mode], env=env, check=True,
                             capture_output=True, text=True).stdout
        faults[mode] = float(out.split()[-1])
    assert faults["on"] < 50 < 500 < faults["off"], faults
