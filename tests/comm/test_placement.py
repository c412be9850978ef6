"""How the device and the transport are chosen, checked on the CPU.

* ``--device cpu`` never reaches CUDA (every CUDA entry point replaced by one that fails);
* the run header and ``--json`` name device, GPU and transport with the reason;
* ranks sharing a GPU (same node, same PCI bus id) are found from the gathered ids;
* ``--transport nccl`` on the CPU is refused in one line unless the stand-in is asked for:
  the library raises :class:`TransportUnavailable` in its own words, the entry points
  (train, bench comm) add the flag to change;
* CUDA-aware MPI: the override wins, otherwise the MPI library itself is asked;
* the NCCL watchdog calls its expiry for an operation past the deadline, not before.
"""
import json
import subprocess
import sys

import numpy as np
import pytest
from mpi4py import MPI

from ringnet import comm as ringcomm
from ringnet.comm import factory
from ringnet.comm.mpi_transport import mpi_cuda_aware
from ringnet.comm.nccl_transport import NcclTransport, _Watchdog
from ringnet.config import TRANSPORT_ADVICE, transport_usage_error
from ringnet.errors import SetupError, TransportUnavailable, UsageError
from conftest import launcher_free_env

WORLD = MPI.COMM_WORLD


@pytest.fixture
def no_cuda(monkeypatch):
    """Make every way into CUDA fail loudly."""
    import ringnet.backend as backend

    def touched(*args, **kwargs):
        raise AssertionError("CUDA was touched")
    for module in (backend, ringcomm):
        for name in ("gpu_available", "bind_device", "check_gpu", "pci_bus_id"):
            if hasattr(module, name):
                monkeypatch.setattr(module, name, touched)
    monkeypatch.setattr(backend, "cupy", None)


@pytest.mark.mpi
@pytest.mark.parametrize("mode", ["ring", "split-fc"])
def test_device_cpu_never_touches_cuda_and_says_what_it_chose(no_cuda, mode):
    from ringnet.config import TrainConfig
    from ringnet.train import train
    result = train(TrainConfig(mode=mode, device="cpu", steps=2, batch_size=12, progress=False,
                               quiet=True, eval_every_epoch=False), world=WORLD)
    result.strategy.close()
    summary = result.summary
    assert summary["device"] == "cpu" and summary["transport"] == "mpi"
    assert summary["gpu"] is None and summary["transport_reason"] == "device cpu"


def test_make_transport_on_the_cpu(no_cuda, monkeypatch):
    transport = ringcomm.make_transport("auto", MPI.COMM_SELF, device="cpu")
    assert transport.name == "mpi" and transport.placement.describe() == "CPU, transport mpi (device cpu)"
    assert not transport.uses_gpu()
    transport.close()
    monkeypatch.delenv("RINGNET_NCCL", raising=False)
    with pytest.raises(TransportUnavailable, match="^transport nccl moves GPU memory") as info:
        ringcomm.make_transport("nccl", MPI.COMM_SELF, device="cpu")
    assert (info.value.reason, info.value.transport) == ("cpu-device", "nccl")
    assert isinstance(info.value, SetupError) and not isinstance(info.value, UsageError)
    assert "--" not in str(info.value)      # library words: no command-line flags
    monkeypatch.setenv("RINGNET_NCCL", "standin")
    standin = ringcomm.make_transport("nccl", MPI.COMM_SELF, device="cpu")
    assert standin.name == "nccl" and "stand-in" in standin.placement.reason
    standin.close()


def test_cli_refuses_nccl_on_the_cpu_in_one_line():
    run = subprocess.run([sys.executable, "-m", "ringnet.train", "--device", "cpu", "--transport",
                          "nccl", "--mode", "ring", "--steps", "1"],
                         capture_output=True, text=True, timeout=120,
                         env={**__import__("os").environ, "RINGNET_NCCL": ""})
    assert run.returncode == 2, run.stderr
    lines = run.stderr.strip().splitlines()
    assert lines == ["ringnet: error: transport nccl moves GPU memory, but the device is the CPU; "
                     "use --transport mpi (or auto)"], lines


def test_bench_comm_refuses_nccl_on_the_cpu_in_one_line():
    run = subprocess.run(["mpirun", "-np", "2", sys.executable, "-m", "ringnet.bench", "comm",
                          "--transport", "nccl", "--sizes", "8"], capture_output=True, text=True,
                         timeout=120,
                         env={**__import__("os").environ, "RINGNET_NCCL": ""})
    assert run.returncode == 2, run.stderr
    assert run.stderr.strip().splitlines() == [
        "ringnet: error: transport nccl moves GPU memory, but the device is the CPU; "
        "use --transport mpi (or auto)"], run.stderr


def test_device_gpu_without_a_gpu_is_a_library_error_and_one_cli_line(monkeypatch):
    import ringnet.backend as backend
    monkeypatch.setattr(backend, "gpu_available", lambda: False)
    with pytest.raises(RuntimeError, match="no usable CUDA GPU") as info:
        backend.get_xp("gpu")
    assert "--" not in str(info.value)      # library words; the command line adds the flag
    run = subprocess.run([sys.executable, "-m", "ringnet.train", "--device", "gpu", "--steps", "1"],
                         capture_output=True, text=True, timeout=120,
                         env={**__import__("os").environ, "CUDA_VISIBLE_DEVICES": ""})
    assert run.returncode == 2, run.stderr
    assert run.stderr.strip().splitlines() == [
        "ringnet: error: --device gpu: no usable CUDA GPU "
        "(CuPy missing or cupy.is_available() is False)"], run.stderr


def test_trace_path_check_is_a_library_error(tmp_path):
    from ringnet.trace import check_trace_path
    (tmp_path / "file").write_text("")
    with pytest.raises(SetupError, match="is not a folder") as info:
        check_trace_path(str(tmp_path / "file" / "t.json"))
    assert "--" not in str(info.value)
    with pytest.raises(SetupError, match="is a folder; give a file name"):
        check_trace_path(str(tmp_path))
    check_trace_path(str(tmp_path / "new" / "t.json"))   # a missing folder is fine: it is made


def test_nccl_transport_without_a_gpu_raises_a_library_error():
    no_nccl = type("NoNccl", (), {})()      # a NCCL module on no GPU: not the host stand-in
    with pytest.raises(TransportUnavailable, match="needs a usable CUDA GPU") as info:
        NcclTransport(MPI.COMM_SELF, nccl=no_nccl)
    assert (info.value.reason, info.value.transport) == ("no-nccl", "nccl")
    assert "--" not in str(info.value)
    assert str(transport_usage_error(info.value)).endswith("; use --transport mpi")


def test_nccl_transport_refuses_ranks_sharing_a_gpu(monkeypatch):
    import ringnet.backend as backend

    class TwoRanksOneGpu:
        def allgather(self, place):
            return [place, ("n2", "0000:5e:00.0"), place]
    monkeypatch.setattr(backend, "pci_bus_id", lambda device: "0000:3b:00.0")
    transport = NcclTransport.__new__(NcclTransport)
    transport.mpi_comm, transport.device_id = TwoRanksOneGpu(), 0
    with pytest.raises(TransportUnavailable, match=r"^ranks 0 and 2 share GPU 0000:3b:00.0 on ") \
            as info:
        transport._check_devices()
    assert info.value.reason == "shared-gpu" and "--" not in str(info.value)
    assert str(transport_usage_error(info.value)).endswith(
        "NCCL needs one GPU per rank; use --transport mpi or start at most one rank per GPU")


def test_every_refusal_has_flag_advice():
    assert set(TRANSPORT_ADVICE) == set(TransportUnavailable.REASONS)
    for reason, advice in TRANSPORT_ADVICE.items():
        message = str(transport_usage_error(TransportUnavailable("it cannot run", reason)))
        assert message == f"it cannot run; {advice}" and "--" in advice
    with pytest.raises(ValueError):
        TransportUnavailable("it cannot run", "no-such-reason")


def test_cli_header_and_json_name_the_transport():
    run = subprocess.run([sys.executable, "-m", "ringnet.train", "--device", "cpu", "--mode", "ring",
                          "--steps", "2", "--json"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    summary = json.loads(run.stdout.strip().splitlines()[-1])
    assert (summary["device"], summary["transport"], summary["transport_reason"]) == \
        ("cpu", "mpi", "device cpu")
    assert "CPU, transport mpi (device cpu)" in run.stderr


def test_shared_gpus_are_found_from_bus_ids():
    own = [("n1", "0000:3b:00.0"), ("n1", "0000:5e:00.0"), ("n2", "0000:3b:00.0")]
    assert factory._shared_gpu(own) is None        # same bus id on another node: not shared
    shared = [("n1", "0000:3b:00.0"), ("n1", "0000:5e:00.0"), ("n1", "0000:3b:00.0")]
    assert factory._shared_gpu(shared).startswith("ranks 0, 2 share GPU 0000:3b:00.0 on n1")


def test_cuda_aware_mpi_override_and_library_query(monkeypatch):
    monkeypatch.setenv("RINGNET_CUDA_AWARE_MPI", "1")
    assert mpi_cuda_aware() == (True, "RINGNET_CUDA_AWARE_MPI=1")
    monkeypatch.setenv("RINGNET_CUDA_AWARE_MPI", "0")
    assert mpi_cuda_aware() == (False, "RINGNET_CUDA_AWARE_MPI=0")
    monkeypatch.setenv("RINGNET_CUDA_AWARE_MPI", "yes")
    with pytest.raises(ValueError):
        mpi_cuda_aware()
    monkeypatch.delenv("RINGNET_CUDA_AWARE_MPI")
    aware, how = mpi_cuda_aware()
    # This MPI (no GPU build) answers through its own query function, and says no.
    assert aware is False and how.startswith("MPIX_"), how


class _Event:
    def __init__(self):
        self.done = False


def test_watchdog_expires_only_past_the_deadline():
    now = [0.0]
    expired = []
    dog = _Watchdog(10.0, expired.append, poll_s=3600, clock=lambda: now[0])
    first, second = _Event(), _Event()
    dog.watch(first, "sendrecv to rank 1 / from rank 3 of 64 bytes")
    now[0] = 5.0
    dog.watch(second, "recv from rank 2 of 8 bytes")
    now[0] = 9.0
    assert dog.check() is None
    first.done = True
    now[0] = 14.0
    assert dog.check() is None                  # the first is done, the second is 9 s old
    now[0] = 15.5
    assert dog.check() == "recv from rank 2 of 8 bytes"
    dog.stop()
    assert np.isfinite(now[0]) and expired == []   # check() reports; the loop calls expire


class _BrokenEvent:
    @property
    def done(self):
        raise RuntimeError("cudaErrorLaunchFailure: unspecified launch failure")


def test_a_device_error_under_the_watchdog_reaches_the_next_call_not_a_dead_thread(monkeypatch):
    import threading
    import types
    died = []
    monkeypatch.setattr(threading, "excepthook", died.append)
    expired = []
    dog = _Watchdog(10.0, expired.append, poll_s=0.001)
    dog.watch(_BrokenEvent(), "allreduce of 64 bytes")
    dog._thread.join(5.0)
    assert not dog._thread.is_alive() and died == [] and expired == []
    assert str(dog.failure).startswith("cudaErrorLaunchFailure")
    transport = types.SimpleNamespace(_expired=None, _watchdog=dog, _comms={}, timeout_s=10.0)
    with pytest.raises(RuntimeError, match="unspecified launch failure"):
        NcclTransport.check_error(transport)
    dog.stop()


def test_nccl_init_past_the_deadline_ends_the_job(tmp_path):
    """Rank 1 never creates its NCCL communicator: rank 0's init watchdog ends the job."""
    import os
    import shutil
    import time
    if shutil.which("mpirun") is None:
        pytest.skip("mpirun not on PATH")
    script = tmp_path / "job.py"
    script.write_text(
        "import time\n"
        "from mpi4py import MPI\n"
        "from ringnet.comm import NcclTransport\n"
        "if MPI.COMM_WORLD.Get_rank() == 0:\n"
        "    NcclTransport(MPI.COMM_WORLD, timeout_s=2, nccl='standin')\n"
        "else:  # the transport's steps before NCCL init, then never joining\n"
        "    MPI.COMM_WORLD.Dup().bcast(None, root=0)\n"
        "    time.sleep(120)\n")
    clean = launcher_free_env("RINGNET_")
    start = time.perf_counter()
    run = subprocess.run(["mpirun", "-np", "2", sys.executable, str(script)], capture_output=True,
                         text=True, timeout=100, env=clean)
    seconds = time.perf_counter() - start
    output = run.stdout + run.stderr
    assert run.returncode != 0, output
    assert "NCCL init of the transport's communicator did not complete within 2 s" in output, \
        f"exit {run.returncode}: {output!r}"
    assert seconds < 60, f"took {seconds:.0f} s"


def test_gpu_extras_bring_cupy_and_its_nccl_per_cuda_major():
    """The README's install lines name extras that bring CuPy *and* the NCCL wheel it loads."""
    import configparser
    import os
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    cfg = configparser.ConfigParser()
    cfg.read(os.path.join(root, "setup.cfg"))
    extras = {name: value.split() for name, value in cfg["options.extras_require"].items()}
    readme = open(os.path.join(root, "README.md")).read()
    for major in ("12", "13"):
        name = f"gpu-cuda{major}"
        assert f'pip install -e ".[{name}]"' in readme
        assert any(r.startswith(f"cupy-cuda{major}x") for r in extras[name]), extras[name]
        assert any(r.startswith(f"nvidia-nccl-cu{major}>=") and r.endswith(",<3")
                   for r in extras[name]), extras[name]
    assert extras["gpu"] == extras["gpu-cuda12"]
