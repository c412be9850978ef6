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

The pieces: :class:`~ringnet.parallel.conversion.DataConversion` (the conversion
layer), :class:`~ringnet.parallel.fc_slices.FcBlock` (the FC slices), and for the conv
prefix the same :class:`~ringnet.parallel.delayed_update.DelayedUpdate` as the ring mode.
"""
from contextlib import contextmanager

import numpy as np

from ringnet.backend import is_gpu_array, to_numpy
from ringnet.errors import InputError
from ringnet.parallel.base import Strategy
from ringnet.parallel.conversion import ActivationCollectives, DataConversion, sample_bounds
from ringnet.parallel.plans import ShardedPlan
from ringnet.parallel.fc_slices import (FcBlock, FcSlice, check_split, conv_params, fc_blocks,
                                        row_bounds)
from ringnet.parallel.traffic import Transfer
from ringnet.shards import shard_bounds

__all__ = ["SplitFCStrategy", "FcSlice", "check_split", "fc_blocks"]


class SplitFCStrategy(Strategy):
    """Conv layers data-parallel over the ring, FC layers split by output neurons."""
    name = "split-fc"

    def __init__(self, model, make_optimizer, world, comm, delay=0, overlap=None, lookahead=None,
                 bucket_size=None):
        super().__init__(model, make_optimizer, world, delay)
        if delay not in (0, 1):
            raise InputError(f"split-fc supports delay 0 or 1, got {delay}")
        self.comm = comm
        self.transport = comm.transport
        self.rank, self.size = comm.rank, comm.size
        self.fc_index = model.fc_start()
        blocks = fc_blocks(model)
        for name, layer, _ in blocks:
            check_split(name, layer.out_features, self.size)
        self.conv_size = conv_params(model, blocks)
        self.blocks = [FcBlock(name, layer, acts, model, comm.shard_bounds(layer.out_features),
                               self.rank)
                       for name, layer, acts in blocks]
        # FC: one optimizer per contiguous region this rank owns (weight rows, bias rows)
        self.fc_regions = [r for block in self.blocks for r in block.regions()]
        self.fc_optimizers = [make_optimizer(b - a) for a, b in self.fc_regions]

        # conv prefix: the ring's exchange (sum: dlogits already carries 1/B) on one
        # stream; activation traffic on another, so that the exchange of the previous
        # step does not hold up this step's activations. ``overlap`` (default: on a GPU
        # only) runs the input-gradient reduce-scatters on the activation stream behind
        # dW/db; on the CPU the stream thread's polling competes with the BLAS for the
        # cores and was measured slower than blocking.
        # At delay 0 the conv prefix is exchanged in buckets that start during the conv
        # backward (see ``exchange``). Over NCCL the three communicators (this thread's and
        # the two streams') launch their calls in the order this thread submits them, the
        # same on every rank, as NCCL requires of communicators sharing a GPU
        # (:class:`~ringnet.comm.NcclTransport`).
        self._exchange_engine(model.params[:self.conv_size], model.grads[:self.conv_size],
                              ShardedPlan(comm, self.conv_size, op="sum"), comm, self.fc_index,
                              bucket_size=bucket_size, lookahead=lookahead)
        self.overlap = (self.xp is not np) if overlap is None else bool(overlap)
        act_stream = comm.new_stream() if self.overlap else None
        self.collectives = ActivationCollectives(comm, self.stats, act_stream)
        self.conversion = DataConversion(self.collectives, self.rank, self.size,
                                         self.blocks[0].in_features)
        self._gathered = False          # the model's FC rows of other ranks are current

    # -- what a step sends (pure: no communicator) ----------------------------------
    @classmethod
    def fits(cls, model, n):
        return all(layer.out_features >= n for _, layer, _ in fc_blocks(model))

    @classmethod
    def exchange_region(cls, model):
        return conv_params(model), model.fc_start()

    @classmethod
    def step_traffic(cls, model, n, batch, communicator="ring", delay=0, buckets=None):
        """The activation collectives of :meth:`step` on the strategy's own buffers (the
        conversion layer's (B, F+1) and (B, F) in sample blocks, each block's (out, B)
        output in row blocks, each later block's (in, B) input gradient), then the conv
        prefix's ring exchange."""
        traffic = cls._exchange_traffic(ShardedPlan, model, n, communicator, delay, buckets, "conv ")
        blocks = fc_blocks(model)
        local, features = batch // n, blocks[0][1].in_features
        itemsize = model.dtype.itemsize

        def transfer(label, op, bounds, beside=None):
            return Transfer("activations", label, op, communicator, bounds, itemsize, beside)
        out_bounds = [row_bounds(shard_bounds(layer.out_features, n), batch) for _, layer, _ in blocks]
        traffic.activations = (
            [transfer("conversion: features+labels", "allgather", sample_bounds(n, local, features + 1))]
            + [transfer(f"{name} output", "allgather", bounds)
               for (name, _, _), bounds in zip(blocks, out_bounds)]
            + [transfer(f"{blocks[k][0]} input gradient", "reduce_scatter", out_bounds[k - 1], blocks[k][0])
               for k in range(len(blocks) - 1, 0, -1)]
            + [transfer("conversion: feature gradient", "reduce_scatter",
                        sample_bounds(n, local, features), blocks[0][0])])
        return traffic

    @property
    def conv_owned(self):
        """The slice of the conv prefix this rank updates."""
        return self.engine.plan.owned

    @contextmanager
    def _compute(self, phase):
        with self.stats.span("compute", phase=phase):
            yield

    # -- one step: named phases -------------------------------------------------------
    def step(self, x, labels, it):
        with self._exchange_step(it):
            self._gathered = False
            h = self._conv_forward(x)
            a, lab = self.conversion.forward(h, labels)
            inputs, logits = self._fc_forward(a)
            loss, correct, dlogits = self._loss(logits, lab, h.shape[0])
            d = self._fc_backward(dlogits, inputs, it)
            self._conv_backward(d)
        return loss, correct

    def _conv_forward(self, x):
        """Run the conv prefix on this rank's samples."""
        with self._compute("conv_forward"):
            h = self.xp.asarray(x).astype(self.model.dtype, copy=False)
            return self.model.forward_layers(h, 0, self.fc_index, train=True)

    def _fc_forward(self, a):
        """Run every FC block on the global batch (a: (F, B)); return the block inputs and the logits."""
        batch = a.shape[1]
        inputs = []
        for block in self.blocks:
            inputs.append(a)
            with self._compute("fc_forward"):
                block.prepare(batch, self.model.dtype)
                block.forward(a)
            self.collectives.allgather(block.out, block.out_bounds)
            a = block.output()
        return inputs, a.T                                      # logits (B, classes)

    def _loss(self, logits, labels, local):
        """Return (loss, this rank's correct count, dlogits): every rank computes the same loss.

        On the CPU loss and count are Python numbers; on a GPU 0-d device arrays, left on
        the device as the model's own step leaves them (the training loop reads losses
        every GPU_LOSS_EVERY steps), so the step does not wait for the device."""
        with self._compute("loss"):
            loss = self.model.loss_layer.forward(logits, labels)
            dlogits = self.model.loss_layer.backward()
            mine = slice(self.rank * local, (self.rank + 1) * local)
            correct = (logits[mine].argmax(axis=1) == labels[mine]).sum()
        if is_gpu_array(loss):
            return loss, correct, dlogits
        return float(loss), int(correct), dlogits

    def _fc_backward(self, dlogits, inputs, it):
        """Back-propagate through the FC blocks, update the FC slices; return this rank's
        feature gradient. Each partial input gradient is reduce-scattered while this thread
        computes the block's dW and db (and, at the first block, the FC updates)."""
        last = self.blocks[-1]
        dz = self.xp.ascontiguousarray(dlogits[:, last.lo:last.hi].T)       # (out_r, B)
        for k in range(len(self.blocks) - 1, -1, -1):
            block = self.blocks[k]
            with self._compute("fc_backward_input"):
                dx = self.conversion.grad_buffer() if k == 0 else None
                dz = block.backward_input(dz, dx=dx)

            def params_grad(block=block, dz=dz, a=inputs[k], first=(k == 0)):
                with self._compute("fc_backward_params"):
                    block.slice.backward_params(dz, a)
                if first:
                    self._update_fc(it)
            if k == 0:
                return self.conversion.backward(during=params_grad)
            prev = self.blocks[k - 1]
            self.collectives.reduce_scatter(block.da, prev.out_bounds, during=params_grad)
            dz = prev.rows(block.da)

    def _conv_backward(self, d):
        """Back-propagate this rank's feature gradient through the conv prefix (writes the conv gradients)."""
        with self._compute("conv_backward"):
            self.model.backward_layers(d, 0, self.fc_index)     # the first layer returns None

    def _update_fc(self, it):
        with self.stats.span("update", part="fc"):
            params, grads = self.model.params, self.model.grads
            for (a, b), optimizer in zip(self.fc_regions, self.fc_optimizers):
                optimizer.step(params[a:b], grads[a:b], it)

    def drain(self):
        self.engine.drain()

    # -- full model ------------------------------------------------------------------
    def _gather_fc(self, flat):
        """All-gather every FC layer's rows into ``flat`` (a full-length buffer; collective)."""
        for block in self.blocks:
            block.gather(self.comm, flat)

    def eval_model(self):
        """Return the model with the newest conv weights and every rank's FC rows (collective)."""
        self.engine.show_newest()
        if not self._gathered:
            self._gather_fc(self.model.params)
            self._gathered = True
        return self.model

    def full_state(self):
        params = to_numpy(self.eval_model().params).copy()
        _, front, conv_momentum = self.engine.state()
        n = self.conv_size
        prev = None
        if front is not None:
            prev = params.copy()
            prev[:n] = front
        momentum = self.xp.zeros(self.model.num_params, dtype=self.model.dtype)
        for (a, b), optimizer in zip(self.fc_regions, self.fc_optimizers):
            momentum[a:b] = optimizer.v
        self._gather_fc(momentum)
        momentum = np.asarray(to_numpy(momentum))
        momentum[:n] = conv_momentum
        return (self._named(params), self._named(momentum),
                self._named(prev) if prev is not None else None)

    def lookahead_state(self):
        base = self.engine.lookahead_base()
        if base is None:
            return None
        full = to_numpy(self.eval_model().params).copy()   # FC rows: the newest (unused on load)
        full[:self.conv_size] = base
        return self._named(full)

    def load_full_state(self, params, momentum=None, prev_params=None, lookahead_base=None):
        n = self.conv_size
        flat = self._flat(params)
        full_m = (self._flat(momentum) if momentum
                  else np.zeros(self.model.num_params, self.model.dtype))
        self.engine.load(flat[:n], self._flat(prev_params)[:n] if prev_params else None, full_m[:n],
                         self._flat(lookahead_base)[:n] if lookahead_base else None)
        self.model.params[n:] = self.xp.asarray(flat[n:])
        self._gathered = True
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
        for owner in (self.engine, self.collectives):
            if owner.stream is not None:
                owner.stream.close()
                owner.stream = None
