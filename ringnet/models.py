"""Models: layer sequences whose parameters and gradients live in one flat buffer each."""
from dataclasses import dataclass
from typing import Callable, Dict, List, NamedTuple, Optional, Tuple

import numpy as np

from ringnet import trace
from ringnet.backend import get_array_module, make_rng, resolve_dtype, to_numpy
from ringnet.layers import (AvgPool2d, Conv2d, Dropout, Flatten, Linear, MaxPool2d, ReLU,
                            SoftmaxCrossEntropy, init_array)

__all__ = ["MODELS", "ModelSpec", "Model", "ParamSlot", "LayerShape", "build_model"]


@dataclass(frozen=True)
class ModelSpec:
    """A named architecture: per-sample input shape, default class count, layer builder."""

    name: str
    input_shape: tuple
    num_classes: int
    build: Callable  # (num_classes, seed) -> [(name, layer)]
    description: str = ""


def _lenet(num_classes, seed):
    # Caffe examples/mnist/lenet_train_test.prototxt
    return [("conv1", Conv2d(1, 20, 5)),
            ("pool1", MaxPool2d(2, 2)),
            ("conv2", Conv2d(20, 50, 5)),
            ("pool2", MaxPool2d(2, 2)),
            ("flatten", Flatten()),
            ("ip1", Linear(800, 500)),
            ("relu1", ReLU()),
            ("ip2", Linear(500, num_classes))]


def _cifar10_quick(num_classes, seed):
    # Caffe examples/cifar10/cifar10_quick_train_test.prototxt (ceil-mode pools: 32-16-8-4)
    def g(std):
        return {"weight_init": ("gaussian", std), "bias_init": ("constant", 0.0)}
    return [("conv1", Conv2d(3, 32, 5, padding=2, **g(0.0001))),
            ("pool1", MaxPool2d(3, 2)),
            ("relu1", ReLU()),
            ("conv2", Conv2d(32, 32, 5, padding=2, **g(0.01))),
            ("relu2", ReLU()),
            ("pool2", AvgPool2d(3, 2)),
            ("conv3", Conv2d(32, 64, 5, padding=2, **g(0.01))),
            ("relu3", ReLU()),
            ("pool3", AvgPool2d(3, 2)),
            ("flatten", Flatten()),
            ("ip1", Linear(64 * 4 * 4, 64, **g(0.1))),
            ("ip2", Linear(64, num_classes, **g(0.1)))]


def _digits(num_classes, seed):
    # Two convs before the only pool: 8x8 digits lose too much when pooled twice.
    he = {"weight_init": ("he",)}
    return [("conv1", Conv2d(1, 16, 3, padding=1, **he)),
            ("relu1", ReLU()),
            ("conv2", Conv2d(16, 32, 3, padding=1, **he)),
            ("relu2", ReLU()),
            ("pool1", MaxPool2d(2, 2)),
            ("flatten", Flatten()),
            ("ip1", Linear(32 * 4 * 4, 64, **he)),
            ("relu3", ReLU()),
            ("ip2", Linear(64, num_classes))]


def _carnet(num_classes, seed):
    # AlexNet-style, scaled to 64x64: strided conv1 then pools, 64 -> 32 -> 16 -> 8 -> 4.
    he = {"weight_init": ("he",)}
    return [("conv1", Conv2d(3, 32, 5, stride=2, padding=2, **he)),
            ("relu1", ReLU()),
            ("pool1", MaxPool2d(2, 2)),
            ("conv2", Conv2d(32, 64, 5, padding=2, **he)),
            ("relu2", ReLU()),
            ("pool2", MaxPool2d(3, 2)),
            ("conv3", Conv2d(64, 96, 3, padding=1, **he)),
            ("relu3", ReLU()),
            ("conv4", Conv2d(96, 64, 3, padding=1, **he)),
            ("relu4", ReLU()),
            ("pool3", MaxPool2d(3, 2)),
            ("flatten", Flatten()),
            ("ip1", Linear(64 * 4 * 4, 256, **he)),
            ("relu5", ReLU()),
            ("drop1", Dropout(0.5, seed=seed + 1)),
            ("ip2", Linear(256, num_classes, weight_init=("gaussian", 0.01)))]


MODELS = {
    "lenet": ModelSpec("lenet", (1, 28, 28), 10, _lenet, "Caffe MNIST LeNet"),
    "cifar10_quick": ModelSpec("cifar10_quick", (3, 32, 32), 10, _cifar10_quick,
                               "Caffe CIFAR-10 quick"),
    "digits": ModelSpec("digits", (1, 8, 8), 10, _digits, "small CNN for 8x8 digits"),
    "carnet": ModelSpec("carnet", (3, 64, 64), 4, _carnet,
                        "small AlexNet-style net for 64x64 vehicle images"),
}


class ParamSlot(NamedTuple):
    """Where one parameter lives in the model's flat buffers."""
    layer_index: int        # index into Model.layers
    suffix: str             # "weight" or "bias"
    name: str               # "<layer name>.<suffix>", the name checkpoints use
    start: int              # [start, stop) in params and grads
    stop: int
    shape: tuple            # PyTorch layout
    init: tuple             # the layer's init spec for it


class LayerShape(NamedTuple):
    """One layer's per-sample input and output shapes."""
    name: str
    in_shape: tuple
    out_shape: tuple


class Model:
    """A layer sequence with all parameters in ``params`` and all gradients in ``grads``.

    Both are flat contiguous 1-D arrays of length ``num_params``; every layer holds views
    into them (layer order, weight before bias), so one array is what a communicator sends.

    ``layers``: [(name, Layer)] in order; ``input_shape``: per-sample (C, H, W);
    ``num_classes``: the last layer's output size; ``dtype``: float32 or float64;
    ``xp``: numpy or cupy (where the buffers live); ``seed`` draws the initial weights.
    Raises ValueError for duplicate layer names or layers whose shapes do not chain to
    ``(num_classes,)``. Arrays below are ``xp`` arrays unless said to be on the host.
    """

    def __init__(self, layers: List[Tuple[str, object]], input_shape: Tuple[int, ...],
                 num_classes: int, dtype: str = "float32", xp=np, seed: int = 0,
                 name: str = "model"):
        self.name = name
        self.layers = list(layers)
        self.input_shape = tuple(input_shape)
        self.num_classes = int(num_classes)
        self.dtype = resolve_dtype(dtype)
        self.xp = xp
        self.loss_layer = SoftmaxCrossEntropy()
        names = [n for n, _ in self.layers]
        if len(set(names)) != len(names):
            raise ValueError(f"duplicate layer names in {names}")
        for index, (_, layer) in enumerate(self.layers):
            if isinstance(layer, Dropout):     # keys its masks: two Dropouts draw apart
                layer.layer_index = index
        # Walk the shapes once: it validates the architecture and fixes the buffer layout.
        self.shapes = []              # [LayerShape]
        self._slots = []              # [ParamSlot], in buffer order
        shape, offset = self.input_shape, 0
        for index, (lname, layer) in enumerate(self.layers):
            for suffix, pshape, init in layer.param_specs(shape):
                size = int(np.prod(pshape))
                self._slots.append(ParamSlot(index, suffix, f"{lname}.{suffix}", offset,
                                             offset + size, tuple(pshape), init))
                offset += size
            out = layer.output_shape(shape)
            self.shapes.append(LayerShape(lname, shape, out))
            shape = out
        if shape != (self.num_classes,):
            raise ValueError(f"model output shape {shape} != ({self.num_classes},)")
        self.num_params = offset
        host = np.empty(offset, dtype=self.dtype)
        rng = make_rng(seed)
        for slot in self._slots:
            host[slot.start:slot.stop] = init_array(slot.init, slot.shape, rng, self.dtype).reshape(-1)
        self.params = xp.asarray(host)
        self.grads = xp.zeros(offset, dtype=self.dtype)
        # layer_hook(phase, index): called after each layer's forward ("forward") and
        # backward ("backward"); the strategies progress and start exchanges from it.
        self.layer_hook = None
        if self.layers:
            # Nothing upstream of the first layer wants an input gradient.
            self.layers[0][1].needs_dx = False
        self._fused = self._fused_pairs() if xp is np else {}
        self._bias_next = self._bias_pairs() if xp is not np else {}
        self._bias_from = {c: p for p, (c, _) in self._bias_next.items()}
        self._bias_to_loss = False    # loss_and_grad on a GPU: the loss kernel adds it
        self.bind_flat(self.params, self.grads)

    def _fused_pairs(self) -> Dict[int, int]:
        """Return index -> partner index for each ReLU that its neighbouring pool applies
        (CPU): a ReLU then a pool (max or average), or a max pool then a ReLU (max commutes
        with max(., 0), gradients included). The pool rectifies its chunks of channels
        while they are in cache; the ReLU passes x and its gradient through, which saves
        the two passes over a whole activation that it would make each way."""
        pairs, layers = {}, [layer for _, layer in self.layers]
        for i in range(len(layers) - 1):
            if i in pairs:
                continue
            a, b = layers[i], layers[i + 1]
            if (isinstance(a, ReLU) and isinstance(b, (MaxPool2d, AvgPool2d))) or \
                    (isinstance(a, MaxPool2d) and isinstance(b, ReLU)):
                pairs[i], pairs[i + 1] = i + 1, i
        return pairs

    def _bias_pairs(self) -> Dict[int, Tuple[int, bool]]:
        """Return producer index -> (consumer index, with its gradient) for each bias that
        the next layer's kernel adds on a GPU: a convolution's before a max pool or a ReLU,
        a Linear's before a ReLU, whose backward kernel also writes that Linear's bias
        gradient (a column sum over the batch, one thread per column). Each saves the
        launch adding the bias over the whole output; the last Linear's goes to the loss
        kernel (:meth:`loss_and_grad`)."""
        pairs, layers = {}, [layer for _, layer in self.layers]
        for i in range(len(layers) - 1):
            a, b = layers[i], layers[i + 1]
            if isinstance(a, Conv2d) and isinstance(b, (MaxPool2d, ReLU)):
                pairs[i] = (i + 1, False)
            elif isinstance(a, Linear) and isinstance(b, ReLU):
                pairs[i] = (i + 1, True)
        return pairs

    # --- flat buffers and names

    def _views(self, flat, grads):
        per_layer = [({}, {}) for _ in self.layers]
        for slot in self._slots:
            per_layer[slot.layer_index][0][slot.suffix] = flat[slot.start:slot.stop].reshape(slot.shape)
            per_layer[slot.layer_index][1][slot.suffix] = grads[slot.start:slot.stop].reshape(slot.shape)
        return per_layer

    def _check_flat(self, array, what):
        if array.ndim != 1 or array.shape[0] != self.num_params or array.dtype != self.dtype:
            raise ValueError(f"{what} buffer must be 1-D {self.dtype} of length "
                             f"{self.num_params}, got {array.dtype} {array.shape}")
        if not array.flags.c_contiguous:
            raise ValueError(f"{what} buffer must be contiguous")
        if get_array_module(array) is not self.xp:
            raise ValueError(f"{what} buffer lives on the wrong device for this model")

    def bind_flat(self, params=None, grads=None) -> None:
        """Re-point every layer's views at other flat buffers (None: keep the current one).

        Each must be 1-D, contiguous, ``num_params`` long, of the model's dtype and device;
        raises ValueError otherwise.
        """
        params = self.params if params is None else params
        grads = self.grads if grads is None else grads
        self._check_flat(params, "params")
        self._check_flat(grads, "grads")
        self.params, self.grads = params, grads
        for (_, layer), (pviews, gviews) in zip(self.layers, self._views(params, grads)):
            layer.bind(pviews, gviews)

    def param_names(self) -> List[str]:
        """Return parameter names in buffer order."""
        return [s.name for s in self._slots]

    def param_offsets(self) -> Dict[str, Tuple[int, int, tuple]]:
        """Return name -> (start, stop, shape) in the flat buffers."""
        return {s.name: (s.start, s.stop, s.shape) for s in self._slots}

    def named_params(self) -> dict:
        """Return name -> view of ``params`` in PyTorch layout."""
        return {s.name: self.params[s.start:s.stop].reshape(s.shape) for s in self._slots}

    def named_grads(self) -> dict:
        """Return name -> view of ``grads`` in PyTorch layout."""
        return {s.name: self.grads[s.start:s.stop].reshape(s.shape) for s in self._slots}

    def fc_start(self) -> int:
        """Return the index in ``layers`` of the first Linear layer (ValueError if none)."""
        for index, (_, layer) in enumerate(self.layers):
            if isinstance(layer, Linear):
                return index
        raise ValueError(f"model {self.name} has no Linear layer")

    # --- compute

    def as_input(self, x):
        """``x`` as the first layer takes it: an array of the model's module and dtype, its shape checked."""
        x = self.xp.asarray(x)
        if x.ndim != 4 or tuple(x.shape[1:]) != self.input_shape:
            raise ValueError(f"model {self.name} expects input (B, {', '.join(map(str, self.input_shape))}), "
                             f"got {tuple(x.shape)}")
        return x.astype(self.dtype, copy=False)

    def forward(self, x, train: bool = True):
        """Return the logits (B, num_classes) of the batch ``x`` (B, *input_shape), on ``xp``.

        ``train``: keep what ``backward`` needs (and apply dropout). Raises ValueError for
        an input of another shape.
        """
        return self.forward_layers(self.as_input(x), 0, None, train)

    def backward(self, dlogits) -> None:
        """Back-propagate ``dlogits`` (B, num_classes) after ``forward(train=True)``; every
        slot of ``grads`` is overwritten."""
        return self.backward_layers(dlogits, 0, None)

    def forward_layers(self, x, start: int = 0, stop: Optional[int] = None, train: bool = True):
        """Run ``layers[start:stop]`` forward on activations ``x`` (no input checks); return
        their output. ``layer_hook("forward", index)`` follows each layer. On the CPU a
        ReLU next to a pool, both in the range, is applied by the pool
        (:meth:`_fused_pairs`)."""
        hook = self.layer_hook
        span = range(len(self.layers))[start:stop]
        for index in span:
            with trace.span("forward", layer=self.layers[index][0]):
                x = self.forward_layer(index, x, train, span)
            if hook is not None:
                hook("forward", index)
        return x

    def forward_layer(self, index: int, x, train: bool = True, span: Optional[range] = None):
        """Run layer ``index`` forward on ``x`` as :meth:`forward_layers` does when it runs
        the layers in ``span`` (default: all of them): on the CPU a ReLU whose pool is also
        in the span passes ``x`` through, and the pool applies it; on a GPU a bias whose next
        layer is also in the span is added by that layer's kernel (:meth:`_bias_pairs`)."""
        layer = self.layers[index][1]
        if self._bias_next or self._bias_to_loss:                # a GPU: fused biases
            fused = self._forward_biased(index, layer, x, train, span)
            if fused is not None:
                return fused
        partner = self._fused.get(index)
        if partner is None or (span is not None and partner not in span):
            return layer.forward(x, train)
        if isinstance(layer, ReLU):                              # its pool applies it
            return layer.pass_through(x, train)
        return layer.forward(x, train, rectify=True)

    def _forward_biased(self, index, layer, x, train, span):
        """Run layer ``index`` forward with a bias handed over (:meth:`_bias_pairs`), both
        layers in ``span``; return None when it has none."""
        def inside(i):
            return span is None or i in span
        if self._bias_to_loss and index == len(self.layers) - 1:
            return layer.forward(x, train, add_bias=False, bias_grad=False)
        consumer = self._bias_next.get(index)
        if consumer is not None and inside(consumer[0]):
            if consumer[1]:
                return layer.forward(x, train, add_bias=False, bias_grad=False)
            return layer.forward(x, train, add_bias=False)
        producer = self._bias_from.get(index)
        if producer is not None and inside(producer):
            owner = self.layers[producer][1]
            if self._bias_next[producer][1]:
                return layer.forward(x, train, bias=owner.params["bias"],
                                     dbias=owner.grads["bias"])
            return layer.forward(x, train, bias=owner.params["bias"])
        return None

    def backward_layers(self, d, start: int = 0, stop: Optional[int] = None):
        """Run ``layers[start:stop]`` backward from their output gradient ``d``; return dx
        (None when ``start`` is 0: the first layer computes no input gradient).
        ``layer_hook("backward", index)`` follows each layer."""
        hook = self.layer_hook
        for index in reversed(range(len(self.layers))[start:stop]):
            name, layer = self.layers[index]
            with trace.span("backward", layer=name):
                d = layer.backward(d)
            if hook is not None:
                hook("backward", index)
        return d

    def _correct(self, logits, labels):
        return int(to_numpy((logits.argmax(axis=1) == labels).sum()))

    def loss_and_grad(self, x, labels):
        """Forward, mean softmax cross-entropy, backward into ``grads``; return (loss, correct).

        ``x``: (B, *input_shape) images; ``labels``: B class indices. ``correct``: how many
        of the B the model classified right (before this step's update). On the CPU both
        are Python numbers; on a GPU both are 0-d device arrays (``float()``/``int()``
        read them), so the step does not wait for the device.
        """
        labels = self.xp.asarray(labels).reshape(-1)
        last = self.layers[-1][1]
        # On a GPU the loss kernel adds the last Linear's bias and writes its gradient.
        to_loss = self.xp is not np and isinstance(last, Linear)
        self._bias_to_loss = to_loss
        try:
            logits = self.forward(x, train=True)
        finally:
            self._bias_to_loss = False
        with trace.span("loss"):
            if to_loss:
                loss = self.loss_layer.forward(logits, labels, bias=last.params["bias"],
                                               dbias=last.grads["bias"])
            else:
                loss = self.loss_layer.forward(logits, labels)
            dlogits = self.loss_layer.backward()
        self.backward(dlogits)
        if self.loss_layer.correct is not None:       # the fused kernel's device values
            return loss, self.loss_layer.correct
        return float(loss), self._correct(logits, labels)

    def evaluate(self, x, labels, batch_size: int = 128) -> Tuple[float, int]:
        """Return (mean loss, correct count) over ``x`` in inference mode, ``batch_size``
        samples at a time; ``grads`` untouched. Raises ValueError for an empty ``x``."""
        n = len(x)
        if n == 0:
            raise ValueError("evaluate needs at least one sample")
        total, correct = 0.0, 0
        loss_layer = SoftmaxCrossEntropy()
        for start in range(0, n, batch_size):
            xb = x[start:start + batch_size]
            yb = self.xp.asarray(labels[start:start + batch_size]).reshape(-1)
            logits = self.forward(xb, train=False)
            total += float(loss_layer.forward(logits, yb)) * len(xb)
            correct += self._correct(logits, yb)
        return total / n, correct

    # --- export / import

    def state(self) -> Dict[str, np.ndarray]:
        """Return name -> host NumPy copy in PyTorch layout."""
        return {name: to_numpy(view).copy() for name, view in self.named_params().items()}

    def load_state(self, state: dict) -> None:
        """Copy ``state`` (name -> array, host or device) into the parameters.

        Raises ValueError, changing nothing, unless names and shapes match the model's.
        """
        views = self.named_params()
        missing = [n for n in views if n not in state]
        extra = [n for n in state if n not in views]
        if missing or extra:
            raise ValueError(f"state does not match model {self.name}: "
                             f"missing {missing}, unexpected {extra}")
        for name, view in views.items():
            value = np.asarray(to_numpy(state[name]))
            if value.shape != view.shape:
                raise ValueError(f"parameter {name}: shape {value.shape}, model has {view.shape}")
        for name, view in views.items():
            view[...] = self.xp.asarray(to_numpy(state[name]).astype(self.dtype, copy=False))

    def __repr__(self):
        lines = [f"Model({self.name}, input {self.input_shape}, {self.num_params} params, {self.dtype})"]
        for (lname, layer), shape in zip(self.layers, self.shapes):
            lines.append(f"  {lname:8s} {layer!r:50s} -> {shape.out_shape}")
        return "\n".join(lines)


def build_model(name: str, dtype: str = "float32", xp=np, seed: int = 0,
                num_classes: Optional[int] = None) -> Model:
    """Build model ``name`` from MODELS with seeded initial parameters on ``xp``.

    ``num_classes``: the last layer's outputs (None: the spec's default; at least 2).
    Raises ValueError for an unknown name or fewer than 2 classes.
    """
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}: choose one of {', '.join(MODELS)}")
    spec = MODELS[name]
    classes = spec.num_classes if num_classes is None else int(num_classes)
    if classes < 2:
        raise ValueError(f"num_classes must be >= 2, got {classes}")
    return Model(spec.build(classes, seed), spec.input_shape, classes, dtype=dtype, xp=xp,
                 seed=seed, name=name)
