"""The one value codec: msgpack for structure, raw frames for tensor bytes. A node's values
travel by it wherever they cross a process: the data plane between controllers and replica
processes (:mod:`runtime.zmq`), and a call's values to a node's training ranks
(:mod:`runtime.ranks`).

:func:`encode_value` turns a value into ``[header, *buffers]``: ``header`` is a msgpack tree
in which tensors, numpy arrays, PIL images, tuples and msgspec Structs are msgpack
extension objects; a tensor's extension holds ``(dtype, shape, device, where)``, where
``where`` is the bytes themselves (tensors up to :data:`INLINE_BYTES`), the index of a
buffer frame (sent with ``copy=False``, rebuilt with ``torch.frombuffer``: no copy on
either side), or a shared-memory handle (``encode_value(..., shm=)``; the ZeroMQ runtime's
``ShmPool`` in ``runtime/zmq/transport.py``). A CPU tensor of at most :data:`INLINE_BYTES`
with a numpy dtype takes a compact extension instead (dtype byte, ndim byte, sizes, bytes),
read without a nested msgpack decode: the dispatch path.

What can travel: None, bool, int (64-bit), float, str, bytes, list, tuple, dict with str
keys, torch tensors (any dense dtype incl. bfloat16 and float8; non-contiguous ones are
made contiguous; ``requires_grad`` is dropped; CUDA tensors arrive on the receiver's
current CUDA device, or on the CPU where it has none), numpy arrays and scalars of
bool/int/uint/float/complex dtypes, PIL images (mode, size, pixels and palette; ``info``
metadata is dropped), and msgspec Structs whose class is registered with
:func:`register_struct` or already imported by the receiver. Nothing is pickled; anything
else raises :class:`UnsupportedValueError` naming where in the value it sits.

A CUDA tensor is copied to host memory on the sender (the "CPU fallback") unless
``encode_value(..., cuda_ipc=)`` allows its GPU: then, between controllers on one host that
see that GPU, it travels by CUDA IPC (a msgpack extension holding torch's IPC handles, no
pickle) and arrives in the sender's GPU memory, on the receiver's ordinal of that GPU, with
its strides; see :mod:`runtime.codec.cuda_ipc` for when, and what keeps the memory alive.

Subclasses of list/dict/tuple/int/float/str arrive as the base type (an OrderedDict as a
dict, a namedtuple as a tuple, an IntEnum as an int).

Dicts with keys other than str (an optimizer's ``state_dict()`` has int keys) travel only
with ``encode_value(..., any_keys=True)``: the runtime uses it for node state (checkpoints
of a ZeroMQ run), not for data between nodes. Keys may then be None, bool, int, float, str,
bytes or tuples of those. The decoder accepts such dicts always: decoding never runs code.

This package's ``__all__`` is the codec's API. The encoder is :mod:`runtime.codec.encode`, the
decoder :mod:`runtime.codec.decode`, and what both sides share (extension codes, the dtype
table, errors) :mod:`runtime.codec.wire`; CUDA IPC's fields and lifetime rules are in
:mod:`runtime.codec.cuda_ipc`. Nothing here opens a socket: the codec sits below every
runtime that moves its frames.
"""

from runtime.codec.decode import decode_value
from runtime.codec.encode import encode_value
from runtime.codec.wire import (
    INLINE_BYTES,
    TENSOR_DTYPES,
    DecodeError,
    UnsupportedValueError,
    register_struct,
)

__all__ = [
    "INLINE_BYTES",
    "TENSOR_DTYPES",
    "DecodeError",
    "UnsupportedValueError",
    "decode_value",
    "encode_value",
    "register_struct",
]
