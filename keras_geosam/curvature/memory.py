"""Fail early, naming what to lower, when a request cannot fit in memory.

A batched curvature product (Hessian, GGN or residual times k probes) holds
at least, for each example of a streamed batch, one copy of every layer
output (the forward pass's, kept for the backward), and besides the
weights, the k probes and the k products: ``1 + 2k`` copies of the weights.
Per-example gradients of layers without a curvature rule hold a batch's
gradients of those variables at once. ``check_product`` and
``check_per_example_gradients`` compare these lower bounds with the memory
free now (``backend.available_memory``) before the first kernel runs, and
raise with the ``batch_size`` that fits, instead of an allocator's failure
deep inside a compiled program (JAX asked for 102 GB on MobileNetV3Small
before its depthwise rule) or the machine swapping. Compilers fuse and
reuse buffers, so only what must exist at once is counted: the bound never
refuses a request that fits, and catches the ones that are far off.

The activations are read from the model's functional graph (every layer
call's output shape, the example axis left out). A model without one
(subclassed ``call``) or with unknown sizes is not checked: the bound must
never refuse a request that fits.
"""

import numpy as np

from keras_geosam import backend
from keras_geosam import keras_internals


def activation_elements(model):
    """Elements of every layer output of one example, summed over the
    model's graph (nested models walked into), or None where the graph does
    not give them (a subclassed model, a dimension other than the example
    axis unknown)."""
    total = 0
    found = False
    for layer in [model] + keras_internals.flatten_layers(model):
        if type(layer).__name__ == "InputLayer" or keras_internals.flatten_layers(layer):
            continue  # inputs are data, a nested model's outputs are its layers'
        for shape in keras_internals.call_output_shapes(layer):
            if len(shape) == 0 or any(d is None for d in shape[1:]):
                return None
            total += int(np.prod(shape[1:], dtype=np.int64))
            found = True
    return total if found else None


def product_bytes(model, batch_size, num_probes, dtype_bytes=4):
    """``(bytes, per_example_bytes, fixed_bytes)``: the lower bound (module
    doc) of one batched product of `num_probes` probes on `batch_size`
    examples, or None where the activations are unknown."""
    elements = activation_elements(model)
    if elements is None:
        return None
    per_example = elements * dtype_bytes
    weights = (1 + 2 * int(num_probes)) * _size(model.trainable_variables) * dtype_bytes
    return int(batch_size) * per_example + weights, per_example, weights


def check_product(model, batch_size, num_probes, what, dtype_bytes=4):
    """Raises ``ValueError`` (module doc) when one batched product cannot
    fit in the memory free now; returns the bound in bytes (None when
    unknown)."""
    need = product_bytes(model, batch_size, num_probes, dtype_bytes)
    if need is None:
        return None
    _, per_example, fixed = need
    return check_fits(
        f"{what} on batches of {batch_size} examples with {num_probes} probes", batch_size, per_example, fixed,
        "the layers' outputs held for the backward pass", "the weights, the probes and their products",
        "lower the number of probes per product (num_probes) or use a smaller model")


def check_per_example_gradients(variables, batch_size, what, dtype_bytes=4):
    """Raises ``ValueError`` when `batch_size` examples' gradients of
    `variables` (materialised together: layers without a curvature rule)
    cannot fit in the memory free now."""
    per_example = _size(variables) * dtype_bytes
    return check_fits(
        f"{what} on batches of {batch_size} examples", batch_size, per_example, 0,
        "per-example gradients of " + ", ".join(v.path for v in variables[:3]) + (" ..." if len(variables) > 3 else ""),
        "nothing", "these variables' layers need a curvature rule (a diagonal structure does not help)")


def check_fits(what, batch_size, per_example, fixed, per_example_is, fixed_is, if_none_fits):
    """Raises ``ValueError`` naming the batch size that fits when
    ``batch_size * per_example + fixed`` bytes exceed the memory free now
    (``backend.available_memory``); returns that total (None when the free
    memory is unknown)."""
    free = backend.available_memory()
    if free is None:
        return None
    total = int(batch_size) * per_example + fixed
    if total <= free:
        return total
    fits = int((free - fixed) // per_example) if free > fixed and per_example else 0
    lower = f"lower batch_size to {fits} or fewer" if fits >= 1 else f"even one example does not fit: {if_none_fits}"
    gb = 2.0**30
    raise ValueError(
        f"{what} needs at least {total / gb:.2f} GB ({per_example / 2**20:.2f} MB per example for {per_example_is}, "
        f"plus {fixed / gb:.2f} GB for {fixed_is}), and {free / gb:.2f} GB is free: {lower}."
    )


def _size(variables):
    return sum(int(np.prod(v.shape, dtype=np.int64)) for v in variables)
