"""TensorFlow specialisation: GradientTape, ForwardAccumulator, vectorized_map."""

import tensorflow as tf

_ZERO = tf.UnconnectedGradients.ZERO


def value_and_grad(f, params, *args, has_aux=False):
    with tf.GradientTape() as tape:
        tape.watch(params)
        out = f(params, *args)
    value = out[0] if has_aux else out
    grads = tape.gradient(value, params, unconnected_gradients=_ZERO)
    return out, grads


def jvp(f, params, tangents, *args):
    with tf.autodiff.ForwardAccumulator(params, tangents) as acc:
        out = f(params, *args)
    return out, acc.jvp(out, unconnected_gradients=_ZERO)


def vjp(f, params, cotangent, *args):
    with tf.GradientTape() as tape:
        tape.watch(params)
        out = f(params, *args)
    return tape.gradient(
        out, params, output_gradients=cotangent, unconnected_gradients=_ZERO
    )


def hvp(f, params, vectors, *args):
    # Forward-over-reverse: the accumulator pushes `vectors` through the tape's
    # backward pass, costing about two to three gradients.
    with tf.autodiff.ForwardAccumulator(params, vectors) as acc:
        with tf.GradientTape() as tape:
            tape.watch(params)
            loss = f(params, *args)
        grads = tape.gradient(loss, params, unconnected_gradients=_ZERO)
    return [acc.jvp(g, unconnected_gradients=_ZERO) for g in grads]


def per_example_grads(f, params, *batch):
    def one(example):
        return value_and_grad(f, params, *[e[None] for e in example])[1]

    return tf.vectorized_map(one, tuple(batch), fallback_to_while_loop=True)


def compile(fn):
    return tf.function(fn, reduce_retracing=True)
