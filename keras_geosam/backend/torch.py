"""PyTorch specialisation: torch.autograd and torch.func.

Keras layers read ``Variable.value``, so parameters are substituted through
``keras.StatelessScope`` inside ``f`` (``torch.func.functional_call`` would
have no effect); here we only differentiate ``f`` with respect to the tensors
it is given.
"""

import collections

import keras
import torch
import torch.func


def _math_attention(fn):
    """`fn` run with PyTorch's math kernel for scaled dot-product attention.

    Keras' MultiHeadAttention calls ``scaled_dot_product_attention``, which
    on the CPU picks a fused (flash) kernel whose backward has no derivative
    of its own and no vmap batching rule: a double backward (HVPs, GGN
    products, LLQR's refresh), a forward-mode product or a vectorised
    per-example gradient through it fails or falls back to a slow loop. The
    math kernel is plain differentiable ops. First-order training (the
    train step's gradients) keeps the fused kernel.
    """
    import functools

    from torch.nn.attention import SDPBackend
    from torch.nn.attention import sdpa_kernel

    @functools.wraps(fn)
    def run(*args, **kwargs):
        with sdpa_kernel([SDPBackend.MATH]):
            return fn(*args, **kwargs)

    return run


def _leaves(params):
    return [p.detach().requires_grad_(True) for p in params]


def _fill(grads, params):
    return [torch.zeros_like(p) if g is None else g for g, p in zip(grads, params)]


# Convolutions run as fast inside compiled loops as outside.
slow_convolutions_in_loops = False

# Each eager op costs a dispatch and, with OpenMP threads that sleep, a
# wake-up (~0.1 ms for a 64x64 matmul): same-shaped K-FAC blocks run as one
# batched product (U's product on the bench ViT: 9.6 -> 5.4 ms).
batch_small_products = True

# Eager: a Python loop already frees each chunk's buffers before the next.
loop_pullbacks = False

# Eager: nothing is traced, so a block of any size costs no more to build.
max_probe_block = None

# Eager: probes are never traced, so nothing to unroll.
unrolled_probe_block = None


# Steps run eagerly: a data-dependent branch in a step is decided on the host.
eager_steps = True

# LLQR's refresh runs inside the eager step, decided on the host.
refresh_between_steps = False

# Eager torch decides a branch on the host: on an accelerator every
# data-dependent ``if`` is a synchronisation, which a step avoids by running
# both branches and selecting (cond_apply). On the CPU there is nothing to
# wait for, and the branch is cheaper.
BRANCH_FREE = torch.cuda.is_available()


def value_and_grad(f, params, *args, has_aux=False, sparse=False):
    # torch's gradients here are dense (Keras' Embedding uses a dense
    # lookup): `sparse` changes nothing.
    with torch.enable_grad():
        leaves = _leaves(params)
        out = f(leaves, *args)
        value = out[0] if has_aux else out
        grads = torch.autograd.grad(value, leaves, allow_unused=True)
    grads = [g.detach() for g in _fill(grads, leaves)]
    if has_aux:
        # Detached, as values: a SAM step's centre outputs live to its end,
        # and ops on them (the metrics) would otherwise record a graph.
        return (value.detach(), _detach(out[1])), grads
    return value.detach(), grads


@_math_attention
def jvp(f, params, tangents, *args):
    return torch.func.jvp(lambda p: f(p, *args), (list(params),), (list(tangents),))


def vjp(f, params, cotangent, *args):
    with torch.enable_grad():
        leaves = _leaves(params)
        out = f(leaves, *args)
        grads = torch.autograd.grad(out, leaves, grad_outputs=cotangent, allow_unused=True)
    return [g.detach() for g in _fill(grads, leaves)]


@_math_attention
def hvp(f, params, vectors, *args):
    # Forward-over-reverse with torch.func (functorch refuses
    # torch.autograd.grad inside its transforms, so f is differentiated by
    # torch.func.grad), about two to three gradients in cost.
    grad_f = torch.func.grad(lambda p: f(p, *args))
    with torch.no_grad():
        return list(torch.func.jvp(grad_f, (list(params),), (list(vectors),))[1])


def _batched_grad(outputs, leaves, cotangents):
    """Gradients of `outputs` for every cotangent along axis 0, on a retained
    graph: vectorised by autograd (``is_grads_batched``) where every op in the
    graph supports it, one backward per cotangent otherwise."""
    try:
        grads = torch.autograd.grad(
            outputs, leaves, grad_outputs=cotangents, is_grads_batched=True,
            retain_graph=True, allow_unused=True,
        )
    except RuntimeError as e:
        # An op without a batching rule ("vmap" / "batching rule" / "not
        # implemented"); anything else (out of memory, ...) is raised.
        text = str(e).lower()
        if not any(s in text for s in ("vmap", "batch", "not implemented", "nyi")):
            raise
        k = int(cotangents[0].shape[0])
        rows = [
            torch.autograd.grad(outputs, leaves, grad_outputs=[c[i] for c in cotangents], retain_graph=True, allow_unused=True)
            for i in range(k)
        ]
        grads = [None if r[0] is None else torch.stack(r) for r in zip(*rows)]
    k = int(cotangents[0].shape[0])
    return [
        g.detach() if g is not None else torch.zeros((k,) + tuple(p.shape), dtype=p.dtype, device=p.device)
        for g, p in zip(grads, leaves)
    ]


@_math_attention
def hvp_batched(f, params, vectors, *args, unroll=False):
    # Reverse-over-reverse on one retained graph: the forward and the first
    # backward run once for all probes (leading axis k of `vectors`); eager,
    # so `unroll` changes nothing.
    with torch.enable_grad():
        leaves = _leaves(params)
        loss = f(leaves, *args)
        grads = torch.autograd.grad(loss, leaves, create_graph=True, allow_unused=True)
        # Gradients that do not depend on the parameters contribute nothing.
        used = [i for i, g in enumerate(grads) if g is not None and g.requires_grad]
        if not used:
            return [torch.zeros((vectors[0].shape[0],) + tuple(p.shape), dtype=p.dtype, device=p.device) for p in leaves]
        return _batched_grad([grads[i] for i in used], leaves, [vectors[i] for i in used])


def value_and_vjp(f, params, *args):
    """``(f(params), pull)`` with ``pull(cotangent) = J^T cotangent`` from the
    same forward pass (``f`` may return a list); `pull` is called once."""
    with torch.enable_grad():
        leaves = _leaves(params)
        out = f(leaves, *args)
    outs = list(out) if isinstance(out, (list, tuple)) else [out]

    def pull(c):
        cots = list(c) if isinstance(out, (list, tuple)) else [c]
        pairs = [(o, k) for o, k in zip(outs, cots) if o.requires_grad]
        if not pairs:
            return [torch.zeros_like(p) for p in leaves]
        with torch.enable_grad():
            grads = torch.autograd.grad([o for o, _ in pairs], leaves, [k for _, k in pairs], allow_unused=True)
        return [g.detach() for g in _fill(grads, leaves)]

    return _detach(out), pull


@_math_attention
def linearize(f, params, *args):
    """``(f(params), jvp_fn, vjp_fn)``: J t and J^T c of the tensor-valued
    ``f`` at `params`, on one retained graph. J t is the derivative of the
    (linear) map c -> J^T c, so it needs no second forward pass either."""
    with torch.enable_grad():
        leaves = _leaves(params)
        out = f(leaves, *args)
        dummy = torch.zeros_like(out, requires_grad=True)
        pulled = torch.autograd.grad(out, leaves, dummy, create_graph=True, allow_unused=True)
    used = [i for i, g in enumerate(pulled) if g is not None and g.requires_grad]

    def vjp_fn(c):
        with torch.enable_grad():
            grads = torch.autograd.grad(out, leaves, c, retain_graph=True, allow_unused=True)
        return [g.detach() for g in _fill(grads, leaves)]

    def jvp_fn(t):
        if not used:
            return torch.zeros_like(out).detach()
        with torch.enable_grad():
            (j,) = torch.autograd.grad([pulled[i] for i in used], dummy, [t[i] for i in used], retain_graph=True)
        return j.detach()

    return out.detach(), jvp_fn, vjp_fn


@_math_attention
def vjp_batched(f, params, *args, has_aux=False):
    """``(value, aux, pullback)``; ``pullback(cotangents)`` maps cotangents
    with a leading axis k to gradients with that axis, reusing one forward."""
    with torch.enable_grad():
        leaves = _leaves(params)
        out = f(leaves, *args)
    value, aux = out if has_aux else (out, None)

    def pullback(cot):
        with torch.enable_grad():
            return _batched_grad([value], leaves, [cot])

    return value.detach(), _detach(aux), pullback


def _detach(tree):
    if isinstance(tree, torch.Tensor):
        return tree.detach()
    if isinstance(tree, (list, tuple)):
        return type(tree)(_detach(t) for t in tree)
    if isinstance(tree, dict):
        return {k: _detach(v) for k, v in tree.items()}
    return tree


def eigh(x):
    return torch.linalg.eigh(x)


@_math_attention
def per_example_grads(f, params, *batch):
    def one(*example):
        return torch.func.grad(f)(list(params), *[one_example(e) for e in example])

    try:
        with torch.no_grad():
            return torch.func.vmap(one)(*batch)
    except RuntimeError as e:
        # Keras' torch Conv layers clone to channels_last, which
        # torch.func.vmap does not implement yet ("NYI ... ChannelsLast");
        # it fails at that first op, so trying costs little.
        if "vmap" not in str(e) and "NYI" not in str(e):
            raise
    # Fallback: one functional gradient per example (a loop, so slower).
    n = keras.tree.flatten(batch[0])[0].shape[0]
    rows = [one(*[keras.tree.map_structure(lambda a: a[i], e) for e in batch]) for i in range(n)]
    return [torch.stack(parts) for parts in zip(*rows)]


# Eager torch ops compile nothing per shape.
def block_kernel(fn, static_argnames=()):
    return fn


def compile(fn):
    return fn


def sandwich(A, Y, B):
    """``A Y_k B^T`` for every ``Y_k`` of `Y` (k, m, n) (``Y_k B^T`` when `A`
    is None). Two matmuls: torch.einsum with three operands dispatches
    dozens of view and permute ops per call, which on an eager K-FAC step
    (two products per block per step) cost more than the products."""
    Y = torch.matmul(Y, B.mT)
    return Y if A is None else torch.matmul(A, Y)


def add_scaled(y, x, alpha):
    """``y + alpha * x`` in one pass over memory (two eager ops would make
    two): the LLQR refresh's heavy-ball update, 50 times per refresh, and
    the perturbed weights of a SAM step (`alpha` a scalar tensor there,
    never read on the host)."""
    if isinstance(alpha, torch.Tensor):
        return torch.addcmul(y, x, alpha)
    return torch.add(y, x, alpha=alpha)


def multiply_into(xs, ys):
    """``[x * y]``, each product written into its `x` (the caller reads the
    xs no more): an eager step's descent product U g_p then holds no second
    copy of the gradients at the update. An x that shares memory with
    another, is a view or is not dense gets a new tensor instead."""
    xs = list(xs)
    storages = collections.Counter(x.untyped_storage().data_ptr() for x in xs)

    def own(x, y):  # x alone in its whole storage, dense, and y fits into it
        whole = x.storage_offset() == 0 and x.untyped_storage().nbytes() == x.numel() * x.element_size()
        alone = storages[x.untyped_storage().data_ptr()] == 1
        return whole and alone and x.is_contiguous() and not x.requires_grad and x.dtype == y.dtype

    return [x.mul_(y) if own(x, y) else x * y for x, y in zip(xs, ys)]


# ATen runs an elementwise op or a reduction on the calling thread below this
# many elements (at::internal::GRAIN_SIZE); torch.dot goes to BLAS, which
# wakes its threads from a few thousand elements on.
_SERIAL_ELEMENTS = 32768


def _dot(x, y):
    """<x, y> of two flat tensors of one dtype. Below ATen's grain size an
    elementwise product and sum stays on this thread: with OpenMP threads
    that sleep (OMP_WAIT_POLICY=PASSIVE) a 16k-element BLAS dot costs ~75
    us in wake-ups against ~4 us (~2 us either way with spinning threads)."""
    if x.numel() < _SERIAL_ELEMENTS:
        return torch.sum(x * y)
    return torch.dot(x, y)


def vdot(a, b, dtype=None):
    """``sum_i <a_i, b_i>`` over two lists of like-shaped tensors, in
    `dtype` (default: their own). A squared norm (`b` is `a`) is one
    multi-tensor norm call; otherwise one dot per pair (``_dot``). The
    Keras-op version costs three dispatches per tensor, which on an eager
    step is a large share of a small model's SAM step."""
    if not a:
        from keras import ops

        return ops.zeros((), dtype or "float32")
    if dtype is not None:
        dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    if a is b and len({x.dtype for x in a} | ({dtype} if dtype else set())) == 1:
        # A squared norm: torch's multi-tensor norm kernel is ~2.5x faster
        # on CPU than one dot per tensor (and accumulates in double there).
        norms = torch.stack(torch._foreach_norm(a))
        return (norms * norms).sum()
    parts = []
    for x, y in zip(a, b):
        same = x is y
        # The pair's common dtype (as Keras promotes), unless one is asked.
        common = dtype or torch.promote_types(x.dtype, y.dtype)
        x = x.reshape(-1)
        x = x if x.dtype == common else x.to(common)
        y = x if same else y.reshape(-1)
        y = y if y.dtype == common else y.to(common)
        parts.append(_dot(x, y))
    return parts[0] if len(parts) == 1 else torch.stack(parts).sum()


def uncompiled(fn):
    """`fn`, run eagerly even inside a ``torch.compile``-d step
    (``jit_compile=True``): LLQR's in-step refresh differentiates twice,
    which compiled autograd does not support, and reads its step counter on
    the host; the compiler breaks the graph around it."""
    return torch.compiler.disable(fn)


def cond_apply(pred, apply_fn, skip_fn, args, state=()):
    """``apply_fn(*args)`` if `pred` else ``skip_fn()``; `state` lists every
    variable either branch may write.

    With ``BRANCH_FREE`` both run, from the same starting values, and each
    variable keeps ``where(pred, applied, skipped)``: no host read of
    `pred` (a non-finite applied value is never selected).
    """
    if not BRANCH_FREE:
        if bool(pred):
            apply_fn(*args)
        else:
            skip_fn()
        return
    state = list(state)
    start = [v.value.clone() for v in state]
    apply_fn(*args)
    applied = [v.value.clone() for v in state]
    for v, value in zip(state, start):
        v.assign(value)
    skip_fn()
    for v, value in zip(state, applied):
        v.assign(torch.where(pred, value, v.value))


# Keras offers no per-replica train step on this backend: gradients are global.
from keras_geosam.backend._single_device import all_reduce_sum  # noqa: E402,F401
from keras_geosam.backend._single_device import sum_over_replicas  # noqa: E402,F401
from keras_geosam.backend._single_device import device_constant  # noqa: E402,F401
from keras_geosam.backend._single_device import distribute_batch  # noqa: E402,F401
from keras_geosam.backend._single_device import data_parallel_shards  # noqa: E402,F401
from keras_geosam.backend._single_device import process_count  # noqa: E402,F401
from keras_geosam.backend._single_device import wait_for_step  # noqa: E402,F401
from keras_geosam.backend._single_device import save_from_primary  # noqa: E402,F401
from keras_geosam.backend._single_device import replica_count  # noqa: E402,F401

from keras_geosam.backend._generic import one_example  # noqa: E402
from keras_geosam.backend._generic import for_shapes  # noqa: E402,F401
from keras_geosam.backend._generic import is_concrete  # noqa: E402,F401
from keras_geosam.backend._generic import compile_seconds  # noqa: E402,F401
from keras_geosam.backend._generic import densify  # noqa: E402,F401
from keras_geosam.backend._generic import step_timer  # noqa: E402,F401
from keras_geosam.backend._generic import traced  # noqa: E402,F401
from keras_geosam.backend._generic import scale  # noqa: E402,F401

# Eager steps decide the refresh on the host, inside the step.
from keras_geosam.backend._generic import gate_preparation  # noqa: E402,F401


from keras_geosam.backend._generic import host_available_memory  # noqa: E402


def available_memory():
    """Bytes free on Keras' torch device now (the host's on a CPU)."""
    device = keras.ops.convert_to_tensor(0.0).device  # where Keras puts tensors
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    return host_available_memory() if device.type == "cpu" else None
