"""Learning U: the quadratic-model objective and its refresh (LLQR).

On a preconditioner batch with mean-loss gradient ``gbar`` and curvature
product ``G`` (linearised at the current weights, inference mode):

    u    = -U gbar
    J(U) = gbar . u + 1/2 u . G u

``grad_U J = (du/dU)^T (gbar + G u)``: one G-product and one cheap
vector-Jacobian product of the map U -> U gbar per inner step (for diagonal
U this is ``-gbar*gbar + gbar*G(d*gbar)``). A refresh runs `steps` heavy-ball
steps from the current U (fresh velocity), clipping each block's gradient to
`clip_norm` and zeroing non-finite entries, then takes the EMA
``beta*U_old + (1-beta)*U_new`` leaf by leaf and clips diagonal entries to
>= `min_diagonal`. Everything is pure ``keras.ops`` plus the backend's vjp,
so it runs inside the compiled train step on every backend.
"""

from keras import ops

from keras_geosam import backend
from keras_geosam.preconditioner.structures import precondition
from keras_geosam.preconditioner.structures import split


def objective(blocks, flat_params, gbar, gprod):
    """J(U) (for tests and monitoring)."""
    u = [-x for x in precondition(blocks, flat_params, gbar)]
    Gu = gprod(u)
    return sum(ops.sum(g * x) for g, x in zip(gbar, u)) + 0.5 * sum(ops.sum(x * h) for x, h in zip(u, Gu))


def objective_gradient(blocks, flat_params, gbar, gprod):
    """grad of J with respect to the flat U parameters."""
    u = [-x for x in precondition(blocks, flat_params, gbar)]
    Gu = gprod(u)
    cotangent = [g + h for g, h in zip(gbar, Gu)]
    return backend.vjp(lambda p: [-x for x in precondition(blocks, p, gbar)], list(flat_params), cotangent)


def _sanitise(grads):
    return [ops.where(ops.isfinite(g), g, ops.zeros_like(g)) for g in grads]


def _clip_blocks(blocks, grads, clip_norm):
    out = []
    for group in split(blocks, grads):
        norm = ops.sqrt(sum(ops.sum(ops.square(g)) for g in group))
        factor = ops.minimum(1.0, clip_norm / (norm + 1e-12))
        out += [g * ops.cast(factor, g.dtype) for g in group]
    return out


def refresh(blocks, flat_params, gbar, gprod, steps=50, learning_rate=1e-3, momentum=0.9, clip_norm=5.0, beta=0.95, min_diagonal=1e-8):
    """Returns new flat U parameters after one refresh (see module doc)."""
    old = list(flat_params)

    def body(i, carry):
        params, velocity = carry
        grads = _clip_blocks(blocks, _sanitise(objective_gradient(blocks, params, gbar, gprod)), clip_norm)
        velocity = [momentum * v + g for v, g in zip(velocity, grads)]
        params = [p - learning_rate * v for p, v in zip(params, velocity)]
        return params, velocity

    learned, _ = ops.fori_loop(0, steps, body, (old, [ops.zeros_like(p) for p in old]))
    new = [beta * o + (1.0 - beta) * n for o, n in zip(old, learned)]
    i = 0
    for b in blocks:
        k = len(b.param_specs())
        for j in b.diagonal_params():
            new[i + j] = ops.maximum(new[i + j], min_diagonal)
        i += k
    return new
