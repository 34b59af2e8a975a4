"""Learning U: the quadratic-model objective and its refresh (LLQR).

On a preconditioner batch with mean-loss gradient ``gbar`` and curvature
product ``G`` (linearised at the current weights, inference mode):

    u    = -U gbar
    J(U) = gbar . u + 1/2 u . G u

``grad_U J = (du/dU)^T (gbar + G u)``: one G-product and one cheap
vector-Jacobian product of the map U -> U gbar per inner step (for diagonal
U this is ``-gbar*gbar + gbar*G(d*gbar)``). A refresh runs `steps`
heavy-ball steps from the current U (fresh velocity), zeroing non-finite
gradient entries and clipping the gradient of each group of parameters
(``structures.clip_groups``) to `clip_norm`, then takes the EMA
``beta*U_old + (1-beta)*U_new`` leaf by leaf and clips positive parameters
(diagonal entries, EK-FAC's s) to >= `min_diagonal`. Everything is pure
``keras.ops`` plus the backend's vjp, so it runs inside the compiled train
step on every backend.
"""

from keras import ops

from keras_geosam import backend
from keras_geosam.preconditioner.structures import operator
from keras_geosam.preconditioner.structures import param_specs


def _direction(layout, params, gbar):
    return [-x for x in operator(layout, params).matvec(gbar)]


def objective(layout, params, gbar, gprod):
    """J(U) (for tests and monitoring).

    ``J(U) = gbar . u + 1/2 u . G u`` with ``u = -U gbar`` (module doc).

    Args:
        layout: U's layout (``kg.preconditioner.layout``).
        params: U's flat parameters, in the order of ``param_specs``.
        gbar: the mean-loss gradient, a list like the variables.
        gprod: ``v -> G v`` for lists like the variables.

    Returns:
        A scalar tensor.

    Raises:
        ValueError: if `params` does not fit `layout`.

    Example:

    >>> model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1, use_bias=False)])
    >>> layout = kg.preconditioner.layout(model.trainable_variables, "diagonal")
    >>> gbar = [keras.ops.convert_to_tensor([[1.0], [2.0]])]
    >>> G = kg.curvature.Diagonal([np.array([[2.0], [4.0]], "float32")])
    >>> identity = [keras.ops.ones((2, 1))]
    >>> float(kg.preconditioner.objective(layout, identity, gbar, G.matvec))
    4.0
    >>> best = [keras.ops.convert_to_tensor([[0.5], [0.25]])]  # U = G^-1
    >>> float(kg.preconditioner.objective(layout, best, gbar, G.matvec))
    -0.75
    """
    u = _direction(layout, params, gbar)
    Gu = gprod(u)
    return sum(ops.sum(g * x) for g, x in zip(gbar, u)) + 0.5 * sum(ops.sum(x * h) for x, h in zip(u, Gu))


def objective_gradient(layout, params, gbar, gprod):
    """grad of J with respect to the flat U parameters.

    ``(du/dU)^T (gbar + G u)``: one G-product and one vector-Jacobian
    product (module doc).

    Args:
        layout, params, gbar, gprod: as for :func:`objective`.

    Returns:
        A list of tensors shaped like `params`.

    Raises:
        ValueError: if `params` does not fit `layout`.

    Example:

    >>> model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1, use_bias=False)])
    >>> layout = kg.preconditioner.layout(model.trainable_variables, "diagonal")
    >>> gbar = [keras.ops.convert_to_tensor([[1.0], [2.0]])]
    >>> G = kg.curvature.Diagonal([np.array([[2.0], [4.0]], "float32")])
    >>> (grad,) = kg.preconditioner.objective_gradient(layout, [keras.ops.ones((2, 1))], gbar, G.matvec)
    >>> keras.ops.convert_to_numpy(grad).ravel().tolist()  # -g*g + g*G(d*g) at d = 1
    [1.0, 12.0]
    """
    # One pass of U -> w = U gbar serves both u = -w and the pullback; with
    # G linear, (du/dU)^T (gbar + G u) = (dw/dU)^T (G w - gbar), which spares
    # two sign flips over every parameter per inner step (exact in IEEE).
    w, pull = backend.value_and_vjp(lambda p: operator(layout, p).matvec(gbar), list(params))
    Gw = gprod(w)
    return pull([h - g for g, h in zip(gbar, Gw)])


def _sanitise(grads):
    return [ops.nan_to_num(g, nan=0.0, posinf=0.0, neginf=0.0) for g in grads]


def clip_by_groups(grads, groups, clip_norm):
    """Each group of gradients scaled to L2 norm <= `clip_norm` together.

    Args:
        grads: a list of tensors.
        groups: lists of indices into `grads`.
        clip_norm: the bound on each group's joint L2 norm.

    Returns:
        A list like `grads`.

    Raises:
        IndexError: if a group holds an index outside `grads`.

    Example:

    >>> grads = [keras.ops.convert_to_tensor([3.0, 4.0]), keras.ops.convert_to_tensor([0.5])]
    >>> out = kg.preconditioner.clip_by_groups(grads, [[0], [1]], clip_norm=1.0)
    >>> [round(float(np.linalg.norm(keras.ops.convert_to_numpy(g))), 3) for g in out]
    [1.0, 0.5]
    """
    out = list(grads)
    for group in groups:
        members = [grads[i] for i in group]
        norm = ops.sqrt(backend.vdot(members, members))
        factor = ops.minimum(1.0, clip_norm / (norm + 1e-12))
        for i in group:
            out[i] = grads[i] * ops.cast(factor, grads[i].dtype)
    return out


def refresh(layout, params, gbar, gprod, groups, steps=50, learning_rate=1e-3, momentum=0.9, clip_norm=5.0, beta=0.95, min_diagonal=1e-8, unroll=False):
    """Returns new flat U parameters after one refresh (see module doc).

    Args:
        layout, params, gbar, gprod: as for :func:`objective`.
        groups: parameter indices clipped together
            (``kg.preconditioner.clip_groups``).
        steps: heavy-ball steps. Defaults to `50`.
        learning_rate: their step size. Defaults to `1e-3`.
        momentum: their momentum. Defaults to `0.9`.
        clip_norm: the per-group gradient norm bound. Defaults to `5.0`.
        beta: EMA weight of the old U. Defaults to `0.95`.
        min_diagonal: lower bound on positive parameters. Defaults to
            `1e-8`.
        unroll: trace the steps one after another instead of as a compiled
            loop (the same numbers; longer to compile). Defaults to `False`.

    Returns:
        A list of tensors shaped like `params`.

    Raises:
        ValueError: if `params` does not fit `layout`.

    Example:

    >>> model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1, use_bias=False)])
    >>> variables = model.trainable_variables
    >>> layout = kg.preconditioner.layout(variables, "diagonal")
    >>> groups = kg.preconditioner.clip_groups(layout, variables, "diagonal")
    >>> gbar = [keras.ops.convert_to_tensor([[1.0], [2.0]])]
    >>> G = kg.curvature.Diagonal([np.array([[2.0], [4.0]], "float32")])
    >>> (d,) = kg.preconditioner.refresh(layout, [keras.ops.ones((2, 1))], gbar, G.matvec, groups,
    ...                                  steps=300, learning_rate=0.01, beta=0.0)
    >>> np.round(keras.ops.convert_to_numpy(d), 3).ravel().tolist()  # U -> G^-1
    [0.5, 0.25]
    """
    old = list(params)

    def body(i, carry):
        current, velocity = carry
        grads = clip_by_groups(_sanitise(objective_gradient(layout, current, gbar, gprod)), groups, clip_norm)
        velocity = [backend.add_scaled(g, v, momentum) for v, g in zip(velocity, grads)]
        current = [backend.add_scaled(p, v, -learning_rate) for p, v in zip(current, velocity)]
        return current, velocity

    carry = (old, [ops.zeros_like(p) for p in old])
    if unroll:
        for i in range(steps):
            carry = body(i, carry)
        learned = carry[0]
    else:
        learned, _ = ops.fori_loop(0, steps, body, carry)
    new = [beta * o + (1.0 - beta) * n for o, n in zip(old, learned)]
    for j, (_, _, _, _, positive) in enumerate(param_specs(layout)):
        if positive:
            new[j] = ops.maximum(new[j], min_diagonal)
    return new
