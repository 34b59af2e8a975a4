"""The active backend's module, chosen once at import time, and the contract
every backend module (``jax.py``, ``tensorflow.py``, ``torch.py``) keeps.

Everything outside this folder is written in ``keras.ops``; the few things
Keras does not offer (gradients, Hessian-vector products, vectorised
per-example gradients, compilation of a pure function) come from the active
backend's own AD through one thin module each. Every module exposes the same
functions, all taking a pure function ``f(params, *args)`` where ``params`` is
a list of backend tensors:

- ``value_and_grad(f, params, *args, has_aux=False, sparse=False)``: with
  `sparse`, TensorFlow may return a gather's (an Embedding's) gradient as a
  ``tf.IndexedSlices``; every other derivative below is dense
- ``densify(x)``: a gradient as a dense tensor (identity but for
  IndexedSlices); ``scale(x, alpha)``: ``alpha * x``, sparse if `x` is
- ``jvp(f, params, tangents, *args)`` -> ``(f(params), J tangents)``
- ``vjp(f, params, cotangent, *args)`` -> ``J^T cotangent`` (list)
- ``hvp(f, params, vectors, *args)`` -> Hessian of scalar ``f`` times ``vectors``
- ``hvp_batched(f, params, vectors, *args, unroll=False)`` -> the same for
  vectors with a leading probe axis k, linearising ``f`` once for all of
  them (``unroll``: one tangent pass per probe in the trace, no vmap)
- ``value_and_vjp(f, params, *args)`` -> ``(f(params), pull)``, ``pull(c)``
  = J^T c from the same forward pass
- ``linearize(f, params, *args)`` -> ``(f(params), jvp_fn, vjp_fn)``: J t and
  J^T c of a tensor-valued ``f``, both reusing one forward pass
- ``vjp_batched(f, params, *args, has_aux=False)`` -> ``(value, aux,
  pullback)`` where ``pullback(cotangents)`` takes cotangents with a leading
  axis k and may be called repeatedly on the one forward pass
- ``eigh(x)`` -> eigenvalues (ascending) and eigenvectors of a symmetric
  matrix, with the fastest solver for the device
- ``is_concrete(x)`` -> whether `x` holds values now (not a traced tensor)
- ``available_memory()`` -> bytes free now on the device the kernels use
  (the host's on a CPU), or None where it cannot be read
- ``per_example_grads(f, params, *batch)`` -> gradients of ``f(params, *example)``
  for every example along axis 0 of ``batch`` (vectorised, no Python loop)
- ``eager_steps``: True where a train step runs eagerly (torch), so its
  branches are decided on the host
- ``refresh_between_steps``: True where LLQR's in-step refresh runs
  between steps as a program of its own, timed by the host (JAX)
- ``slow_convolutions_in_loops``: True where a compiled loop over a
  convolutional network should be unrolled (XLA:CPU)
- ``batch_small_products``: True where same-shaped K-FAC blocks should be
  multiplied as one batched product (each op has a fixed cost there)
- ``loop_pullbacks``: True where repeated pullbacks of one forward pass
  (cotangent chunks) should run in a compiled loop, so one chunk's
  buffers are alive at a time (JAX); False where they are pulled back in a
  Python loop
- ``max_probe_block``: the most probes an operator hands one compiled
  product (an integer where a kernel's graph grows with them: TensorFlow),
  or None
- ``unrolled_probe_block``: an integer where products over a convolutional
  network should take their probes one at a time in the trace
  (``hvp_batched(..., unroll=True)``), in blocks of that many (XLA:CPU,
  whose vmapped convolutions are slow); None elsewhere
- ``compile(fn)`` -> a compiled version of a pure function (or ``fn`` itself)
- ``block_kernel(fn, static_argnames=())`` -> `fn` compiled once per shape
  where eager ops compile per shape (JAX), else `fn`: a curvature block's
  small arithmetic
- ``replica_count()`` / ``all_reduce_sum(tensors)``: tf.distribute replicas
  (a step's gradients are per-replica there); 1 / identity elsewhere
- ``sum_over_replicas(model, fn, x, y, offset)``: a batch's statistic
  ``fn(x, y, offset, share)`` computed on every tf.distribute replica's
  share of the batch and summed (the whole batch elsewhere)
- ``for_shapes(fn, *args)``: ``fn`` run for what it shows on the host
  (output shapes, Python flags), its values unused: traced abstractly on
  JAX (``jax.eval_shape``: no per-op compiles), run eagerly elsewhere
- ``device_constant(value)``: a NumPy value on the device, placed
  explicitly (no implicit host transfer inside a loop on JAX)
- ``distribute_batch(a)``: a streamed data batch as a tensor, split over the
  devices of an active JAX ``keras.distribution`` (data-parallel estimators)
- ``data_parallel_shards(model=None)``: devices one process's batch is split over
  (JAX keras.distribution batch axis, tf.distribute replicas; 1 elsewhere)
- ``wait_for_step(model)``: blocks until the steps ``fit`` queued have run
- ``process_count()``: processes in a multi-process JAX job (1 elsewhere)
- ``save_from_primary(save)``: runs ``save()`` on process 0 only under
  multi-process JAX (every process waits); ``save()`` elsewhere
- ``vdot(a, b, dtype=None)``: ``sum_i <a_i, b_i>`` over two lists of
  like-shaped tensors (norms and dot products of gradients; on torch a few
  fused calls instead of three Keras ops per tensor; IndexedSlices on
  TensorFlow without a dense copy)
- ``sandwich(A, Y, B)``: ``A Y_k B^T`` for every ``Y_k`` of a stack
  (a Kronecker product; A None drops it): einsum, two matmuls on torch
- ``add_scaled(y, x, alpha)``: ``y + alpha * x`` for a Python number or a
  scalar tensor, one pass over memory on eager torch; an IndexedSlices
  operand is scattered into the dense one
- ``multiply_into(xs, ys)``: ``[x * y]``, written into the xs on eager
  torch (the caller reads them no more; shared or strided xs excepted)
- ``compile_seconds()``: seconds this process has spent tracing and
  compiling steps (JAX's monitoring events; TensorFlow's traces of
  ``traced`` functions; 0 on eager torch), left out of timed steps
- ``traced(fn)``: `fn`, its runs during a TensorFlow trace counted
- ``step_timer(model)``: ``(timed, read)``, a device clock for work inside
  a traced step (TensorFlow's in-graph timestamps, without XLA or
  tf.distribute), or None
- ``uncompiled(fn)``: `fn` run eagerly inside a compiled step where the
  compiler cannot take it (torch.compile: LLQR's in-step refresh); `fn`
  itself where the step is traced whole (JAX, TensorFlow)
- ``cond_apply(pred, apply_fn, skip_fn, args, state=())``: a conditional optimizer
  update that is legal under tf.distribute
- ``gate_preparation(train_function, gate)``: JAX runs the optimizer's
  ``prepare_step`` (LLQR's refresh) between steps, as its own compiled
  program, so the step's program holds no refresh; identity elsewhere
"""

import keras

_name = keras.backend.backend()
if _name == "jax":
    from keras_geosam.backend import jax as _impl
elif _name == "tensorflow":
    from keras_geosam.backend import tensorflow as _impl
elif _name == "torch":
    from keras_geosam.backend import torch as _impl
else:  # numpy / openvino have no autodiff
    raise ImportError(
        f"keras_geosam needs a differentiable Keras backend (jax, tensorflow "
        f"or torch); KERAS_BACKEND is {_name!r}."
    )

name = _name
value_and_grad = _impl.value_and_grad
jvp = _impl.jvp
vjp = _impl.vjp
hvp = _impl.hvp
hvp_batched = _impl.hvp_batched
linearize = _impl.linearize
value_and_vjp = _impl.value_and_vjp
vjp_batched = _impl.vjp_batched
per_example_grads = _impl.per_example_grads
eigh = _impl.eigh
is_concrete = _impl.is_concrete
available_memory = _impl.available_memory
compile = _impl.compile
block_kernel = _impl.block_kernel
for_shapes = _impl.for_shapes
slow_convolutions_in_loops = _impl.slow_convolutions_in_loops
batch_small_products = _impl.batch_small_products
loop_pullbacks = _impl.loop_pullbacks
max_probe_block = _impl.max_probe_block
unrolled_probe_block = _impl.unrolled_probe_block
eager_steps = _impl.eager_steps
refresh_between_steps = _impl.refresh_between_steps
replica_count = _impl.replica_count
all_reduce_sum = _impl.all_reduce_sum
cond_apply = _impl.cond_apply
vdot = _impl.vdot
add_scaled = _impl.add_scaled
multiply_into = _impl.multiply_into
sandwich = _impl.sandwich
densify = _impl.densify
compile_seconds = _impl.compile_seconds
traced = _impl.traced
step_timer = _impl.step_timer
scale = _impl.scale
uncompiled = _impl.uncompiled
gate_preparation = _impl.gate_preparation
distribute_batch = _impl.distribute_batch
device_constant = _impl.device_constant
sum_over_replicas = _impl.sum_over_replicas
save_from_primary = _impl.save_from_primary
process_count = _impl.process_count
wait_for_step = _impl.wait_for_step
data_parallel_shards = _impl.data_parallel_shards

__all__ = [
    "name",
    "value_and_grad",
    "jvp",
    "vjp",
    "hvp",
    "hvp_batched",
    "linearize",
    "value_and_vjp",
    "vjp_batched",
    "per_example_grads",
    "eigh",
    "is_concrete",
    "compile",
    "slow_convolutions_in_loops",
    "batch_small_products",
    "loop_pullbacks",
    "max_probe_block",
    "available_memory",
    "block_kernel",
    "unrolled_probe_block",
    "for_shapes",
    "eager_steps",
    "refresh_between_steps",
    "replica_count",
    "all_reduce_sum",
    "cond_apply",
    "vdot",
    "add_scaled",
    "multiply_into",
    "sandwich",
    "densify",
    "compile_seconds",
    "traced",
    "step_timer",
    "scale",
    "uncompiled",
    "gate_preparation",
    "distribute_batch",
    "device_constant",
    "sum_over_replicas",
    "save_from_primary",
    "process_count",
    "wait_for_step",
    "data_parallel_shards",
]
