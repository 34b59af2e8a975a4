"""Random probes drawn on the device, identical on every backend.

A counter-based hash (murmur3's 32-bit finaliser on int32 with wrap-around,
written in ``keras.ops``) maps ``(seed, stream, probe index, word)`` to 32
random bits, so probe ``i`` of a given seed is the same vector on JAX,
TensorFlow and torch, needs no generator state, and is created where it is
used, in the model's dtype. Coordinates are numbered across a list of
tensors in order (the flat parameter vector); coordinate j of a Rademacher
probe is bit ``j % 32`` of word ``j // 32`` (1 means -1), so one hash serves
32 coordinates. A probe does not depend on how many are drawn together.

Streams keep unrelated draws apart: Hutchinson probes, Lanczos start
vectors, Hutch++ sketches and Monte-Carlo labels each have their own.
"""


import keras
import numpy as np
from keras import ops

from keras_geosam.curvature.kernels import KernelCache

STREAMS = {"hutchinson": 1, "lanczos": 2, "sketch": 3, "labels": 4, "exact-part": 5}

_C1 = -2048144789  # 0x85EBCA6B as int32
_C2 = -1028477387  # 0xC2B2AE35
_GOLDEN = -1640531535  # 0x9E3779B1
_C3 = 668265263  # 0x27D4EB2F


def _const(v):
    # Any Python integer, wrapped to a 32-bit word.
    return ops.convert_to_tensor(np.array(int(v) % (1 << 32), np.uint32).view(np.int32), dtype="int32")


def _lsr(h, k):
    # Logical right shift: arithmetic shift, then clear the copied sign bits.
    return ops.bitwise_and(ops.right_shift(h, k), _const((1 << (32 - k)) - 1))


def fmix32(h):
    """murmur3's finaliser, a bijection of 32-bit words (int32 tensors)."""
    h = ops.bitwise_xor(h, _lsr(h, 16))
    h = ops.multiply(h, _const(_C1))
    h = ops.bitwise_xor(h, _lsr(h, 13))
    h = ops.multiply(h, _const(_C2))
    return ops.bitwise_xor(h, _lsr(h, 16))


def key(seed, stream):
    """int32 key of a (seed, stream) pair; seed is any Python integer."""
    return fmix32(ops.bitwise_xor(fmix32(_const(seed)), _const(STREAMS[stream] * _C3)))


def subkey(k, index):
    """The `index`-th key derived from key `k` (independent draws from one
    seed, e.g. the groups of a sampled exact part)."""
    return fmix32(ops.bitwise_xor(k, fmix32(_const((int(index) + 1) * _GOLDEN))))


def bits(k, rows, cols):
    """32 random bits per (row, column): int32 tensor (len(rows), len(cols))."""
    r = fmix32(ops.add(k, ops.multiply(ops.cast(rows, "int32"), _const(_GOLDEN))))
    c = ops.multiply(ops.cast(cols, "int32"), _const(_GOLDEN))
    # Broadcast explicitly: TensorFlow's bitwise ops do not broadcast (n,1) x (1,m).
    shape = (int(ops.shape(r)[0]), int(ops.shape(c)[0]))
    r = ops.broadcast_to(r[:, None], shape)
    a = fmix32(ops.bitwise_xor(ops.broadcast_to(c[None, :], shape), r))
    return fmix32(ops.add(a, r))


def _uniform(h, dtype):
    # The top 24 bits: exact in float32, in [0, 1).
    return ops.cast(_lsr(h, 8), dtype) * ops.cast(2.0**-24, dtype)


def _rademacher_body(k, start, *, count, shapes, dtype):
    rows = ops.add(ops.arange(0, count, dtype="int32"), ops.cast(start, "int32"))
    # Each byte of a word indexes a table of its 8 signs: one gather writes
    # the probe, instead of several passes over count x dim elements.
    table = ops.convert_to_tensor(np.where((np.arange(256)[:, None] >> np.arange(8)) & 1, -1.0, 1.0), dtype=dtype)
    sizes = [int(np.prod(shape, dtype=np.int64)) for shape in shapes]
    # The whole flat vector's words hashed at once (one hash in the kernel,
    # not one per tensor: a Transformer's ~20 tensors made its compile 20
    # hashes long); each tensor then reads its own words.
    words = (sum(sizes) + 31) // 32
    h_all = bits(k, rows, ops.arange(0, words, dtype="int32"))  # (count, words)
    out, offset = [], 0
    for group in _groups(sizes):
        # Signs of a run of small tensors unpacked at once, then one slice
        # each: one unpacking per tensor made MobileNetV3Small's 284-tensor
        # kernel take ~9 s to compile. A large tensor is a run of its own,
        # so no copy of a large model's whole probe is made.
        size = sum(sizes[i] for i in group)
        w0, w1 = offset // 32, (offset + size - 1) // 32 + 1
        h = h_all[:, w0:w1]
        octets = ops.stack([ops.bitwise_and(ops.right_shift(h, 8 * i), _const(255)) for i in range(4)], axis=-1)
        signs = ops.reshape(ops.take(table, octets, axis=0), (count, 32 * (w1 - w0)))  # bit 8 i + j of each word
        at = offset - 32 * w0
        for i in group:
            out.append(ops.reshape(signs[:, at : at + sizes[i]], (count,) + tuple(shapes[i])))
            at += sizes[i]
        offset += size
    return out


# Tensors unpacked together while their run holds at most this many entries.
_GROUP_ELEMENTS = 1 << 18


def _groups(sizes):
    """Runs of consecutive tensor indices, each of at most
    ``_GROUP_ELEMENTS`` entries unless one tensor alone is larger."""
    groups, current, total = [], [], 0
    for i, size in enumerate(sizes):
        if current and total + size > _GROUP_ELEMENTS:
            groups.append(current)
            current, total = [], 0
        current.append(i)
        total += size
    return groups + [current] if current else groups


_KERNELS = KernelCache()


def rademacher(seed, start, count, shapes, dtype, stream="hutchinson"):
    """Probes ``start .. start+count-1``: a list like `shapes` of tensors with a
    leading axis `count` and entries +-1 in `dtype` (compiled once per
    layout)."""
    shapes = tuple(tuple(int(d) for d in s) for s in shapes)
    dtype = keras.backend.standardize_dtype(dtype)
    kernel = _KERNELS.get(_rademacher_body, count=int(count), shapes=shapes, dtype=dtype)
    return list(kernel(key(seed, stream), ops.convert_to_tensor(int(start), dtype="int32")))


def uniform(seed, rows, cols, dtype="float32", stream="labels"):
    """Uniform [0, 1) numbers for the given row and column indices."""
    return _uniform(bits(key(seed, stream), rows, cols), dtype)


def uniform_from_key(k, rows, cols, dtype="float32"):
    """:func:`uniform` for a key made by :func:`key` (e.g. passed into a
    compiled function as a tensor)."""
    return _uniform(bits(k, rows, cols), dtype)
