"""Conv2d: im2col on strided tap slices + one GEMM per pass, channel-major activations."""
from ringnet.backend import get_array_module
from ringnet.layers.base import Layer, as_channel_rows, check_init, tap_ranges, tap_slice

__all__ = ["Conv2d", "conv_output_size"]


def conv_output_size(size, kernel, stride, pad):
    """Return floor((size + 2*pad - kernel) / stride) + 1 (Caffe and PyTorch agree here)."""
    out = (size + 2 * pad - kernel) // stride + 1
    if out < 1:
        raise ValueError(f"conv kernel {kernel} (pad {pad}) does not fit input size {size}")
    return out


def _pair(v, name):
    if isinstance(v, int):
        v = (v, v)
    v = tuple(int(a) for a in v)
    if len(v) != 2:
        raise ValueError(f"{name} must be an int or a pair, got {v!r}")
    return v


class Conv2d(Layer):
    """2-D convolution (cross-correlation), weight (out, in, kh, kw), bias (out,).

    Columns are laid out (C*kh*kw, B*Ho*Wo) so forward, weight gradient and input
    gradient are each a single GEMM and the output comes out channel-major
    (C, B, Ho, Wo) memory, returned as a logical (B, C, Ho, Wo) view.
    """

    def __init__(self, in_channels, out_channels, kernel_size, stride=1, padding=0, *,
                 weight_init=("xavier",), bias_init=("constant", 0.0)):
        self.in_channels, self.out_channels = int(in_channels), int(out_channels)
        self.kernel_size = _pair(kernel_size, "kernel_size")
        self.stride = _pair(stride, "stride")
        self.padding = _pair(padding, "padding")
        if min(self.kernel_size) < 1 or min(self.stride) < 1 or min(self.padding) < 0:
            raise ValueError(f"bad Conv2d geometry: kernel {self.kernel_size}, "
                             f"stride {self.stride}, padding {self.padding}")
        self.weight_init, self.bias_init = check_init(weight_init), check_init(bias_init)
        self._cols = {}          # (train, shape) -> zero-bordered column buffer
        self._cache = None

    def __repr__(self):
        return (f"Conv2d({self.in_channels}, {self.out_channels}, {self.kernel_size}, "
                f"stride={self.stride}, padding={self.padding})")

    def output_shape(self, in_shape):
        c, h, w = in_shape
        if c != self.in_channels:
            raise ValueError(f"Conv2d expects {self.in_channels} input channels, got {c}")
        (kh, kw), (sh, sw), (ph, pw) = self.kernel_size, self.stride, self.padding
        return (self.out_channels, conv_output_size(h, kh, sh, ph), conv_output_size(w, kw, sw, pw))

    def param_specs(self, in_shape):
        self.output_shape(in_shape)
        kh, kw = self.kernel_size
        return [("weight", (self.out_channels, self.in_channels, kh, kw), self.weight_init),
                ("bias", (self.out_channels,), self.bias_init)]

    def _column_buffer(self, xp, dtype, shape, train):
        # Entries that read padding are zeroed once and never written again, because
        # every call with this shape writes exactly the same in-bounds regions.
        key = (train, shape, dtype)
        buf = self._cols.get(key)
        if buf is None:
            self._cols = {k: v for k, v in self._cols.items() if k[0] != train}
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
        sh, sw = self.stride
        cols = self._column_buffer(xp, x.dtype, (c, kh, kw, b, ho, wo), train)
        xc = x.transpose(1, 0, 2, 3)                             # (C, B, H, W) view
        for i, ri in enumerate(rows):
            if ri is None:
                continue
            out_i, in_i = tap_slice(ri, sh)
            for j, rj in enumerate(cols_r):
                if rj is None:
                    continue
                out_j, in_j = tap_slice(rj, sw)
                cols[:, i, j, :, out_i, out_j] = xc[:, :, in_i, in_j]
        cols2 = cols.reshape(c * kh * kw, b * ho * wo)           # (C*kh*kw, B*Ho*Wo)
        weight = self.params["weight"].reshape(self.out_channels, -1)
        y = xp.matmul(weight, cols2)                             # (O, B*Ho*Wo)
        y += self.params["bias"][:, None]
        self._cache = (x.shape, cols2, rows, cols_r) if train else None
        return y.reshape(self.out_channels, b, ho, wo).transpose(1, 0, 2, 3)  # (B, O, Ho, Wo)

    def backward(self, dy):
        # y = W @ cols + b  =>  dW = dy @ cols^T,  db = sum_cols dy,  dcols = W^T @ dy,
        # and dx is col2im(dcols): every column entry adds back to the pixel it was read from.
        if self._cache is None:
            raise RuntimeError("Conv2d.backward called without a forward(train=True)")
        xp = get_array_module(dy)
        (b, c, h, w), cols2, rows, cols_r = self._cache
        dy2 = as_channel_rows(dy)                                # (O, B*Ho*Wo)
        weight = self.params["weight"].reshape(self.out_channels, -1)
        xp.matmul(dy2, cols2.T, out=self.grads["weight"].reshape(self.out_channels, -1))
        xp.sum(dy2, axis=1, out=self.grads["bias"])
        if not self.needs_dx:
            return None
        kh, kw = self.kernel_size
        sh, sw = self.stride
        _, _, ho, wo = dy.shape
        dcols = xp.matmul(weight.T, dy2).reshape(c, kh, kw, b, ho, wo)
        dxc = xp.zeros((c, b, h, w), dtype=dy.dtype)             # (C, B, H, W)
        for i, ri in enumerate(rows):
            if ri is None:
                continue
            out_i, in_i = tap_slice(ri, sh)
            for j, rj in enumerate(cols_r):
                if rj is None:
                    continue
                out_j, in_j = tap_slice(rj, sw)
                dxc[:, :, in_i, in_j] += dcols[:, i, j, :, out_i, out_j]
        return dxc.transpose(1, 0, 2, 3)                         # (B, C, H, W)
