"""Linear (fully connected) and Flatten."""
from ringnet.backend import get_array_module, is_gpu_array
from ringnet.layers import gemm
from ringnet.layers.base import Layer, check_init, copy_samples, empty_like_layout

__all__ = ["Linear", "Flatten"]


class Linear(Layer):
    """y = x @ W^T + b with weight (out, in) and bias (out,) (PyTorch layout)."""

    def __init__(self, in_features, out_features, *, weight_init=("xavier",),
                 bias_init=("constant", 0.0)):
        self.in_features, self.out_features = int(in_features), int(out_features)
        if self.in_features < 1 or self.out_features < 1:
            raise ValueError(f"bad Linear size {in_features} -> {out_features}")
        self.weight_init, self.bias_init = check_init(weight_init), check_init(bias_init)
        self._x = None

    def __repr__(self):
        return f"Linear({self.in_features}, {self.out_features})"

    def output_shape(self, in_shape):
        if tuple(in_shape) != (self.in_features,):
            raise ValueError(f"Linear expects per-sample shape ({self.in_features},), "
                             f"got {tuple(in_shape)}")
        return (self.out_features,)

    def param_specs(self, in_shape):
        self.output_shape(in_shape)
        return [("weight", (self.out_features, self.in_features), self.weight_init),
                ("bias", (self.out_features,), self.bias_init)]

    def forward(self, x, train=True, add_bias=True, bias_grad=True):
        """Return x W^T + b. On a GPU the model may leave the bias to the next layer's
        kernel (``add_bias=False``: x W^T alone) and its gradient too (``bias_grad=False``:
        ``backward`` leaves ``grads["bias"]`` to that kernel)."""
        xp = get_array_module(x)
        if x.ndim != 2 or x.shape[1] != self.in_features:
            raise ValueError(f"Linear expects (B, {self.in_features}), got {tuple(x.shape)}")
        if not (add_bias and bias_grad):
            self._gpu_only(xp, "add_bias=False / bias_grad=False")
        y = gemm.matmul(xp, x, self.params["weight"].T)          # (B, out)
        if add_bias:
            y += self.params["bias"]
        self._x = x if train else None                           # (B, in)
        self._bias_grad = bias_grad
        return y

    def backward(self, dy):
        # y = x W^T + b  =>  dW = dy^T x,  db = sum_B dy,  dx = dy W.
        if self._x is None:
            raise RuntimeError("Linear.backward called without a forward(train=True)")
        xp = get_array_module(dy)
        gemm.matmul(xp, dy.T, self._x, out=self.grads["weight"])   # (out, in)
        if self._bias_grad:                                      # else the next kernel's
            xp.sum(dy, axis=0, out=self.grads["bias"])            # (out,)
        if not self.needs_dx:
            return None
        return gemm.matmul(xp, dy, self.params["weight"])        # (B, in)


class Flatten(Layer):
    """(B, C, H, W) -> (B, C*H*W) in C order, so Linear weights match PyTorch's."""

    def __init__(self):
        self._x = None

    def output_shape(self, in_shape):
        size = 1
        for s in in_shape:
            size *= int(s)
        return (size,)

    def forward(self, x, train=True):
        self._x = x
        return x.reshape(x.shape[0], -1)                         # (B, C*H*W)

    def backward(self, dy):
        # pure re-indexing: dx is dy read back in the input's shape (and memory order,
        # so the layers below keep working on their own layout). On a GPU the layers below
        # take any memory order (their kernels or one copy), so a view saves this copy.
        if is_gpu_array(dy):
            return dy.reshape(self._x.shape)
        xp = get_array_module(dy)
        dx = empty_like_layout(xp, self._x, self._x.shape)       # (B, C, H, W)
        return copy_samples(xp, dx, dy.reshape(self._x.shape))
