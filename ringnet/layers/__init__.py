"""Layers: each forward next to its backward, on NumPy or CuPy arrays."""
from ringnet.layers.activation import Dropout, ReLU
from ringnet.layers.base import Layer, check_init, init_array
from ringnet.layers.conv import Conv2d, conv_output_size
from ringnet.layers.linear import Flatten, Linear
from ringnet.layers.loss import SoftmaxCrossEntropy
from ringnet.layers.pool import AvgPool2d, MaxPool2d, pool_output_size

__all__ = ["Layer", "Conv2d", "MaxPool2d", "AvgPool2d", "Linear", "ReLU", "Dropout",
           "Flatten", "SoftmaxCrossEntropy", "init_array", "check_init",
           "conv_output_size", "pool_output_size"]
