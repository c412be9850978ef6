"""The fully-connected part of split-fc: every Linear layer split by output neurons.

Rank r owns rows [lo, hi) of each Linear layer's weight (out, in) and bias
(``comm.shard_bounds(out)``). Activations between FC layers are (features, B): a
rank's rows are one contiguous block, so a ring all-gather with the out-bounds gives
every rank the whole (out, B) input of the next layer, and a reduce-scatter (sum) of
a slice's partial input gradient with the previous layer's out-bounds gives each rank
the gradient of its own rows.
"""
from ringnet.backend import get_array_module
from ringnet.errors import InputError
from ringnet.layers import Dropout, Linear, ReLU

__all__ = ["FcSlice", "FcBlock", "check_split", "fc_blocks", "conv_params", "row_bounds"]


def check_split(layer_name, out_features, ranks):
    """Raise InputError when a layer has fewer output neurons than ranks to split over."""
    if out_features < ranks:
        raise InputError(f"layer {layer_name} has {out_features} outputs, fewer than the "
                         f"{ranks} ranks split-fc splits it over")


def fc_blocks(model):
    """Return [(name, Linear, [(name, elementwise layer), ...])] for the FC part of ``model``."""
    try:
        start = model.fc_start()
    except ValueError as exc:
        raise InputError(f"split-fc needs a fully-connected layer: {exc}") from None
    blocks = []
    for name, layer in model.layers[start:]:
        if isinstance(layer, Linear):
            blocks.append((name, layer, []))
        elif isinstance(layer, (ReLU, Dropout)):
            blocks[-1][2].append((name, layer))
        else:
            raise InputError(f"split-fc cannot split layer {name} ({layer!r}) after the first "
                             "fully-connected layer: only Linear, ReLU and Dropout may follow it")
    return blocks


def conv_params(model, blocks=None):
    """Return the number of parameters before the first FC layer (the conv prefix of the flat buffer)."""
    blocks = fc_blocks(model) if blocks is None else blocks
    return model.param_offsets()[f"{blocks[0][0]}.weight"][0]


def row_bounds(bounds, batch):
    """The (start, stop) of each rank's rows ``bounds`` in a flat (features, ``batch``) buffer."""
    return [(a * batch, b * batch) for a, b in bounds]


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


class FcBlock:
    """One Linear layer's rows [lo, hi) on this rank plus the element-wise layers after it.

    Activations are (features, B) so that the rows of a rank are one contiguous block of
    the gathered output; ``forward`` computes this rank's rows and all-gathers them.
    """

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
        """Return the (start, stop) runs of the flat buffers this rank owns: weight rows, bias rows."""
        return [self.w_region, self.b_region]

    # -- per-batch buffers -------------------------------------------------------------
    def prepare(self, batch, dtype):
        """Allocate the gathered output (out, B) and the partial input gradient (in, B)."""
        if getattr(self, "_batch", None) == batch and self.out.dtype == dtype:
            return
        xp = self.slice.xp
        self.out = xp.empty(self.out_features * batch, dtype=dtype)
        self.da = xp.empty(self.in_features * batch, dtype=dtype)
        self.out_bounds = row_bounds(self.bounds, batch)
        self._batch = batch

    def rows(self, flat):
        """Return this rank's (out_r, B) rows of a flat (out, B) buffer."""
        return flat[self.lo * self._batch:self.hi * self._batch].reshape(self.hi - self.lo, self._batch)

    def output(self):
        """Return the gathered (out, B) output of the last ``forward``."""
        return self.out.reshape(self.out_features, self._batch)

    # -- forward and backward ----------------------------------------------------------
    def forward(self, a):
        """Compute this rank's rows of the block output from the (in, B) input ``a``
        into ``out`` (the caller all-gathers ``out`` with ``out_bounds``)."""
        z = self.rows(self.out)
        self.slice.forward(a, z)
        self.act_forward(z, self._batch)

    def backward_input(self, dz, dx=None):
        """Back-propagate ``dz`` (out_r, B) through the element-wise layers (in place) and
        write the partial input gradient: into ``dx`` (B, in) if given, else into ``da``."""
        dz = self.act_backward(dz)
        if dx is not None:
            self.slice.backward_input(dz, dx=dx)
        else:
            self.slice.backward_input(dz, da=self.da.reshape(self.in_features, self._batch))
        return dz

    def gather(self, comm, flat):
        """All-gather every rank's rows of this layer's weight and bias in ``flat`` (collective)."""
        n_in = self.in_features
        comm.allgather(flat[slice(*self.w_full)], bounds=[(a * n_in, b * n_in) for a, b in self.bounds])
        comm.allgather(flat[slice(*self.b_full)], bounds=self.bounds)

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
