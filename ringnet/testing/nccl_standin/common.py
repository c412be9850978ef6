"""The stand-in's NCCL constants, its errors, its deadline and the lock over its shared
state (see :mod:`ringnet.testing.nccl_standin`)."""
import os
import threading

import numpy as np

available = True
HOST_MEMORY = True      # buffers are host pointers; what tells the transport it is the stand-in

NCCL_INT8 = NCCL_CHAR = 0
NCCL_UINT8 = 1
NCCL_INT32 = NCCL_INT = 2
NCCL_UINT32 = 3
NCCL_INT64 = 4
NCCL_UINT64 = 5
NCCL_FLOAT16 = NCCL_HALF = 6
NCCL_FLOAT32 = NCCL_FLOAT = 7
NCCL_FLOAT64 = NCCL_DOUBLE = 8
NCCL_SUM, NCCL_PROD, NCCL_MAX, NCCL_MIN = 0, 1, 2, 3

NUMPY = {0: np.int8, 1: np.uint8, 2: np.int32, 3: np.uint32, 4: np.int64, 5: np.uint64,
          6: np.float16, 7: np.float32, 8: np.float64}
REDUCE = {NCCL_SUM: np.add, NCCL_PROD: np.multiply, NCCL_MAX: np.maximum, NCCL_MIN: np.minimum}
UNIQUE_ID_BYTES = 128
JOIN_TAG, MEMBERS_TAG = 32101, 32102          # rendezvous on COMM_WORLD
HEADER_TAG, PAYLOAD_TAG = 1, 2                # on each communicator's private MPI group
SEND, RECV, ALLREDUCE = 1, 2, 3
KINDS = {SEND: "send", RECV: "recv", ALLREDUCE: "allReduce"}
# header: kind, sender rank, receiver rank, per-pair sequence, count, dtype, collective no.,
# op, the sender's device-wide launch number
HEADER_LEN = 9
POISON = 0xFF
DEVICE_COUNT = 8
# How many operations received from one peer each launch-order comparison looks back on.
ORDER_WINDOW = 2048


class NcclError(RuntimeError):
    """An NCCL call failed (a peer that never answered, a bad argument)."""


class NcclRuleError(NcclError):
    """A call that real CUDA or NCCL would turn into a wrong context, a hang or corrupt data."""


def get_version():
    """Return 0: no NCCL library behind this module."""
    return 0


def default_timeout_s():
    value = os.environ.get("RINGNET_COMM_TIMEOUT", "")
    try:
        return float(value) if value else 300.0
    except ValueError:
        return 300.0


# One lock over the shared state of this process's stand-in GPU: devices, streams, the
# writes in flight and the launch-order records (executing streams take it briefly).
state_lock = threading.RLock()
thread_state = threading.local()
