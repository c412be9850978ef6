"""One step laid out layer by layer (:class:`Timeline`) and the stream's work walked beside it."""
import dataclasses

from ringnet.perfmodel.codefacts import code_facts

__all__ = ["Timeline"]


def progress_of(system, n=1):
    """How the stream's transfers progress beside the compute: gpu, driven, poll or block;
    N ranks placed on several nodes (``placed_per_node``) progress as the code does there."""
    if system.cores is None:
        return "gpu"
    facts = code_facts()
    if system.placed_per_node and n > system.placed_per_node:
        return facts.get("progress_nodes", facts["progress"])
    return facts["progress"]


@dataclasses.dataclass
class Timeline:
    """One step's compute on the training thread: where it calls the streams' progress.

    ``points``: times of the layer boundaries (the strategy's hook progresses the
    streams there); ``dense``: intervals in which the thread waits in MPI itself (a
    blocking collective), which progresses the streams all along; ``ready``: the time
    the backward of each layer index ends; ``end``: when the compute ends.
    """
    points: list
    dense: list
    ready: dict
    end: float

    def held(self, after_s, rate, burst=1.0):
        """The same compute where the thread runs at ``burst`` of full speed for the first
        ``after_s`` of its work and at ``rate`` of it from then on (a CFS quota's budget
        spent): a time t of the full-speed timeline becomes t / burst up to ``after_s``, and
        after_s / burst + (t - after_s) / rate past it."""
        def warp(t):
            return t / burst if t <= after_s else after_s / burst + (t - after_s) / rate
        return Timeline([warp(p) for p in self.points], [(warp(a), warp(b)) for a, b in self.dense],
                        {k: warp(t) for k, t in self.ready.items()}, warp(self.end))

    def next_progress(self, t, shift):
        """First time >= t at which the training thread progresses (compute delayed by ``shift``)."""
        for a, b in self.dense:
            if a + shift <= t <= b + shift:
                return t
        later = [p + shift for p in self.points if p + shift >= t]
        later += [a + shift for a, _ in self.dense if a + shift >= t]
        return min(later) if later else t


def layer_timeline(cp, model, segments, slow):
    """Build a Timeline from [("fwd"|"bwd", layer index, batch, share) | ("dense", seconds)]."""
    t, points, dense, ready = 0.0, [], [], {}
    for seg in segments:
        if seg[0] == "dense":
            dense.append((t, t + seg[1]))
            t += seg[1]
            continue
        kind, index, batch, share = seg
        fwd, bwd = cp.layer(model.name, model.layers[index][0], batch, share)
        t += (fwd if kind == "fwd" else bwd) * slow
        points.append(t)
        if kind == "bwd":
            ready[index] = t
    return Timeline(points, dense, ready, t)


def simulate_ops(system, timeline, ops, progress, rates=None):
    """Step time when ``ops`` [(ready time, items)] run in order on the stream beside the compute.

    A transfer is a wait ("msg") and a copy ("copy"); together they take its blocking time.
    The copy is the rank's own core's work inside MPI: with driven progress the training
    thread's test makes it, so it delays the compute. How the wait ends depends on
    ``progress``, as the code runs it: ``driven`` (the stream's thread sleeps until the training thread tests the
    transfer at a layer boundary, or all along while it waits in MPI, or at the end of the
    step when it waits for the stream), ``poll``/``block`` (the stream's thread polls: the
    transfer moves at the calibrated ``rate`` of its blocking speed and takes ``steal`` of
    the core meanwhile), ``gpu`` (transfers overlap the compute). The stream's adds and
    update are work on the rank's core (or device): they delay the compute unless a spare
    core is free. ``rates``: per op, the rate its transfers move at beside compute where
    it is not the calibrated one (None: the calibrated ``rate`` for every op).
    """
    n_spare = progress != "gpu" and system.cores is not None and system.cores >= 2 * system.ranks_here
    shift, t = 0.0, 0.0
    steal = min(system.steal, 0.9)
    for k, (ready, items) in enumerate(ops):
        rate = max(system.rate if rates is None else rates[k], 1e-3)
        t = max(t, ready + shift)
        for kind, seconds in items:
            computing = t < timeline.end + shift
            if kind == "peer":                  # beside compute the calibrated rate holds it
                if not computing:
                    t += seconds
                continue
            if kind == "cpu":
                if computing and not n_spare:
                    shift += seconds
                t += seconds
                continue
            if not computing or progress == "gpu":
                t += seconds
            elif progress == "driven":
                # the copy is the training thread's work; the transfer moves at the rate the
                # calibration measured beside compute progressed at layer boundaries (1 where
                # none was measured) and is noticed at the next boundary
                if kind == "copy":
                    shift += seconds
                span, left = seconds / rate, timeline.end + shift - t
                if span <= left:
                    t = timeline.next_progress(t + span, shift)
                else:                           # the compute ends first: the rest at full speed
                    t += left + seconds - rate * left
            else:                               # poll, block: the calibrated rate and steal
                span = seconds / rate
                left = timeline.end + shift - t
                if span * (1 - steal) <= left:
                    shift += steal * span
                    t += span
                else:                           # the compute ends first: the rest at full speed
                    busy = left / (1 - steal)
                    shift += steal * busy
                    t += busy + seconds - rate * busy
    return max(timeline.end + shift, t), shift
