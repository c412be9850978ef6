"""split-fc: convolutional layers data-parallel, fully-connected layers split by output neurons.

Per step, with N ranks, global batch B and b = B/N samples per rank:

* conv part (every layer before ``model.fc_start()``) runs on this rank's b samples
  with the whole conv prefix of the flat parameter buffer on every rank;
* data conversion layer: the (b, F) features of all ranks (each sample's label
  appended as one more number) are all-gathered into one sample-major (B, F + 1)
  block, so every rank sees the global batch;
* every Linear layer is split by output neurons (``comm.shard_bounds(out)``): rank r
  owns rows [lo, hi) of its weight (out, in) and bias. Activations between FC layers
  live as (features, B) so a rank's rows are one contiguous block: the slice output
  (out_r, B) goes through ReLU/Dropout on the rank, then a ring all-gather with the
  out-bounds gives every rank the full (out, B) input of the next layer;
* logits (classes, B) are gathered the same way; every rank computes the same
  softmax cross-entropy over the global batch and keeps its columns of dlogits;
* backward: a slice's partial input gradient is reduce-scattered (sum) with the
  previous layer's out-bounds, or at the conversion layer with the sample bounds, so
  each rank gets exactly the gradient of its own rows / samples;
* the conv gradients (already partial sums of the global mean, since dlogits carries
  1/B) are reduce-scattered (sum) over the conv prefix, each rank updates its conv
  shard (momentum for that shard only) and the shards are all-gathered.

FC slices are updated right after backward on their rank; they never leave it except
to assemble a full model (``eval_model``, checkpoints). Delay 0 equals **single**.
Delay 1 applies the ring's delayed update to the conv prefix only
(``c_{t+1} = upd(c_t, Gc_t(c_{t-1}, f_t))``, exchange on the communication stream)
while FC slices stay immediate (``f_{t+1} = upd(f_t, Gf_t(c_{t-1}, f_t))``).
"""
import time

import numpy as np

from ringnet.backend import get_array_module, to_numpy
from ringnet.errors import UsageError
from ringnet.layers import Dropout, Linear, ReLU
from ringnet.parallel.base import Strategy, _synchronize

__all__ = ["SplitFCStrategy", "FcSlice", "check_split", "fc_blocks"]


def check_split(layer_name, out_features, ranks):
    """Raise UsageError when a layer has fewer output neurons than ranks to split over."""
    if out_features < ranks:
        raise UsageError(f"layer {layer_name} has {out_features} outputs, fewer than the "
                         f"{ranks} ranks split-fc splits it over")


def fc_blocks(model):
    """Return [(name, Linear, [(name, elementwise layer), ...])] for the FC part of ``model``."""
    try:
        start = model.fc_start()
    except ValueError as exc:
        raise UsageError(f"split-fc needs a fully-connected layer: {exc}") from None
    blocks = []
    for name, layer in model.layers[start:]:
        if isinstance(layer, Linear):
            blocks.append((name, layer, []))
        elif isinstance(layer, (ReLU, Dropout)):
            blocks[-1][2].append((name, layer))
        else:
            raise UsageError(f"split-fc cannot split layer {name} ({layer!r}) after the first "
                             "fully-connected layer: only Linear, ReLU and Dropout may follow it")
    return blocks


class FcSlice:
    """Rows [lo, hi) of one Linear layer: forward and backward in (features, B) layout.

    ``weight`` (out_r, in), ``bias`` (out_r,), ``dweight``, ``dbias`` are views (into the
    model's flat buffers in training); inputs ``a`` are (in, B) arrays (any strides).
    """

    def __init__(self, weight, bias, dweight, dbias):
        self.weight, self.bias, self.dweight, self.dbias = weight, bias, dweight, dbias

    def forward(self, a, out):
        """Write z = W_r a + b_r, (out_r, B), into ``out``."""
        xp = self.xp
        xp.matmul(self.weight, a, out=out)
        out += self.bias[:, None]
        return out

    def backward(self, dz, a, da=None, dx=None):
        """Write dW_r, db_r; write this slice's partial dA (in, B) or dX (B, in) if given.

        z = W a + b  =>  dW = dz a^T,  db = sum_B dz,  dA = W^T dz (a partial sum: the
        other ranks' rows contribute the rest).
        """
        self.backward_input(dz, da, dx)
        self.backward_params(dz, a)

    def backward_input(self, dz, da=None, dx=None):
        """Write the partial input gradient: dA = W_r^T dz (in, B) and/or dX = dz^T W_r (B, in)."""
        xp = self.xp
        if da is not None:
            xp.matmul(self.weight.T, dz, out=da)                 # (in, B)
        if dx is not None:
            xp.matmul(dz.T, self.weight, out=dx)                 # (B, in)

    def backward_params(self, dz, a):
        """Write dW_r = dz a^T (out_r, in) and db_r = sum_B dz (out_r,)."""
        xp = self.xp
        xp.matmul(dz, a.T, out=self.dweight)
        xp.sum(dz, axis=1, out=self.dbias)

    @property
    def xp(self):
        return get_array_module(self.weight)


class _Block:
    """One Linear layer's slice on this rank plus the element-wise layers after it."""

    def __init__(self, name, layer, acts, model, bounds, rank):
        self.name = name
        self.acts = acts
        self.in_features, self.out_features = layer.in_features, layer.out_features
        self.bounds = bounds
        self.lo, self.hi = bounds[rank]
        offsets = model.param_offsets()
        ws, we, _ = offsets[f"{name}.weight"]
        bs, be, _ = offsets[f"{name}.bias"]
        n_in = self.in_features
        # Rows [lo, hi) of a row-major (out, in) weight are one contiguous run.
        self.w_region = (ws + self.lo * n_in, ws + self.hi * n_in)
        self.b_region = (bs + self.lo, bs + self.hi)
        self.w_full = (ws, we)
        self.b_full = (bs, be)
        rows = self.hi - self.lo
        self.slice = FcSlice(model.params[slice(*self.w_region)].reshape(rows, n_in),
                             model.params[slice(*self.b_region)],
                             model.grads[slice(*self.w_region)].reshape(rows, n_in),
                             model.grads[slice(*self.b_region)])

    def regions(self):
        return [self.w_region, self.b_region]

    def act_forward(self, z, batch):
        """Apply ReLU/Dropout in place on this rank's (out_r, B) slice; cache masks."""
        xp = self.slice.xp
        self.masks = []
        for _, layer in self.acts:
            if isinstance(layer, ReLU):
                xp.maximum(z, 0, out=z)
                self.masks.append(None)         # backward reads the sign of z itself
            else:
                # Draw the mask of the whole (B, out) output from the layer's own seeded
                # stream, exactly as the unsplit layer would, and keep this rank's columns:
                # the masks then agree with single mode and across ranks.
                full = layer.forward(xp.ones((batch, self.out_features), z.dtype), train=True)
                mask = xp.ascontiguousarray(full[:, self.lo:self.hi].T)   # (out_r, B)
                z *= mask
                self.masks.append(mask)
        self.z = z

    def act_backward(self, dz):
        """Back-propagate through the element-wise layers in place on dz (out_r, B)."""
        xp = self.slice.xp
        for (_, layer), mask in zip(reversed(self.acts), reversed(self.masks)):
            if mask is None:
                # ReLU: z holds the block output, > 0 exactly where the ReLU input was
                # > 0 and no dropout mask zeroed it; where a mask zeroed it the chain's
                # gradient is 0 anyway, so z > 0 is the ReLU's derivative here.
                dz *= (self.z > 0)
            else:
                dz *= mask
        return dz


class SplitFCStrategy(Strategy):
    """Conv layers data-parallel over the ring, FC layers split by output neurons."""
    name = "split-fc"

    def __init__(self, model, make_optimizer, world, comm, delay=0, overlap=None):
        super().__init__(model, make_optimizer, world, delay)
        if delay not in (0, 1):
            raise UsageError(f"split-fc supports delay 0 or 1, got {delay}")
        self.comm = comm
        self.transport = comm.transport
        self.rank, self.size = comm.rank, comm.size
        xp = self.xp
        self.fc_index = model.fc_start()
        blocks = fc_blocks(model)
        for name, layer, _ in blocks:
            check_split(name, layer.out_features, self.size)
        offsets = model.param_offsets()
        first = blocks[0][0]
        self.conv_size = offsets[f"{first}.weight"][0]
        self.blocks = [_Block(name, layer, acts, model, comm.shard_bounds(layer.out_features),
                              self.rank)
                       for name, layer, acts in blocks]

        # conv prefix: ring shards, one optimizer for this rank's shard
        self.conv_bounds = comm.shard_bounds(self.conv_size)
        lo, hi = self.conv_bounds[self.rank]
        self.conv_owned = slice(lo, hi)
        self.conv_optimizer = make_optimizer(hi - lo)
        # FC: one optimizer per contiguous region this rank owns (weight rows, bias rows)
        self.fc_regions = [r for block in self.blocks for r in block.regions()]
        self.fc_optimizers = [make_optimizer(b - a) for a, b in self.fc_regions]

        # conv exchange on one stream (delay 1), activation traffic on another so that the
        # exchange of the previous step does not hold up this step's activations.
        # ``overlap`` (default: on a GPU only) runs the input-gradient reduce-scatters on
        # the activation stream behind dW/db; on the CPU the stream thread's polling
        # competes with the BLAS for the cores and was measured slower than blocking.
        self.overlap = (xp is not np) if overlap is None else bool(overlap)
        self.stream = comm.new_stream() if delay else None
        self.act_stream = comm.new_stream() if self.overlap else None
        if delay:
            # newest conv weights (receiving the exchange in flight) and its gradient copy;
            # model.params[:conv] holds the weights the next step computes on
            self.conv_latest = model.params[:self.conv_size].copy()
            self.conv_grads = xp.empty(self.conv_size, dtype=model.dtype)
            self._front_saved = xp.empty(self.conv_size, dtype=model.dtype)
        self._showing_latest = False    # delay 1: eval_model put conv_latest into the model
        self._gathered = False          # the model's FC rows of other ranks are current
        self._buffers = {}

    # -- buffers -------------------------------------------------------------------
    def _bufs(self, batch, local):
        """Return the communication buffers for a global batch (cached per size)."""
        key = (batch, local)
        bufs = self._buffers.get(key)
        if bufs is None:
            xp, dtype = self.xp, self.model.dtype
            features = self.blocks[0].in_features
            row = features + 1      # each sample's features, then its label as a number
            bufs = {
                # (B, F + 1): the labels travel with the features in one all-gather
                "features": xp.empty(batch * row, dtype=dtype),
                "sample_bounds": [(r * local * row, (r + 1) * local * row) for r in range(self.size)],
                "dfeatures": xp.empty(batch * features, dtype=dtype),     # (B, F)
                "dsample_bounds": [(r * local * features, (r + 1) * local * features)
                                   for r in range(self.size)],
                # per block: its gathered output (out, B) and the partial dA (in, B)
                "out": [xp.empty(bl.out_features * batch, dtype=dtype) for bl in self.blocks],
                "out_bounds": [[(a * batch, b * batch) for a, b in bl.bounds] for bl in self.blocks],
                "da": [xp.empty(bl.in_features * batch, dtype=dtype) for bl in self.blocks],
            }
            self._buffers = {key: bufs}     # one batch size at a time in the steady state
        return bufs

    def _comm(self, fn, *args, **kwargs):
        """Run a blocking collective on the training thread and count its time as exposed."""
        t = time.perf_counter()
        fn(*args, **kwargs)
        dt = time.perf_counter() - t
        self.stats.comm_total_s += dt
        self.stats.comm_wait_s += dt
        return dt

    # -- one step --------------------------------------------------------------------
    def step(self, x, labels, it):
        t0 = time.perf_counter()
        comm_before, update_before = self.stats.comm_wait_s, self.stats.update_s
        model, xp, comm = self.model, self.xp, self.comm
        self._restore_front()
        self._gathered = False
        x = xp.asarray(x).astype(model.dtype, copy=False)
        local = x.shape[0]
        batch = local * self.size
        bufs = self._bufs(batch, local)
        rank = self.rank

        # conv part on this rank's samples
        h = x
        for _, layer in model.layers[:self.fc_index]:
            h = layer.forward(h, True)

        # data conversion: features and labels of the global batch, sample-major, rank
        # blocks in rank order (labels as floats: exact, class counts are far below 2**24)
        features = self.blocks[0].in_features
        feat = bufs["features"]
        lo, hi = bufs["sample_bounds"][rank]
        block_rows = feat[lo:hi].reshape(local, features + 1)
        block_rows[:, :features] = h.reshape(local, features)
        block_rows[:, features] = xp.asarray(labels).reshape(-1)
        _synchronize(xp)
        self._comm(comm.allgather, feat, bounds=bufs["sample_bounds"])
        rows = feat.reshape(batch, features + 1)
        lab = rows[:, features].astype(xp.int64)

        # FC forward: slices in (features, B) layout, gathered between layers
        a = rows[:, :features].T                                            # (F, B)
        inputs = []
        for block, out, ob in zip(self.blocks, bufs["out"], bufs["out_bounds"]):
            inputs.append(a)
            z = out[ob[rank][0]:ob[rank][1]].reshape(block.hi - block.lo, batch)
            block.slice.forward(a, z)
            block.act_forward(z, batch)
            _synchronize(xp)
            self._comm(comm.allgather, out, bounds=ob)
            a = out.reshape(block.out_features, batch)                      # (out, B)
        logits = a.T                                                        # (B, classes)
        loss = model.loss_layer.forward(logits, lab)
        dlogits = model.loss_layer.backward()
        mine = slice(rank * local, (rank + 1) * local)
        correct = int(to_numpy((logits[mine].argmax(axis=1) == lab[mine]).sum()))

        # FC backward: complete slice gradients, partial input gradients reduce-scattered.
        # With ``overlap`` the reduce-scatter runs on the activation stream while this
        # thread computes the slice's dW and db (and, at the first FC layer, the FC updates).
        last = self.blocks[-1]
        dz = xp.ascontiguousarray(dlogits[:, last.lo:last.hi].T)           # (out_r, B)
        for k in range(len(self.blocks) - 1, -1, -1):
            block = self.blocks[k]
            dz = block.act_backward(dz)
            if k > 0:
                da, pb = bufs["da"][k], bufs["out_bounds"][k - 1]
                block.slice.backward_input(dz, da=da.reshape(block.in_features, batch))
            else:
                da, pb = bufs["dfeatures"], bufs["dsample_bounds"]
                block.slice.backward_input(dz, dx=da.reshape(batch, features))
            _synchronize(xp)
            reduced = self._start(comm.reduce_scatter, da, "sum", pb)
            block.slice.backward_params(dz, inputs[k])
            if k == 0:
                self._update_fc(it)
            self._wait(reduced)
            if k > 0:
                prev = self.blocks[k - 1]
                dz = da[pb[rank][0]:pb[rank][1]].reshape(prev.hi - prev.lo, batch)
        dlo, dhi = bufs["dsample_bounds"][rank]
        d = bufs["dfeatures"][dlo:dhi].reshape(h.shape)

        # conv backward on this rank's samples (the first layer returns None)
        for _, layer in reversed(model.layers[:self.fc_index]):
            d = layer.backward(d)
        _synchronize(xp)
        t1 = time.perf_counter()
        self.stats.compute_s += (t1 - t0) - (self.stats.comm_wait_s - comm_before) \
            - (self.stats.update_s - update_before)
        loss = float(loss)

        if not self.delay:
            before = self.stats.comm_total_s
            self._conv_exchange(model.grads[:self.conv_size], model.params[:self.conv_size], it)
            # a synchronous exchange exposes all of its communication
            self.stats.comm_wait_s += self.stats.comm_total_s - before
        else:
            self._wait_pending()
            n = self.conv_size
            model.params[:n] = self.conv_latest       # w[t]: what step t+1 computes on
            self.conv_grads[...] = model.grads[:n]
            _synchronize(xp)
            self.pending = self.stream.submit(self._conv_exchange, self.conv_grads,
                                              self.conv_latest, it)
        self.stats.steps += 1
        self.stats.step_times.append(time.perf_counter() - t0)
        return loss, correct

    def _timed(self, fn, *args):
        """Run a collective (on a stream) and count its duration as communication time."""
        t = time.perf_counter()
        fn(*args)
        self.stats.comm_total_s += time.perf_counter() - t

    def _start(self, fn, *args):
        """Start a collective on the activation stream, or run it now without ``overlap``."""
        if self.act_stream is None:
            self._comm(fn, *args)
            return None
        return self.act_stream.submit(self._timed, fn, *args)

    def _wait(self, handle):
        """Wait for a stream operation; count the blocked time as exposed communication."""
        if handle is None:
            return
        t = time.perf_counter()
        handle.wait()
        self.stats.comm_wait_s += time.perf_counter() - t

    def _update_fc(self, it):
        t = time.perf_counter()
        params, grads = self.model.params, self.model.grads
        for (a, b), optimizer in zip(self.fc_regions, self.fc_optimizers):
            optimizer.step(params[a:b], grads[a:b], it)
        _synchronize(self.xp)
        self.stats.update_s += time.perf_counter() - t

    def _conv_exchange(self, grads, weights, it):
        """Reduce-scatter (sum) the conv gradients, update the own shard, all-gather weights."""
        t0 = time.perf_counter()
        self.comm.reduce_scatter(grads, op="sum", bounds=self.conv_bounds)
        t1 = time.perf_counter()
        lo, hi = self.conv_owned.start, self.conv_owned.stop
        if hi > lo:
            self.conv_optimizer.step(weights[lo:hi], grads[lo:hi], it)
            _synchronize(self.xp)
        t2 = time.perf_counter()
        self.comm.allgather(weights, bounds=self.conv_bounds)
        t3 = time.perf_counter()
        self.stats.comm_total_s += (t1 - t0) + (t3 - t2)
        self.stats.update_s += t2 - t1

    # -- full model ------------------------------------------------------------------
    def _restore_front(self):
        if self._showing_latest:
            self.model.params[:self.conv_size] = self._front_saved
            self._showing_latest = False

    def _gather_fc(self, flat):
        """All-gather every FC layer's rows into ``flat`` (a full-length buffer; collective)."""
        for block in self.blocks:
            n_in = block.in_features
            ws, we = block.w_full
            bs, be = block.b_full
            self.comm.allgather(flat[ws:we], bounds=[(a * n_in, b * n_in) for a, b in block.bounds])
            self.comm.allgather(flat[bs:be], bounds=block.bounds)

    def eval_model(self):
        """Return the model with the newest conv weights and every rank's FC rows (collective)."""
        self.drain()
        if self.delay and not self._showing_latest:
            n = self.conv_size
            self._front_saved[...] = self.model.params[:n]
            self.model.params[:n] = self.conv_latest
            self._showing_latest = True
        if not self._gathered:
            self._gather_fc(self.model.params)
            self._gathered = True
        return self.model

    def _momentum(self):
        """Return the full momentum vector assembled from every rank's shards (collective)."""
        xp = self.xp
        full = xp.zeros(self.model.num_params, dtype=self.model.dtype)
        lo, hi = self.conv_owned.start, self.conv_owned.stop
        if hi > lo:
            full[lo:hi] = self.conv_optimizer.v
        for (a, b), optimizer in zip(self.fc_regions, self.fc_optimizers):
            full[a:b] = optimizer.v
        if self.conv_size:
            self.comm.allgather(full[:self.conv_size], bounds=self.conv_bounds)
        self._gather_fc(full)
        return np.asarray(to_numpy(full))

    def full_state(self):
        params = self._named(self.eval_model().params)
        prev = None
        if self.delay:
            flat = to_numpy(self.model.params).copy()
            flat[:self.conv_size] = to_numpy(self._front_saved)
            prev = self._named(flat)
        momentum = self._named(self._momentum())
        return params, momentum, prev

    def load_full_state(self, params, momentum=None, prev_params=None):
        self.drain()
        xp, n = self.xp, self.conv_size
        flat = self._flat(params)
        full_m = (self._flat(momentum) if momentum
                  else np.zeros(self.model.num_params, self.model.dtype))
        self.model.params[...] = xp.asarray(flat)
        self._showing_latest = False
        self._gathered = True
        if self.delay:
            self.conv_latest[...] = xp.asarray(flat[:n])
            if prev_params:
                front = self._flat(prev_params)[:n]
                self.model.params[:n] = xp.asarray(front)
        lo, hi = self.conv_owned.start, self.conv_owned.stop
        self.conv_optimizer.load_state_dict({"momentum": full_m[lo:hi]})
        for (a, b), optimizer in zip(self.fc_regions, self.fc_optimizers):
            optimizer.load_state_dict({"momentum": full_m[a:b]})

    # -- reporting -----------------------------------------------------------------------
    def fc_params_by_rank(self):
        """Return the number of FC parameters each rank owns and updates."""
        counts = [0] * self.size
        for block in self.blocks:
            for r, (a, b) in enumerate(block.bounds):
                counts[r] += (b - a) * (block.in_features + 1)
        return counts

    def extra_summary(self):
        """Return split-fc's fields of the --json summary."""
        by_rank = self.fc_params_by_rank()
        return {"conv_params": int(self.conv_size),
                "fc_params": int(self.model.num_params - self.conv_size),
                "fc_params_per_rank": int(max(by_rank)),
                "fc_params_by_rank": by_rank}

    def close(self):
        self.drain()
        for stream in (self.stream, self.act_stream):
            if stream is not None:
                stream.close()
        self.stream = self.act_stream = None
