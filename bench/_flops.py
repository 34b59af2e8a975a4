"""FLOP counts for the benches' floors: a model's forward pass, counted from
the products it runs, and one application of LLQR's U, from its layout.

A forward pass is counted by running it once with Keras' product ops
wrapped (``ops.matmul``, ``einsum``, ``dot``, ``conv``, ``depthwise_conv``,
``dot_product_attention``, in both ``keras.ops`` and ``keras.src.ops``,
which keras-hub and Keras' own layers call): 2 FLOPs per multiply-add of
each, from the operands' shapes. Element-wise work (activations,
normalisation, softmax, the optimizer's update) is not counted: the floors
are about the products that dominate a step.
"""

import contextlib
import math
import string

_OPS = ("matmul", "einsum", "dot", "conv", "depthwise_conv", "dot_product_attention")


def _shape(x):
    return tuple(int(d) for d in x.shape)


def _matmul(a, b, *args, **kwargs):
    a, b = _shape(a), _shape(b)
    if len(a) == 1 or len(b) == 1:
        return 2 * math.prod(a) * (b[-1] if len(b) > 1 else 1)
    batch = max(math.prod(a[:-2]), math.prod(b[:-2]))
    return 2 * batch * a[-2] * a[-1] * b[-1]


def _einsum(equation, *operands, **kwargs):
    inputs = equation.replace(" ", "").split("->")[0].split(",")
    sizes = {}
    for spec, x in zip(inputs, operands):
        shape = _shape(x)
        if "..." in spec:  # the ellipsis' axes as letters of their own
            free = [c for c in string.ascii_letters if c not in equation][: len(shape) - len(spec) + 3]
            spec = spec.replace("...", "".join(free))
        sizes.update(zip(spec, shape))
    return 2 * math.prod(sizes.values())


def _conv(inputs, kernel, strides=1, padding="valid", data_format=None, dilation_rate=1, **kwargs):
    x, k = _shape(inputs), _shape(kernel)
    spatial = len(k) - 2
    strides = (strides,) * spatial if isinstance(strides, int) else tuple(strides)
    channels_last = (data_format or "channels_last") == "channels_last"
    size = x[1:1 + spatial] if channels_last else x[2:]
    if padding == "same":
        out = [-(-s // st) for s, st in zip(size, strides)]
    else:
        out = [(s - kk) // st + 1 for s, kk, st in zip(size, k[:spatial], strides)]
    return 2 * x[0] * math.prod(out) * math.prod(k)


def _depthwise(inputs, kernel, strides=1, padding="valid", data_format=None, dilation_rate=1, **kwargs):
    return _conv(inputs, kernel, strides, padding, data_format, dilation_rate)


def _attention(query, key, value, *args, **kwargs):
    q, k = _shape(query), _shape(key)  # (batch, T, heads, dim)
    return 2 * 2 * q[0] * q[1] * k[1] * q[2] * q[3]


_COUNTERS = {"matmul": _matmul, "dot": _matmul, "einsum": _einsum, "conv": _conv,
             "depthwise_conv": _depthwise, "dot_product_attention": _attention}


@contextlib.contextmanager
def counting():
    """Counts the FLOPs of Keras' product ops run inside; yields a one-item
    list holding the running total."""
    import keras
    from keras.src import ops as src_ops

    total = [0]
    saved = []
    for module in (keras.ops, src_ops):
        for name in _OPS:
            original = getattr(module, name, None)
            if original is None:
                continue

            def counted(*args, _original=original, _count=_COUNTERS[name], **kwargs):
                total[0] += _count(*args, **kwargs)
                return _original(*args, **kwargs)

            saved.append((module, name, original))
            setattr(module, name, counted)
    try:
        yield total
    finally:
        for module, name, original in saved:
            setattr(module, name, original)


def forward_flops(model, x):
    """FLOPs of one inference forward pass of `model` on `x` (eager)."""
    with counting() as total:
        model(x, training=False)
    return total[0]


def u_flops(layout):
    """FLOPs of one application of U from its layout ``[(block class,
    shape, split)]`` (``optimizer.preconditioner.layout``), matrix view
    (m, n) = (prod(shape[:split]), prod(shape[split:])): a KFAC block
    A X B^T costs 2 (m^2 n + m n^2), an EKFAC block twice that (two basis
    changes each way, the scaling not counted), a DiagonalInputKFAC block
    (an Embedding) diag(a) X B^T 2 m n^2 and a DiagonalInputEKFAC
    (s * (X Q_G)) Q_G^T 4 m n^2; diagonal blocks are element-wise (not
    counted)."""
    total = 0
    for cls, shape, split in layout:
        if split is None:
            continue
        m, n = math.prod(shape[:split]), math.prod(shape[split:])
        name = cls.__name__
        if name.startswith("DiagonalInput"):
            total += (2 if name.endswith("EKFAC") else 1) * 2 * m * n * n
        else:
            total += (2 if name == "EKFAC" else 1) * 2 * (m * m * n + m * n * n)
    return total
