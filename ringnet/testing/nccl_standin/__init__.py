"""A strict stand-in for CuPy's CUDA runtime and ``cupy.cuda.nccl``, on host memory over MPI.

Its parts: :mod:`.devices` (devices, streams, events: ``cuda``), :mod:`.memory` (what NCCL
writes and who may see it), :mod:`.communicator` (groups, launch order, the communicator)
and :mod:`.common` (constants, errors, the lock over the shared state).

It lets CI run ringnet's NCCL path (:class:`~ringnet.comm.NcclTransport`: its streams,
events, launch order and watchdog) without a GPU, and turns what real CUDA and NCCL would
turn into a context on the wrong GPU, a hang or wrong data into an error on the rank that
sees it. It is never picked silently: the transport uses it only with
``RINGNET_NCCL=standin`` or ``NcclTransport(nccl="standin")``.

**The surface.** ``cuda`` mirrors the part of ``cupy.cuda`` the transport uses:
``Device(id)`` (``.id``, ``.use()``, a ``with`` block, ``.synchronize()``),
``Stream(non_blocking=...)`` (``.ptr``, ``.record()``, ``.wait_event()``,
``.synchronize()``, ``.done``, a ``with`` block), ``Event(block=..., disable_timing=...)``
(``.record()``, ``.done``, ``.synchronize()``), ``get_current_stream()`` and
``runtime.getDeviceCount()`` / ``runtime.deviceGetPCIBusId()``. The NCCL part is
``get_unique_id``, ``NcclCommunicator(size, unique_id, rank)`` with ``send``/``recv(ptr,
count, dtype, peer, stream)``, ``allReduce``, ``abort``, ``destroy``,
``check_async_error``, and the thread's ``groupStart``/``groupEnd``. Buffers are NumPy
arrays: pointers are host addresses (:func:`host_pointer` also keeps the array alive while
the stand-in tracks what was written into it), "device memory" is host memory and
"kernels" are the NumPy code the calling thread runs.

**Devices.** The stand-in machine has :data:`DEVICE_COUNT` GPUs. The first device a
process uses (selects, or makes a stream, event or communicator on) is its device;
:func:`bind` selects world rank r's, ``1 + r % 7``, so that device 0, where CUDA puts a
thread that never selected one, is no rank's. From then on every CUDA or NCCL call,
including destroying an event or a stream, on a thread whose current device is another
one fails: it raises :class:`NcclRuleError` there, and the rank stays failed (every later
call on any thread raises the same, as a CUDA context error sticks) so that a call on a
background thread is seen by the training thread too (:func:`violations`,
:func:`clear_violations`).

**Streams and events.** Every stream has a thread of its own standing for the GPU: the
NCCL operations enqueued on it run there, one after the other, when the stream reaches
them; ``groupEnd`` only enqueues. An event recorded on a stream completes when the stream
has run everything enqueued before the record. What an operation writes (a receive, an
all-reduce's result) stays out of reach until something orders the reader after it:

* bytes an operation is going to write or has written may be read or written by an NCCL
  operation of another stream only after an event orders that stream after the writer
  (``wait_event``, or a host ``synchronize``); otherwise it raises;
* once run, a written buffer holds *poison* (0xFF bytes: NaN in every float type) until
  a reader is ordered after it: the host code of the thread that issued the operation
  when it waits on it (:meth:`Event.host_work`, :meth:`Stream.host_work`: host code
  stands for the kernels a GPU would queue behind it on the same stream), a thread whose
  stream waited on an event recorded after it (``wait_event`` returns once the event
  completed: the caller's host code comes next), or a host ``synchronize``;
* where a stream's thread hands its work to other threads (:meth:`Stream.hand_off`; the
  transport calls it at the end of each operation of a stream) the results not yet
  ordered for anyone turn to poison again, until a reader is ordered after the event
  recorded next; the stream's own later operations still see them.

So a missing event wait reads NaN, or raises where NCCL reads the bytes, on every run.
A query (``Event.done``) reports completion but orders nothing. Host code writing memory
is not seen (the stand-in tracks what NCCL writes, and leaves bytes that host code
changed since to that code).

**NCCL's rules.** Each raises :class:`NcclRuleError` on the rank that sees it:

* two threads inside one communicator at once (a thread is inside from its first
  operation in an open group until ``groupEnd``), or one communicator used from a second
  thread at all (its operations are then ordered across ranks only by timing);
* ranks whose operations on one communicator differ: every message carries the
  sender's per-peer sequence number, kind, peer, count, dtype (and for collectives the
  communicator-wide collective number and reduction op), compared on receipt;
* operations on two communicators of one device launched in different orders by two
  ranks (the receiver compares the device-wide launch numbers of the operations it
  receives from one peer; NCCL kernels of one device can then wait on each other);
* an operation launched while another communicator of the device is not warmed up: a
  communicator is warm once it has sent to and received from every peer and run one
  collective (NCCL connects ranks and allocates device memory at first use, which can
  deadlock with kernels already running); a communicator made while another of the
  device has operations in flight;
* unbalanced ``groupStart``/``groupEnd``, one group on two streams; any use after
  ``abort`` or ``destroy``; ``destroy`` with operations in flight;
* a send and its matching receive of different sizes or dtypes.

A send completes only once its receive has started (synchronous MPI send), as an NCCL
send does. An operation whose peer never posts the match fails after
``RINGNET_COMM_TIMEOUT`` seconds (or the communicator's ``timeout_s``) instead of hanging:
the error is asynchronous, as in NCCL (``check_async_error`` raises it; the stream goes
on, so waits on it end); any later launch on that communicator raises it.
"""
from ringnet.testing.nccl_standin.common import (  # noqa: F401 - the constants cupy's nccl has
    DEVICE_COUNT, HOST_MEMORY, NCCL_CHAR, NCCL_DOUBLE, NCCL_FLOAT, NCCL_FLOAT16, NCCL_FLOAT32,
    NCCL_FLOAT64, NCCL_HALF, NCCL_INT, NCCL_INT8, NCCL_INT32, NCCL_INT64, NCCL_MAX, NCCL_MIN,
    NCCL_PROD, NCCL_SUM, NCCL_UINT8, NCCL_UINT32, NCCL_UINT64, POISON, HEADER_LEN, HEADER_TAG,
    PAYLOAD_TAG, NcclError, NcclRuleError, available, get_version)
from ringnet.testing.nccl_standin.communicator import (NcclCommunicator, get_unique_id, groupEnd,
                                                     groupStart)
from ringnet.testing.nccl_standin.devices import (Device, Event, Stream, bind, clear_violations, cuda,
                                                device_for, get_current_stream, host_pointer,
                                                runtime, violations)

__all__ = ["available", "HOST_MEMORY", "NcclError", "NcclRuleError", "NcclCommunicator",
           "get_unique_id", "get_version", "groupStart", "groupEnd", "cuda", "Device",
           "Stream", "Event", "get_current_stream", "runtime", "DEVICE_COUNT", "bind",
           "device_for", "host_pointer", "violations", "clear_violations"]
