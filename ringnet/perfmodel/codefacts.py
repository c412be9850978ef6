"""What the code does where it has a choice: the facts the model follows, and their overrides."""
import contextlib

from ringnet.parallel.delayed_update import BOUNDARY_PASSES
from ringnet.parallel.plans import bucket_bytes

__all__ = ["code_facts", "facts", "OLD_FACTS", "BOUNDARY_PASSES", "SGD_PASSES", "boundary_s",
           "describe_facts", "rooted_concurrent"]

# What the code does where it has a choice; a saved validation record replaces it with
# what the code it measured did (see ``code_facts``).
_FACTS = None


def code_facts():
    """The behaviour of the code the model follows: how CPU streams progress, the delay-0
    bucket size, whether rooted communicators receive concurrently in pieces."""
    if _FACTS is not None:
        return dict(_FACTS)
    from ringnet.comm import COMMUNICATORS
    from ringnet.comm.stream import progress_mode
    try:
        from ringnet.config import TrainConfig
        compensation = TrainConfig(model="lenet", mode="ring", delay=1).resolved(2).delay_compensation
    except Exception:                   # noqa: BLE001 - a config that cannot say: the plain one
        compensation = "none"
    # rooted communicators that cut their transfers by a ``pieces`` rule post every
    # sender's piece at once
    # "progress_nodes": how they progress where the ranks span nodes (auto polls there)
    return {"progress": progress_mode(), "progress_nodes": progress_mode(nodes=2),
            "bucket_bytes": bucket_bytes(),
            "rooted_concurrent": all(hasattr(COMMUNICATORS[name], "pieces") for name in ("tree", "master")),
            "delay_compensation": compensation}


@contextlib.contextmanager
def facts(values):
    """Predict as the code described by ``values`` (a ``code_facts()`` dict) ran."""
    global _FACTS
    saved, _FACTS = _FACTS, dict(values)
    try:
        yield
    finally:
        _FACTS = saved


# The code before any of these facts were recorded: threads that poll, no buckets, rooted
# communicators receiving one sender after the other.
OLD_FACTS = {"progress": "poll", "bucket_bytes": 0, "rooted_concurrent": False}


# Element-wise passes of one CPU SGD step with momentum and weight decay (optim.SGD.step):
# the profile's update cost per parameter, over this, is one pass over cold arrays.
SGD_PASSES = 6


def boundary_s(compute, elems, compensation):
    """Seconds of the delay-1 step boundary's element-wise work on ``elems`` parameters: its
    passes (``BOUNDARY_PASSES``) at the cost of one pass of the in-step update."""
    return BOUNDARY_PASSES.get(compensation, 2) * elems * compute.update_s_per_param / SGD_PASSES


def describe_facts(values):
    """One line: the code that ``values`` (a ``code_facts()`` dict) describes."""
    buckets_text = (f"delay-0 buckets of {values['bucket_bytes'] // 1024} KiB"
                    if values["bucket_bytes"] else "no delay-0 buckets")
    rooted = ("tree/master receive all senders at once, in pipeline pieces"
              if values["rooted_concurrent"] else "tree/master receive one sender at a time")
    return (f"CPU streams {values['progress']}, {buckets_text}, {rooted}, delay 1 with "
            f"{values.get('delay_compensation', 'lookahead')} compensation")


def rooted_concurrent():
    """True when a rooted communicator receives from all its senders at once (piece by piece)."""
    return code_facts()["rooted_concurrent"]
