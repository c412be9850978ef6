"""What the performance model's tests share: a system of round numbers, a transport that
records what the communicators ask of it, one delay-0 bucket per layer, raw calibration
timings, a validation record, and the ``python -m ringnet.bench model`` command."""
import os
import subprocess
import sys
import types

import numpy as np

from ringnet import perfmodel as pm

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ENV = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
ALPHA, BETA = 1e-3, 1e9          # 1 ms per message, 1 GB/s: hand sums stay readable


def round_system(alpha=ALPHA, beta=BETA, ranks_per_node=1 << 20, add=0.0, update=0.0):
    """A system on one link of ``alpha`` s per message and ``beta`` bytes/s, with K40 compute
    whose adds and updates cost ``add`` s per element and ``update`` s per parameter."""
    compute = pm.roofline_compute("k40", ("lenet",))
    compute.add_s_per_elem, compute.add_s_per_call = add, 0.0
    compute.update_s_per_param, compute.update_s_per_call = update, 0.0
    link = pm.Link("test", alpha, beta)
    return pm.System("test", link, link, ranks_per_node, compute)


class _Done:
    def __init__(self, log=None, entry=None):
        self.log, self.entry = log, entry

    def wait(self):
        if self.log is not None:
            self.log.append(("wait", self.entry))


def recording_transport(rank, size):
    """A Transport that moves nothing and records what the communicator code asks of it:
    ``bytes_sent``, ``messages`` (non-empty sends) and ``log`` (posts and waits in order)."""
    from ringnet.comm.transport import Transport

    class Recording(Transport):
        name = "recording"

        def isendrecv(self, send_array, send_peer, recv_array, recv_peer):
            sent = 0 if send_array is None else send_array.nbytes
            received = 0 if recv_array is None else recv_array.nbytes
            self._count(sent, received)
            self.messages += sent > 0
            entry = (len(self.log), send_peer if sent else None, recv_peer if received else None)
            self.log.append(("post", entry))
            return _Done(self.log, entry)

    world = types.SimpleNamespace(Get_rank=lambda: rank, Get_size=lambda: size)
    transport = Recording(world, timeout_s=1)
    transport.messages, transport.log = 0, []
    return transport


ROOTED_RUNS = {
    "ring": lambda c, buf: (c.reduce_scatter(buf), c.allgather(buf)),
    "tree": lambda c, buf: (c.reduce(buf, root=0), c.bcast(buf, root=0)),
    "master": lambda c, buf: (c.reduce(buf, root=0), c.bcast(buf, root=0)),
}


def record_run(mode, rank, n, length):
    """Rank ``rank`` of ``n`` runs ``mode``'s exchange of ``length`` floats; return its
    recording transport."""
    from ringnet.comm import MasterSlaveCommunicator, RingCommunicator, TreeCommunicator
    classes = {"ring": RingCommunicator, "tree": TreeCommunicator,
               "master": MasterSlaveCommunicator}
    transport = recording_transport(rank, n)
    with np.errstate(all="ignore"):     # receives leave scratch unwritten: adds garbage
        ROOTED_RUNS[mode](classes[mode](transport), np.zeros(length, np.float32))
    return transport


def layer_parts(model):
    """One part per layer with parameters, last layers first (the shape of the code's buckets)."""
    from ringnet.parallel.plans import layer_param_ranges
    per_layer = layer_param_ranges(model)
    return [(lo, hi, layer) for layer, (lo, hi) in sorted(per_layer.items(), reverse=True)]


def waits_raw(n, first, per_msg, idle_alpha=1e-3):
    """Raw calibration timings whose loaded small exchanges took ``first`` more (the wait for
    peers) plus ``per_msg`` more per message than the same exchanges entered idle."""
    msgs = 2 * (n - 1)
    waits = {}
    for count in pm.LOADED_EXCHANGES:
        waits[f"idle{count}"] = count * msgs * idle_alpha
        waits[f"loaded{count}"] = waits[f"idle{count}"] + first + count * msgs * per_msg
    return {"cores": 2, "solo_s": 0.02, "together_s": 0.04,
            "blocking": {"4096": 0.004, "1048576": 0.010}, "streamed": {}, "waits": waits}


def validation_record(measured, code=None):
    """A validation record of one round: K40 compute on a CPU, a calibration at N = 2, the
    ``measured`` rows, and the ``code`` facts it ran with (None: a record that named none)."""
    compute = pm.roofline_compute("k40", ("lenet",)).to_json()
    compute["device"] = "cpu"
    raw = {"solo_s": 0.02, "together_s": 0.02,
           "blocking": {"4096": 0.004, "1048576": 0.010},
           "streamed": {"1048576": [0.020, 0.040]}}
    record = {"batch_size": 64, "steps": 5,
              "rounds": [{"compute": compute, "calibration": {"by_np": {"2": {"raw": raw}}},
                          "measured": measured}]}
    if code is not None:
        record["code"] = code
    return record


def run_model_cli(*args, timeout=240):
    """Run ``python -m ringnet.bench model args`` in the repository; return the
    CompletedProcess."""
    return subprocess.run([sys.executable, "-m", "ringnet.bench", "model", *args],
                          capture_output=True, text=True, env=ENV, timeout=timeout, cwd=ROOT)
