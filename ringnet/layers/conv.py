"""Conv2d: im2col from per-tap slices + one GEMM per pass, on batch-last (C, H, W, B) memory."""
from ringnet.backend import get_array_module
from ringnet.layers.base import (Layer, as_channel_rows, batch_last, check_init,
                                 tap_ranges, tap_slice, window_geometry,
                                 window_out_size, window_repr)

__all__ = ["Conv2d", "conv_output_size"]


def conv_output_size(size, kernel, stride, pad):
    """Return floor((size + 2*pad - kernel) / stride) + 1 (Caffe and PyTorch agree here)."""
    out = (size + 2 * pad - kernel) // stride + 1
    if out < 1:
        raise ValueError(f"conv kernel {kernel} (pad {pad}) does not fit input size {size}")
    return out


class Conv2d(Layer):
    """2-D convolution (cross-correlation), weight (out, in, kh, kw), bias (out,).

    Columns are laid out (C*kh*kw, Ho*Wo*B) so forward, weight gradient and input
    gradient are each a single GEMM; the output comes out in (O, Ho, Wo, B) memory and
    is returned as a logical (B, O, Ho, Wo) view of it.
    """

    def __init__(self, in_channels, out_channels, kernel_size, stride=1, padding=0, *,
                 weight_init=("xavier",), bias_init=("constant", 0.0)):
        self.in_channels, self.out_channels = int(in_channels), int(out_channels)
        self.kernel_size, self.stride, self.padding = window_geometry(
            "Conv2d", kernel_size, stride, padding)
        self.weight_init, self.bias_init = check_init(weight_init), check_init(bias_init)
        self._cols = {}          # (train, shape) -> zero-bordered column buffer
        self._cache = None

    def __repr__(self):
        return window_repr(self, self.in_channels, self.out_channels)

    def output_shape(self, in_shape):
        c, h, w = in_shape
        if c != self.in_channels:
            raise ValueError(f"Conv2d expects {self.in_channels} input channels, got {c}")
        return (self.out_channels, *window_out_size(self, h, w, conv_output_size))

    def param_specs(self, in_shape):
        self.output_shape(in_shape)
        kh, kw = self.kernel_size
        return [("weight", (self.out_channels, self.in_channels, kh, kw), self.weight_init),
                ("bias", (self.out_channels,), self.bias_init)]

    def _column_buffer(self, xp, dtype, shape, role):
        # Entries that read padding are zeroed once and never written again, because
        # every call with this shape writes exactly the same in-bounds regions.
        key = (role, shape, dtype)
        buf = self._cols.get(key)
        if buf is None:
            self._cols = {k: v for k, v in self._cols.items() if k[0] != role}
            buf = self._cols[key] = xp.zeros(shape, dtype=dtype)
        return buf

    def _geometry(self, h, w):
        _, ho, wo = self.output_shape((self.in_channels, h, w))
        (kh, kw), (sh, sw), (ph, pw) = self.kernel_size, self.stride, self.padding
        return ho, wo, tap_ranges(h, ho, kh, sh, ph), tap_ranges(w, wo, kw, sw, pw)

    def forward(self, x, train=True):
        xp = get_array_module(x)
        b, c, h, w = x.shape                                     # (B, C, H, W)
        ho, wo, rows, cols_r = self._geometry(h, w)
        kh, kw = self.kernel_size
        cols = self._column_buffer(xp, x.dtype, (c, kh, kw, ho, wo, b),
                                   "train" if train else "eval")
        _im2col(batch_last(xp, x), cols, rows, cols_r, self.stride)
        cols2 = cols.reshape(c * kh * kw, ho * wo * b)           # (C*kh*kw, Ho*Wo*B)
        weight = self.params["weight"].reshape(self.out_channels, -1)
        y = xp.matmul(weight, cols2)                             # (O, Ho*Wo*B)
        y += self.params["bias"][:, None]
        self._cache = (x.shape, cols2, rows, cols_r) if train else None
        return y.reshape(self.out_channels, ho, wo, b).transpose(3, 0, 1, 2)  # (B, O, Ho, Wo)

    def backward(self, dy):
        # y = W @ cols + b  =>  dW = dy @ cols^T,  db = sum_cols dy,  dcols = W^T @ dy,
        # and dx = col2im(dcols): every column entry adds back to the pixel it was read from.
        # With stride 1 the same dx is a convolution of dy (padded by k-1-p) with the
        # flipped, in/out-swapped kernel: cheaper when the output is not smaller than the
        # input ("same" padding), since im2col only copies where col2im adds.
        (b, c, h, w), cols2, rows, cols_r = self._cached()
        xp = get_array_module(dy)
        dy2 = as_channel_rows(xp, dy)                            # (O, Ho*Wo*B)
        weight = self.params["weight"].reshape(self.out_channels, -1)
        xp.matmul(dy2, cols2.T, out=self.grads["weight"].reshape(self.out_channels, -1))
        xp.sum(dy2, axis=1, out=self.grads["bias"])
        if not self.needs_dx:
            return None
        (kh, kw), (sh, sw), (ph, pw) = self.kernel_size, self.stride, self.padding
        _, o, ho, wo = dy.shape
        if (sh, sw) == (1, 1) and ph < kh and pw < kw and h * w <= ho * wo:
            cols = self._column_buffer(xp, dy.dtype, (o, kh, kw, h, w, b), "dx")
            _im2col(dy2.reshape(o, ho, wo, b), cols,
                    tap_ranges(ho, h, kh, 1, kh - 1 - ph), tap_ranges(wo, w, kw, 1, kw - 1 - pw),
                    (1, 1))
            flipped = self.params["weight"].transpose(1, 0, 2, 3)[:, :, ::-1, ::-1]
            flipped = xp.ascontiguousarray(flipped).reshape(c, o * kh * kw)
            dxc = xp.matmul(flipped, cols.reshape(o * kh * kw, h * w * b))
            return dxc.reshape(c, h, w, b).transpose(3, 0, 1, 2)  # (B, C, H, W)
        dcols = xp.matmul(weight.T, dy2).reshape(c, kh, kw, ho, wo, b)
        dxc = xp.zeros((c, h, w, b), dtype=dy.dtype)             # (C, H, W, B)
        for i, j, out_i, out_j, in_i, in_j in _kernel_taps(rows, cols_r, (sh, sw)):
            dxc[:, in_i, in_j] += dcols[:, i, j, out_i, out_j]   # col2im: the adjoint of _im2col
        return dxc.transpose(3, 0, 1, 2)                         # (B, C, H, W)


def _kernel_taps(rows, cols_r, stride):
    """Yield (i, j, out rows, out cols, in rows, in cols) for each in-bounds kernel tap."""
    sh, sw = stride
    for i, ri in enumerate(rows):
        if ri is None:
            continue
        out_i, in_i = tap_slice(ri, sh)
        for j, rj in enumerate(cols_r):
            if rj is None:
                continue
            out_j, in_j = tap_slice(rj, sw)
            yield i, j, out_i, out_j, in_i, in_j


def _im2col(xc, cols, rows, cols_r, stride):
    """Copy each kernel tap's in-bounds slice of xc (C, H, W, B) into cols (C, kh, kw, Ho, Wo, B)."""
    for i, j, out_i, out_j, in_i, in_j in _kernel_taps(rows, cols_r, stride):
        cols[:, i, j, out_i, out_j] = xc[:, in_i, in_j]
