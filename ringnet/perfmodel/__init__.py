"""python -m ringnet.bench model: predicted step time, speedup and efficiency of every mode, N = 1..1024.

The prediction is built from three measured or stated inputs and the exchange each
mode runs in the code:

* **compute** — per-layer forward/backward time as ``fixed + per_sample * batch``,
  the SGD update time per parameter and the element-wise add of a reduction, measured
  here inside real single-mode training steps (``--compute here``: ``ringnet.train``'s
  own set-up and step, each layer timed between the model's ``layer_hook`` calls, so
  the profile is what a training step does on this CPU, its caches included), read from a JSON file
  (``--compute FILE``, written by ``--save-compute``), or a stated GPU roofline
  (``--compute k40`` / ``h100``);
* **traffic** — the bytes and messages of every collective a step runs, from the
  code's own sizes: ``model.num_params``, ``shard_bounds`` (the ring's shards), the
  split-fc FC blocks (``fc_blocks``) and its conversion-layer buffers;
* **links** — one latency α and bandwidth β per hop, intra-node and inter-node, from
  spec-sheet profiles (``LINKS``) or calibrated on this machine by timing the ring
  communicator under mpirun (profile ``local``).

How each mode is timed (as ``ringnet/comm`` and ``ringnet/parallel`` run it):

=========  ==================================================================
ring       reduce-scatter: N-1 lockstep steps of one shard (P/N) plus its add;
           update of one shard; all-gather: N-1 steps of one shard.
tree       binary heap (children 2v+1, 2v+2): a rank receives both children
           at once (sharing its link) and adds, piece by piece
           (``pipeline_pieces``); the root updates all P; the broadcast relays
           each piece to both children at once.
master     the root receives all N-1 gradients at once per piece (sharing its
           link) and adds them in rank order, updates all P, and sends N-1
           copies at once from its one link.
split-fc   conv part on B/N samples; conversion layer all-gathers (B, F+1)
           features+labels; each FC layer computes out/N rows on B samples and
           all-gathers them; backward reduce-scatters the input gradients;
           conv gradients go round the ring as above (conv parameters only).
auto       (all-reduce table only) the algorithm ``ringnet.comm.cost`` picks,
           by its rounds and bytes.
=========  ==================================================================

Delay 1 runs the exchange on the communication stream beside the next step's compute;
delay 0 runs it in the code's buckets (``backward_buckets``), each starting when the
backward of its first layer ends. The step is laid out layer by layer (``Timeline``)
and the stream's transfers, adds and update are walked beside it (``simulate_ops``): on a
GPU transfers overlap and the adds/update share the device; on the CPU with driven
progress a transfer is noticed at the next layer boundary (the training thread tests
it there), and with a polling thread the exchange moves at a measured fraction ρ of its
blocking speed (the ring's, and the tree's and master's own where the calibration timed
them beside compute) and steals a measured fraction κ of the core. Where the code has a choice
(progress mode, bucket size, concurrent rooted receives) the model reads it from the
code (``code_facts``). Ranks beyond the cores share them: compute takes
``s(N) = max(1, N / cores)`` times as long (``cores``: measured with each model's own step
at its per-rank batch on every rank at once against one alone, waits that sleep; on a quiet
machine the cores the ranks share, :func:`usable_cores`, and never more), and a rank that
blocks on a peer finds it descheduled: a wait of ``scheduling_wait`` once per step and on
each blocking message, from slices the calibration measures (zero while every rank has a
core). While every rank has a core, a delay-0 step also waits for its slowest rank: its
compute is lengthened by the calibration's ``imbalance``, the mean over steps of the
slowest rank's step against the ranks' mean (delay 1 has a step of slack for it). On the CPU
a message is a wait (latency α) and a copy (bytes / β) that the rank's own core makes
inside an MPI call: with driven progress that call is the training thread's test at a
layer boundary, so the copy delays the compute (on a GPU the copy engine moves it).
"""
from ringnet.blas import pin_one_thread

pin_one_thread()     # first: the model times compute core for core

from ringnet.perfmodel.calibration import calibrate  # noqa: E402
from ringnet.perfmodel.cli import build_parser, main  # noqa: E402
from ringnet.perfmodel.codefacts import (BOUNDARY_PASSES, OLD_FACTS, SGD_PASSES,  # noqa: E402
                                           boundary_s, code_facts, facts)
from ringnet.perfmodel.compute import (ISOLATED_LAYERS, TRAINING_STEPS,  # noqa: E402
                                         ComputeProfile, compute_from_json, load_compute,
                                         profile_method)
from ringnet.perfmodel.exchange import allreduce_rows, allreduce_time  # noqa: E402
from ringnet.perfmodel.links import LINKS, Link  # noqa: E402
from ringnet.perfmodel.prediction import Prediction, predict  # noqa: E402
from ringnet.perfmodel.profiling import isolated_compute, measure_compute  # noqa: E402
from ringnet.perfmodel.report import (markdown_paper, markdown_predictions,  # noqa: E402
                                        markdown_validation, plot)
from ringnet.perfmodel.roofline import GPUS, roofline_compute  # noqa: E402
from ringnet.perfmodel.sends import (buckets, messages, ring_phase_bytes,  # noqa: E402
                                       split_fc_plan, traffic)
from ringnet.perfmodel.simulate import Timeline  # noqa: E402
from ringnet.perfmodel.sweeps import MODES, crossovers, paper_rows, sweep  # noqa: E402
from ringnet.perfmodel.profiles import make_system  # noqa: E402
from ringnet.perfmodel.system import System, scheduling_wait, usable_cores  # noqa: E402
from ringnet.perfmodel.validation import (diagnose, measured_note, row_label, validate,  # noqa: E402
                                          validation_rows, SpeedProbe, drift_of, drift_note,
                                          run_speed, row_error_at_run)
from ringnet.perfmodel.worker import LOADED_EXCHANGES  # noqa: E402

__all__ = ["Link", "LINKS", "GPUS", "System", "ComputeProfile", "measure_compute",
           "roofline_compute", "load_compute", "ring_phase_bytes", "traffic", "messages",
           "buckets", "code_facts", "facts", "allreduce_time", "predict", "sweep", "crossovers",
           "validation_rows", "diagnose", "main",
           # and the rest of what the parts offer
           "BOUNDARY_PASSES", "OLD_FACTS", "SGD_PASSES", "boundary_s", "ISOLATED_LAYERS",
           "TRAINING_STEPS", "compute_from_json", "profile_method", "allreduce_rows",
           "Prediction", "isolated_compute", "markdown_paper", "markdown_predictions",
           "markdown_validation", "plot", "split_fc_plan", "Timeline", "MODES", "paper_rows",
           "make_system", "scheduling_wait", "usable_cores", "validate", "calibrate",
           "LOADED_EXCHANGES", "row_label", "measured_note", "SpeedProbe", "run_speed",
           "row_error_at_run",
           "drift_of", "drift_note"]
