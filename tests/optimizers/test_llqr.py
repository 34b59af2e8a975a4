"""LLQR and LLQR+SAM in training (shared/spec/llqr-sam.md, sections 1-2).

Every step runs through ``model.fit`` on a tiny float32 classifier whose
weights come from a seeded NumPy generator; the reference is a float64 NumPy
implementation of the spec's step (hand-written forward/backward pass from
``reference/two_pass.py``, U applied per block: ``d * G``, ``A G B^T``,
``QA (s * (QA^T G QG)) QG^T``), never keras_geosam itself. The refresh's
numerics are checked against explicit matrices in ``test_preconditioner.py``
and across backends here.

Tolerance for float32 training against the float64 reference: rtol 1e-5,
atol 1e-6 (as in ``test_optimizers.py``); every such comparison also checks
that the wrong variant (identity U, SAM ascent instead of F-SAM, euclidean
instead of metric norm, decay preconditioned) is at least 100x further away.

The jitted step is not retraced by refreshes: ``train_step`` runs only while
JAX/TensorFlow trace it, so a counter in it counts traces (one per fit).
On torch there is no tracing (Keras runs the step eagerly), so the counter
counts steps and the check is only that nothing else calls it.

The last two tests state behaviour the package does not have yet (found
while writing these tests): a clear error for divergence="ngd" on a
non-classifier loss that leaves a JAX model intact, and the
PreconditionerRefresh callback under steps_per_execution > 1.
"""

import os

import keras
import numpy as np
import pytest
from keras import ops

import keras_geosam as kg
from reference import two_pass as ref
from reference.two_pass import assert_weights_close as assert_close
from reference.two_pass import max_abs_diff
from locations import import_worker, start_on_other_backends

BACKEND = keras.backend.backend()
RTOL, ATOL = 1e-5, 1e-6
TEETH = 100 * ATOL  # the wrong variant must be at least this far

MLP = [("dense", 4), ("act", "sigmoid"), ("dense", 3)]
D_IN, K = 3, 3


def sce():
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def sgd(lr=0.1, momentum=0.9):
    return keras.optimizers.SGD(lr, momentum=momentum)


def to_np(t):
    return np.asarray(ops.convert_to_numpy(t), np.float64)


class Counting(kg.Sequential):
    """Counts calls of train_step: traces on JAX/TF, steps on torch."""

    calls = 0

    def train_step(self, *args):
        self.calls += 1
        return super().train_step(*args)


class Recorder(keras.callbacks.Callback):
    """Weights, U and the refresh counter after every step (``self.model``
    syncs the JAX state)."""

    def __init__(self):
        super().__init__()
        self.weights, self.u, self.refreshes = [], [], []

    def on_train_batch_end(self, batch, logs=None):
        model = self.model
        opt = getattr(model.optimizer, "inner_optimizer", model.optimizer)  # under a LossScaleOptimizer
        self.weights.append([to_np(v.value) for v in model.trainable_variables])
        self.u.append([to_np(v.value) for v in opt.preconditioner.variables])
        self.refreshes.append(int(to_np(opt.refreshes)))


def build(optimizer, seed=3, cls=None):
    model = ref.build_keras(MLP, D_IN, kg_cls=cls)
    init = ref.set_weights(model, seed)
    model.compile(optimizer=optimizer, loss=sce())
    return model, [p.astype(np.float64) for p in init]


def fit(model, x, y, batch_size, **kwargs):
    return model.fit(x, y, batch_size=batch_size, epochs=1, shuffle=False, verbose=0, **kwargs)


def batches_of(x, y, batch_size):
    return [(x[i:i + batch_size], y[i:i + batch_size]) for i in range(0, len(x), batch_size)]


# ====================================================== NumPy reference ==
def u_groups(opt):
    """U's factors per trainable tensor, by parameter name: [{"d": ...}, {"A":, "B":}, ...]."""
    groups = {}
    for v in opt.preconditioner.variables:
        head, name = v.name.split("_", 1)
        groups.setdefault(int(head[1:]), {})[name] = to_np(v.value)
    return [groups[i] for i in sorted(groups)]


def apply_u(groups, vecs):
    out = []
    for grp, g in zip(groups, vecs):
        if "d" in grp:
            out.append(grp["d"] * g)
        elif "A" in grp:
            A, B = grp["A"], grp["B"]
            out.append((A @ g.reshape(A.shape[0], -1) @ B.T).reshape(g.shape))
        else:
            QA, QG, s = grp["QA"], grp["QG"], grp["s"]
            X = g.reshape(QA.shape[0], -1)
            out.append((QA @ (s * (QA.T @ X @ QG)) @ QG.T).reshape(g.shape))
    return out


def grad(params, x, y, loss="sce"):
    return ref.loss_and_grad(MLP, params, x, y, loss=loss)[1]


def dot(a, b):
    return sum(float(np.sum(p * q)) for p, q in zip(a, b))


def llqrsam_reference(params, batches, groups, lr, momentum, rho, norm="euclidean", ascent="sam",
                      sigma=1.0, ema=0.9, wd=0.0, two_pass=True, return_average=False, loss="sce"):
    """The spec's LLQR(+SAM) step with a frozen U, then Keras SGD:
    v <- mu v - lr d, theta <- theta + v, with d = U g_p + wd * theta.
    F-SAM's average m of previous centre gradients is updated after use."""
    params = [p.copy() for p in params]
    vel = [np.zeros_like(p) for p in params]
    avg = [np.zeros_like(p) for p in params]
    for x, y in batches:
        g_c = grad(params, x, y, loss)
        if two_pass:
            v = [g - sigma * m for g, m in zip(g_c, avg)] if ascent == "fsam" else g_c
            w = apply_u(groups, v)
            den = np.sqrt((dot(w, w) if norm == "euclidean" else dot(v, w)) + 1e-12)
            eps = [rho * t / den for t in w]
            g_p = grad([p + e for p, e in zip(params, eps)], x, y, loss)
            avg = [ema * m + (1 - ema) * g for m, g in zip(avg, g_c)]
        else:
            g_p = g_c
        d = [u + wd * p for u, p in zip(apply_u(groups, g_p), params)]
        vel = [momentum * b - lr * t for b, t in zip(vel, d)]
        params = [p + b for p, b in zip(params, vel)]
    return (params, avg) if return_average else params


def random_u(opt, rng):
    """Assigns known non-identity values to every U factor."""
    for v in opt.preconditioner.variables:
        name = v.name.split("_", 1)[1]
        shape = tuple(v.shape)
        if name in ("d", "s"):
            value = rng.uniform(0.3, 2.5, size=shape)
        elif name in ("QA", "QG"):
            value = np.linalg.qr(rng.normal(size=shape))[0]  # an eigenbasis
        else:  # A, B: generic, not symmetric
            value = np.eye(shape[0]) + 0.4 * rng.normal(size=shape)
        v.assign(value.astype("float32"))


# ============================================ one LLQR+SAM step vs NumPy ==
STEP_CASES = {
    # structure, norm, ascent
    "diagonal-euclidean-sam": ("diagonal", "euclidean", "sam"),
    "diagonal-metric-fsam": ("diagonal", "metric", "fsam"),
    "kfac-euclidean-fsam": ("kfac", "euclidean", "fsam"),
    "ekfac-metric-sam": ("ekfac", "metric", "sam"),
}


@pytest.mark.parametrize("case", sorted(STEP_CASES))
def test_llqrsam_steps_match_numpy_reference(case):
    """Two steps (two batches, SGD momentum) with U fixed at known
    non-identity values (refresh_source="callback", no callback)."""
    structure, norm, ascent = STEP_CASES[case]
    hp = dict(rho=0.4, norm=norm, ascent=ascent, fsam_sigma=1.0, fsam_momentum=0.6)
    x, y = ref.make_data(41, 16, D_IN, K)
    opt = kg.optimizers.LLQRSAM(sgd(0.1), structure=structure, refresh_source="callback", **hp)
    model, init = build(opt)
    random_u(opt, np.random.default_rng(42))
    groups = u_groups(opt)
    assert [("d" in g) for g in groups] == [structure == "diagonal", True, structure == "diagonal", True]
    fit(model, x, y, 8)
    assert int(to_np(opt.refreshes)) == 0
    got = ref.weights_of(model)
    batches = batches_of(x, y, 8)
    kw = dict(lr=0.1, momentum=0.9, rho=0.4, sigma=1.0, ema=0.6)
    expected = llqrsam_reference(init, batches, groups, norm=norm, ascent=ascent, **kw)
    assert_close(got, expected)
    # U is frozen between refreshes.
    assert_close([to_np(v.value) for v in opt.preconditioner.variables], [v for g in groups for v in g.values()], rtol=0, atol=0)
    # Teeth: U, the norm and the ascent each matter at these values.
    identity = [{k: (np.ones_like(v) if k in ("d", "s") else np.eye(v.shape[0])) for k, v in g.items()}
                for g in groups]
    others = {
        "identity U (SAM)": llqrsam_reference(init, batches, identity, norm=norm, ascent=ascent, **kw),
        "other norm": llqrsam_reference(init, batches, groups, ascent=ascent, **kw,
                                        norm="metric" if norm == "euclidean" else "euclidean"),
    }
    if ascent == "fsam":
        others["sam ascent"] = llqrsam_reference(init, batches, groups, norm=norm, ascent="sam", **kw)
        # ... and the optimizer's F-SAM average is the EMA of both centre gradients.
        _, avg = llqrsam_reference(init, batches, groups, norm=norm, ascent=ascent, return_average=True, **kw)
        assert_close([to_np(m.value) for m in opt._average], avg)
    for name, other in others.items():
        assert max_abs_diff(expected, other) > TEETH, name


def _regression_or_binary(loss, seed):
    x, _ = ref.make_data(seed, 16, D_IN, K)
    rng = np.random.default_rng(seed + 1)
    y = rng.normal(size=(16, K)) if loss == "mse" else (rng.uniform(size=(16, K)) < 0.5)
    keras_loss = "mse" if loss == "mse" else keras.losses.BinaryCrossentropy(from_logits=True)
    return x, y.astype("float32"), keras_loss


@pytest.mark.parametrize("loss", ["mse", "bce"])
def test_llqrsam_on_regression_and_multilabel_losses_matches_numpy_and_trains(loss):
    """An MSE regressor and a multi-label BCE classifier (3 outputs): two
    steps with U fixed at known values equal the hand-written reference;
    then LLQR+SAM with the default divergence="ngd" refreshes U from each
    loss's own Fisher and trains."""
    x, y, keras_loss = _regression_or_binary(loss, 45)
    opt = kg.optimizers.LLQRSAM(sgd(0.1), structure="kfac", refresh_source="callback", rho=0.4)
    model = ref.build_keras(MLP, D_IN)
    init = [p.astype(np.float64) for p in ref.set_weights(model, 3)]
    model.compile(optimizer=opt, loss=keras_loss)
    random_u(opt, np.random.default_rng(46))
    groups = u_groups(opt)
    fit(model, x, y, 8)
    kw = dict(lr=0.1, momentum=0.9, rho=0.4)
    expected = llqrsam_reference(init, batches_of(x, y, 8), groups, loss=loss, **kw)
    assert_close(ref.weights_of(model), expected)
    assert max_abs_diff(expected, llqrsam_reference(init, batches_of(x, y, 8), groups, loss="mse" if loss == "bce" else "bce",
                                                    **kw)) > TEETH

    # A larger inner step than the reference's 1e-3 and no EMA, so that U
    # visibly leaves the identity within these few refreshes.
    opt = kg.optimizers.LLQRSAM(keras.optimizers.SGD(0.2), refresh_every=4, refresh_steps=5, rho=0.05,
                                inner_learning_rate=0.5, beta=0.0)
    model = ref.build_keras(MLP, D_IN)
    ref.set_weights(model, 3)
    model.compile(optimizer=opt, loss=keras_loss)
    history = model.fit(x, y, batch_size=8, epochs=12, shuffle=False, verbose=0).history["loss"]
    d = [to_np(v.value) for v in opt.preconditioner.variables]
    assert int(to_np(opt.refreshes)) == 6
    assert all(np.all(np.isfinite(v)) for v in d)
    assert max(float(np.max(np.abs(v - 1.0))) for v in d) > 1e-3  # U moved off the identity
    assert history[-1] < 0.9 * history[0]


# =========================================================== reductions ==
_RUNS = {}


def llqr_run(kind):
    """Six steps, refresh inside the step every 3 (at steps 0 and 3), batch 2.
    Cached: several tests read the same run."""
    if kind not in _RUNS:
        x, y = ref.make_data(43, 12, D_IN, K)
        common = dict(refresh_every=3, refresh_steps=5, inner_learning_rate=0.05, beta=0.5)
        if kind == "llqr":
            opt = kg.optimizers.LLQR(keras.optimizers.SGD(0.2), **common)
        else:
            opt = kg.optimizers.LLQRSAM(keras.optimizers.SGD(0.2), rho=0.0, **common)
        model, init = build(opt, cls=Counting)
        rec = Recorder()
        fit(model, x, y, 2, callbacks=[rec])
        _RUNS[kind] = dict(model=model, opt=opt, init=init, rec=rec, calls=model.calls,
                           batches=batches_of(x, y, 2))
    return _RUNS[kind]


def test_refresh_schedule_in_step_and_no_retrace():
    """Refreshes at steps 0 and 3 (refresh_every=3), before the step's
    gradient: each step is theta - lr U_t g with U_t the U recorded after
    step t; U is frozen in between; the step is traced once (JAX: the
    refresh is a program of its own, run between steps)."""
    run = llqr_run("llqr")
    rec = run["rec"]
    assert rec.refreshes == [1, 1, 1, 2, 2, 2]
    prev = [np.ones_like(u) for u in rec.u[0]]  # diagonal U starts at ones
    for t in range(6):
        changed = max_abs_diff(rec.u[t], prev) > 1e-4
        assert changed == (t in (0, 3)), (t, max_abs_diff(rec.u[t], prev))
        prev = rec.u[t]
    weights = [run["init"]] + rec.weights
    for t, (x, y) in enumerate(run["batches"]):
        groups = [{"d": d} for d in rec.u[t]]
        expected = llqrsam_reference(weights[t], [(x, y)], groups, lr=0.2, momentum=0.0, rho=0.0, two_pass=False)
        assert_close(rec.weights[t], expected)
    if BACKEND in ("tensorflow", "jax"):
        assert run["calls"] == 1, f"train_step traced {run['calls']} times in one fit"
    else:  # torch: eager, one call per step and nothing else
        assert run["calls"] == 6


@pytest.fixture
def host_log(monkeypatch):
    """``(decisions, reads)``: what the host's ``RefreshBounds.next_step``
    decided for each step and each step-counter value it read."""
    from keras_geosam.preconditioner.schedule import RefreshBounds

    decisions, reads = [], []
    stock = RefreshBounds.next_step

    def spy(self, read_counter, can_read=True):
        def read():
            reads.append(read_counter())
            return reads[-1]

        decisions.append(stock(self, read, can_read))
        return decisions[-1]

    monkeypatch.setattr(RefreshBounds, "next_step", spy)
    return decisions, reads


def test_host_skips_the_refresh_branch_between_due_steps(host_log):
    """JAX and torch decide on the host which steps may need a refresh
    (``RefreshBounds``): with refresh_every=3 over 6 steps only steps 0 and
    3 take the refresh branch, and the counter is read at steps 0, 1, 3, 4
    only (a due step and the one after, which a skipped step would leave at
    the due count). On JAX the refresh runs between steps as a program of
    its own; TensorFlow keeps the branch in its graph. With
    steps_per_execution=2 (JAX: the host reads only at a call's first step)
    U and the weights are the same as with 1 (torch allows only 1)."""
    decisions, reads = host_log
    x, y = ref.make_data(43, 12, D_IN, K)
    common = dict(refresh_every=3, refresh_steps=5, inner_learning_rate=0.05, beta=0.5, rho=0.1)
    results = {}
    runs = [(1, kg.Sequential), (1, "attach")] + ([(2, kg.Sequential)] if BACKEND != "torch" else [])
    for spe, cls in runs:  # torch: steps_per_execution must be 1
        decisions.clear(), reads.clear()
        opt = kg.optimizers.LLQRSAM(keras.optimizers.SGD(0.2, momentum=0.9), **common)
        if cls == "attach":  # kg.attach on a plain Keras model gates the same way
            model = kg.attach(ref.build_keras(MLP, D_IN, kg_cls=keras.Sequential))
            ref.set_weights(model, 3)
        else:
            model, _ = build(opt)
        model.compile(optimizer=opt, loss=sce(), steps_per_execution=spe)
        rec = Recorder()
        fit(model, x, y, 2, callbacks=[rec])
        assert rec.refreshes[-1] == 2 and (spe == 2 or rec.refreshes == [1, 1, 1, 2, 2, 2])
        results[spe, cls] = (rec.u[-1], ref.weights_of(model), list(decisions), list(reads))
    reference = results[1, kg.Sequential]
    for key, (u, weights, decided, read) in results.items():
        assert_close(u, reference[0], rtol=1e-6, atol=1e-7)
        assert_close(weights, reference[1], rtol=1e-6, atol=1e-7)
        if key[0] == 1:
            assert (decided, read) == (reference[2], reference[3]), key
    results = {spe: value for (spe, cls), value in results.items() if cls is kg.Sequential}
    if BACKEND == "tensorflow":
        assert results[1][2] == []
    else:
        assert results[1][2] == [True, False, False, True, False, False]
        assert results[1][3] == [0, 1, 3, 4]
    if BACKEND == "jax":  # calls of 2 steps, read at each call's first step only
        assert results[2][2] == [True, True, False, True, False, False]
        assert results[2][3] == [0, 2, 4]


def _schedule_log(opt_kwargs, x, y, batch_size=2, base_kwargs=None, cls=None, before_fit=None, callbacks=()):
    """The model and ``refreshes`` after every step of one fit of an LLQR model."""
    opt = kg.optimizers.LLQR(keras.optimizers.SGD(0.2, **(base_kwargs or {})), refresh_steps=3, **opt_kwargs)
    model, _ = build(opt, cls=cls)
    if before_fit is not None:
        before_fit(model)
    rec = Recorder()
    fit(model, x, y, batch_size, callbacks=[rec, *callbacks])
    return model, rec.refreshes


def test_host_bounds_follow_schedule_changes_and_a_counter_reset():
    """The host's bounds read refresh_every / refresh_until at every check
    (changed between fits, the new schedule holds), and a callback that
    resets the step counter mid-fit gets its refresh at the reset step
    (JAX: the state Keras re-reads from the variables restarts the bounds;
    TF decides in the graph; torch notices only at the next fit, so it is
    not checked there)."""
    x, y = ref.make_data(52, 12, D_IN, K)
    model, log = _schedule_log(dict(refresh_every=3, refresh_until=2), x[:8], y[:8])
    assert log == [1, 1, 1, 1]
    # The schedule is compiled into the step (JAX, TF): rebuild it.
    model.optimizer.preconditioner.refresh_until = None
    model.make_train_function(force=True)
    rec = Recorder()
    fit(model, x, y, 2, callbacks=[rec])  # steps 4..9: due at 6 and 9
    assert rec.refreshes == [1, 1, 2, 2, 2, 3]
    model.optimizer.preconditioner.refresh_every = 2
    model.make_train_function(force=True)
    rec = Recorder()
    fit(model, x[:8], y[:8], 2, callbacks=[rec])  # steps 10..13: due at 10 and 12
    assert rec.refreshes == [4, 4, 5, 5]

    class Reset(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            if epoch == 1:
                self.model.optimizer.iterations.assign(0)

    if BACKEND != "torch":
        opt = kg.optimizers.LLQR(keras.optimizers.SGD(0.2), refresh_steps=3, refresh_every=3)
        model, _ = build(opt)
        rec = Recorder()
        model.fit(x[:10], y[:10], batch_size=2, epochs=2, shuffle=False, verbose=0, callbacks=[Reset(), rec])
        # Epoch 0: steps 0..4 (due at 0, 3); epoch 1 restarts at 0 (due at 0, 3).
        assert rec.refreshes == [1, 1, 1, 2, 2, 3, 3, 3, 4, 4]


def test_host_bounds_under_gradient_accumulation_and_an_early_train_function(host_log):
    """With gradient_accumulation_steps=2 the bounds count micro-batches
    (due every 2 * refresh_every): refreshes before micro-batches 0 and 4
    only, the counter read at 0, 1, 4, 5. A train function made before the
    model (and so the optimizer) is built still finds the counter. With a
    period of 2 or less the host reads nothing."""
    decisions, reads = host_log
    x, y = ref.make_data(53, 16, D_IN, K)
    _, log = _schedule_log(dict(refresh_every=2), x, y, base_kwargs=dict(gradient_accumulation_steps=2))
    assert log == [1, 1, 1, 1, 2, 2, 2, 2]
    if BACKEND != "tensorflow":
        assert decisions == [True, False, False, False, True, False, False, False]
        assert reads == [0, 1, 4, 5]
    decisions.clear(), reads.clear()
    plain = kg.Sequential([keras.layers.Dense(4, activation="tanh"), keras.layers.Dense(K)])  # built at fit
    plain.compile(optimizer=kg.optimizers.LLQR(keras.optimizers.SGD(0.2), refresh_steps=3, refresh_every=3), loss=sce())
    plain.make_train_function()
    rec = Recorder()
    fit(plain, x[:12], y[:12], 2, callbacks=[rec])
    assert rec.refreshes == [1, 1, 1, 2, 2, 2]
    if BACKEND != "tensorflow":
        assert decisions == [True, False, False, True, False, False] and reads == [0, 1, 3, 4]
    # refresh_every=2 without accumulation: any step may be due, so the host
    # lets every step through to the device's check and reads nothing.
    decisions.clear(), reads.clear()
    _, log = _schedule_log(dict(refresh_every=2), x[:12], y[:12])
    assert log == [1, 1, 2, 2, 3, 3]
    if BACKEND != "tensorflow":
        assert decisions == [True] * 6 and reads == []


def test_a_train_step_override_that_unpacks_its_data_still_trains():
    """An override in the usual Keras pattern (unpack, transform, pass on)
    keeps working, and gets every refresh."""

    class Scaled(kg.Sequential):
        def train_step(self, *args):
            *state, data = args
            x, y = data
            return super().train_step(*state, (x * 1.0, y))

    x, y = ref.make_data(54, 12, D_IN, K)
    _, log = _schedule_log(dict(refresh_every=3), x, y, cls=Scaled)
    assert log == [1, 1, 1, 2, 2, 2]


def test_llqrsam_with_rho_zero_is_llqr():
    """Same weights, same U and same refresh schedule after six steps."""
    a, b = llqr_run("llqr"), llqr_run("llqrsam_rho0")
    assert b["rec"].refreshes == a["rec"].refreshes
    for t in range(6):
        assert_close(b["rec"].u[t], a["rec"].u[t], rtol=1e-6, atol=1e-7)
        assert_close(b["rec"].weights[t], a["rec"].weights[t], rtol=1e-6, atol=1e-7)
    assert max_abs_diff(a["rec"].weights[-1], a["init"]) > 1e-2  # it trained


def test_llqrsam_without_refresh_is_sam():
    """refresh_source="callback" and no callback: U stays identity, and
    LLQR+SAM is kg.optimizers.SAM with the same rho and base."""
    x, y = ref.make_data(44, 16, D_IN, K)
    llqr, init = build(kg.optimizers.LLQRSAM(sgd(), rho=0.3, refresh_source="callback"))
    sam, init2 = build(kg.optimizers.SAM(sgd(), rho=0.3))
    fit(llqr, x, y, 4)
    fit(sam, x, y, 4)
    assert_close(init, init2, rtol=0, atol=0)
    assert all(np.all(to_np(u.value) == 1.0) for u in llqr.optimizer.preconditioner.variables)
    assert_close(ref.weights_of(llqr), ref.weights_of(sam), rtol=1e-6, atol=1e-7)
    plain = llqrsam_reference(init, batches_of(x, y, 4), [{"d": np.ones_like(p)} for p in init],
                              lr=0.1, momentum=0.9, rho=0.0, two_pass=False)
    assert max_abs_diff(ref.weights_of(sam), plain) > TEETH  # SAM differs from its base here


FIXED_U_CASES = {"identity-no-decay": ("identity", 0.0), "identity-decay": ("identity", 0.3),
                 "random-decay": ("random", 0.3)}


@pytest.mark.parametrize("case", sorted(FIXED_U_CASES))
def test_llqr_with_fixed_u_is_the_base_on_u_g_plus_decay(case):
    """LLQR with U frozen (refresh_source="callback", no callback): the base
    SGD-momentum steps on U g + wd * theta, coupled decay added after U and
    never preconditioned (NumPy). With U = identity and wd = 0 this is the
    base optimizer itself (also checked against a plain keras.Sequential)."""
    u, wd = FIXED_U_CASES[case]
    x, y = ref.make_data(45, 16, D_IN, K)
    model, init = build(kg.optimizers.LLQR(sgd(), refresh_source="callback", coupled_weight_decay=wd))
    if u == "random":
        random_u(model.optimizer, np.random.default_rng(46))
    groups = u_groups(model.optimizer)
    fit(model, x, y, 4)
    got = ref.weights_of(model)
    batches = batches_of(x, y, 4)
    expected = llqrsam_reference(init, batches, groups, lr=0.1, momentum=0.9, rho=0.0, wd=wd, two_pass=False)
    assert_close(got, expected)
    if wd == 0.0:
        base, init2 = build(sgd(), cls=keras.Sequential)
        fit(base, x, y, 4)
        assert_close(init, init2, rtol=0, atol=0)
        assert_close(got, ref.weights_of(base), rtol=1e-6, atol=1e-7)
        return
    # Teeth: no decay, or (with U != I) decay inside U, is another trajectory.
    no_decay = llqrsam_reference(init, batches, groups, lr=0.1, momentum=0.9, rho=0.0, two_pass=False)
    assert max_abs_diff(expected, no_decay) > TEETH
    if u == "random":
        params = [p.copy() for p in init]
        vel = [np.zeros_like(p) for p in params]
        for xb, yb in batches:
            d = apply_u(groups, [g + wd * p for g, p in zip(grad(params, xb, yb), params)])
            vel = [0.9 * b - 0.1 * t for b, t in zip(vel, d)]
            params = [p + b for p, b in zip(params, vel)]
        assert max_abs_diff(expected, params) > TEETH


def test_llqrsam_refreshes_at_the_unperturbed_weights():
    """With rho > 0, the step-0 refresh sees theta_0 (before the ascent):
    its U equals LLQR's step-0 U on the same batch, while the weights differ."""
    a = llqr_run("llqr")
    x, y = a["batches"][0]
    opt = kg.optimizers.LLQRSAM(keras.optimizers.SGD(0.2), rho=0.5, refresh_every=3, refresh_steps=5,
                                inner_learning_rate=0.05, beta=0.5)
    model, init = build(opt)
    assert_close(init, a["init"], rtol=0, atol=0)
    fit(model, x, y, 2)
    assert int(to_np(opt.refreshes)) == 1
    assert_close([to_np(u.value) for u in opt.preconditioner.variables], a["rec"].u[0], rtol=1e-6, atol=1e-7)
    assert max_abs_diff(ref.weights_of(model), a["rec"].weights[0]) > TEETH


# ============================================ PreconditionerRefresh ==
def test_callback_refreshes_at_the_right_steps_without_retracing():
    """refresh_source="callback", refresh_every=2, five steps: refreshes
    before steps 0, 2 and 4 on the callback's own batches. The refreshed U
    is the one step t uses (on every backend), U is frozen in between, and
    writing U from the callback does not retrace the compiled step."""
    x, y = ref.make_data(47, 10, D_IN, K)
    xp, yp = ref.make_data(48, 24, D_IN, K)
    opt = kg.optimizers.LLQR(keras.optimizers.SGD(0.2), refresh_source="callback", refresh_every=2,
                             refresh_steps=5, inner_learning_rate=0.05, beta=0.5)
    model, init = build(opt, cls=Counting)
    cb, rec = kg.callbacks.PreconditionerRefresh(xp, yp, batch_size=8, seed=1), Recorder()
    fit(model, x, y, 2, callbacks=[cb, rec])
    assert cb.num_refreshes == 3
    assert rec.refreshes == [1, 1, 2, 2, 3]
    prev = [np.ones_like(u) for u in rec.u[0]]
    for t in range(5):
        changed = max_abs_diff(rec.u[t], prev) > 1e-4
        assert changed == (t in (0, 2, 4)), (t, max_abs_diff(rec.u[t], prev))
        prev = rec.u[t]
    weights = [init] + rec.weights
    for t, (xb, yb) in enumerate(batches_of(x, y, 2)):
        groups = [{"d": d} for d in rec.u[t]]
        expected = llqrsam_reference(weights[t], [(xb, yb)], groups, lr=0.2, momentum=0.0, rho=0.0,
                                     two_pass=False)
        assert_close(rec.weights[t], expected)
    if BACKEND in ("jax", "tensorflow"):
        assert model.calls == 1, f"train_step traced {model.calls} times"
    else:
        assert model.calls == 5


def test_callback_refuses_step_source_and_other_optimizers():
    x, y = ref.make_data(49, 8, D_IN, K)
    for opt, match in [
        (kg.optimizers.LLQRSAM(sgd(), refresh_source="step"), 'refresh_source="callback"'),
        (kg.optimizers.SAM(sgd(), rho=0.1), "LLQR"),
    ]:
        model, init = build(opt)
        with pytest.raises(ValueError, match=match):
            fit(model, x, y, 4, callbacks=[kg.callbacks.PreconditionerRefresh(x, y)])
        # Raised before any step: the model is intact and untouched.
        assert_close(ref.weights_of(model), init, rtol=0, atol=0)


# ============================================================ save/load ==
def test_save_load_between_refreshes_equals_uninterrupted(tmp_path):
    """K-FAC U refreshed in the step every 3 steps, F-SAM ascent: save after
    4 steps (refreshes at 0 and 3, next at 6), load, run 4 more; the U
    factors, the F-SAM average, the momentum and the schedule are restored
    and the result equals 8 uninterrupted steps."""
    x, y = ref.make_data(50, 16, D_IN, K)

    def make():
        opt = kg.optimizers.LLQRSAM(sgd(0.05), rho=0.3, structure="kfac", ascent="fsam", refresh_every=3,
                                    refresh_steps=5, inner_learning_rate=0.05, beta=0.5)
        return build(opt, seed=51)[0]

    full = make()
    fit(full, x, y, 2)
    first = make()
    fit(first, x[:8], y[:8], 2)
    assert int(to_np(first.optimizer.refreshes)) == 2
    path = str(tmp_path / "llqr.keras")
    first.save(path)
    loaded = keras.saving.load_model(path)
    assert isinstance(getattr(loaded, "optimizer", None), kg.optimizers.LLQRSAM), (
        "load_model returned a model without its LLQRSAM optimizer: U, the F-SAM average "
        "and the refresh schedule were not restored")
    opt, old = loaded.optimizer, first.optimizer
    assert opt.get_config() == old.get_config()
    assert int(to_np(opt.iterations)) == 4 and int(to_np(opt.refreshes)) == 2
    assert len(opt.variables) == len(old.variables)
    for a, b in zip(opt.variables, old.variables):
        np.testing.assert_array_equal(to_np(a.value), to_np(b.value), err_msg=a.path)
    assert max_abs_diff([to_np(u.value) for u in opt.preconditioner.variables],
                        [np.eye(u.shape[0]) if len(u.shape) == 2 else np.ones(u.shape) for u in opt.preconditioner.variables]) > 1e-3
    assert max(np.abs(to_np(m.value)).max() for m in opt._average) > 1e-3
    fit(loaded, x[8:], y[8:], 2)
    assert int(to_np(opt.refreshes)) == int(to_np(full.optimizer.refreshes)) == 3
    assert_close([to_np(u.value) for u in opt.preconditioner.variables], [to_np(u.value) for u in full.optimizer.preconditioner.variables],
                 rtol=1e-6, atol=1e-7)
    assert_close([to_np(m.value) for m in opt._average], [to_np(m.value) for m in full.optimizer._average],
                 rtol=1e-6, atol=1e-7)
    assert_close(ref.weights_of(loaded), ref.weights_of(full), rtol=1e-6, atol=1e-7)


# ========================================================== validation ==
def _bad():
    s = sgd()
    return {
        "structure": lambda: kg.optimizers.LLQR(s, structure="full"),
        "structure_sam": lambda: kg.optimizers.LLQRSAM(s, structure="shampoo"),
        "divergence": lambda: kg.optimizers.LLQR(s, divergence="kl"),
        "divergence_sam": lambda: kg.optimizers.LLQRSAM(s, divergence="gauss"),
        "norm": lambda: kg.optimizers.LLQRSAM(s, norm="l1"),
        "ascent": lambda: kg.optimizers.LLQRSAM(s, ascent="asam"),
        "refresh_every": lambda: kg.optimizers.LLQR(s, refresh_every=0),
        "refresh_every_sam": lambda: kg.optimizers.LLQRSAM(s, refresh_every=0),
        "refresh_every_float": lambda: kg.optimizers.LLQR(s, refresh_every=2.5),
        "refresh_every_negative": lambda: kg.optimizers.LLQRSAM(s, refresh_every=-5),
        "rho": lambda: kg.optimizers.LLQRSAM(s, rho=-0.1),
        "rho_nan": lambda: kg.optimizers.LLQRSAM(s, rho=float("nan")),
        "refresh_source": lambda: kg.optimizers.LLQR(s, refresh_source="epoch"),
        "refresh_steps": lambda: kg.optimizers.LLQRSAM(s, refresh_steps=0),
        "beta": lambda: kg.optimizers.LLQR(s, beta=1.5),
        "inner_momentum": lambda: kg.optimizers.LLQR(s, inner_momentum=1.0),
        "inner_learning_rate": lambda: kg.optimizers.LLQR(s, inner_learning_rate=0.0),
        "clip_norm": lambda: kg.optimizers.LLQR(s, clip_norm=-1.0),
        "coupled_weight_decay": lambda: kg.optimizers.LLQR(s, coupled_weight_decay=-1e-4),
        "sam_start_step": lambda: kg.optimizers.LLQRSAM(s, sam_start_step=-1),
        "unknown": lambda: kg.optimizers.LLQR(s, rho=0.1),
    }


@pytest.mark.parametrize("case", sorted(_bad()))
def test_bad_hyperparameters_raise_clearly(case):
    name = case.replace("_sam", "").replace("_float", "").replace("_negative", "").replace("_nan", "")
    with pytest.raises(ValueError, match=name if name != "unknown" else "unexpected"):
        _bad()[case]()


def test_defaults_and_config_round_trip():
    opt = kg.optimizers.LLQRSAM(sgd())
    assert (opt.structure, opt.divergence, opt.norm, opt.ascent) == ("diagonal", "ngd", "euclidean", "sam")
    assert opt.rho == 0.1
    assert (opt.refresh_every, opt.refresh_steps, opt.inner_learning_rate, opt.inner_momentum) == (1000, 50, 1e-3, 0.9)
    assert (opt.clip_norm, opt.beta, opt.min_diagonal) == (5.0, 0.95, 1e-8)
    assert kg.optimizers.LLQR(sgd(), divergence="newton").beta == 0.90
    cfg = kg.optimizers.LLQRSAM(sgd(), rho=0.2, structure="ekfac", norm="metric", ascent="fsam",
                                refresh_every=7, refresh_source="callback", beta=0.3).get_config()
    again = kg.optimizers.LLQRSAM.from_config(cfg)
    assert again.get_config() == cfg


# ===================================================== across backends ==
@pytest.mark.cross_backend
@pytest.mark.skipif(BACKEND != "jax", reason="runs once, from the JAX process")
def test_refresh_gives_the_same_U_on_all_backends(tmp_path):
    """Identical float32 weights (with BatchNorm) and batch: two refreshes
    give the same U factors on jax, tensorflow and torch (1e-5 relative per
    factor; 1e-4 on the change U - U_init, which is the part that moved)."""
    llqr_worker = import_worker("llqr_worker")

    collect = start_on_other_backends("llqr_worker.py", tmp_path, x64=False)
    mine = llqr_worker.compute()
    for b, theirs in collect(timeout=300).items():
        assert sorted(theirs) == sorted(mine)
        moved_a, moved_b = [], []
        for key in sorted(k for k in mine if not k.startswith("init_")):
            a, c = mine[key].astype(np.float64), theirs[key].astype(np.float64)
            assert np.linalg.norm(a - c) <= 1e-5 * np.linalg.norm(a), (b, key)
            init = mine["init_" + key]
            moved_a.append((a - init).ravel())
            moved_b.append((c - init).ravel())
        moved_a, moved_b = np.concatenate(moved_a), np.concatenate(moved_b)
        assert np.linalg.norm(moved_a) > 0.1  # the refreshes moved U
        assert np.linalg.norm(moved_a - moved_b) <= 1e-4 * np.linalg.norm(moved_a), b


# ============================================================== errors ==
def test_ngd_on_a_loss_without_a_likelihood_fails_clearly_and_keeps_the_model():
    """divergence="ngd" needs a loss with a Fisher (a negative
    log-likelihood). The error must name the problem and the way out (at
    fit, before a step) and leave the model intact (on JAX an error raised
    while the step is traced leaves the variables empty)."""
    x, y = ref.make_data(52, 8, D_IN, K)
    model = ref.build_keras(MLP, D_IN)
    init = ref.set_weights(model, 53)
    with pytest.raises(ValueError, match='mean_absolute_error.*divergence="newton"'):
        model.compile(optimizer=kg.optimizers.LLQR(sgd(), refresh_every=2, refresh_steps=2), loss="mae")
        model.fit(x, np.eye(K, dtype="float32")[y], batch_size=4, verbose=0)
    assert_close(ref.weights_of(model), [p.astype(np.float64) for p in init], rtol=0, atol=0)


@pytest.mark.skipif(BACKEND == "torch", reason="Keras' torch trainer requires steps_per_execution=1")
def test_callback_refresh_with_steps_per_execution_is_not_silently_skipped():
    """With steps_per_execution=4 Keras calls on_train_batch_begin once per
    4 steps (iterations 0, 4, 8); refreshes due at steps 3, 6 and 9 fall
    inside executions. The callback must still refresh once per due step
    (at the start of the execution containing it) or refuse clearly; it
    must not drop them silently."""
    x, y = ref.make_data(54, 24, D_IN, K)
    opt = kg.optimizers.LLQR(keras.optimizers.SGD(0.1), refresh_source="callback", refresh_every=3,
                             refresh_steps=2)
    model = ref.build_keras(MLP, D_IN)
    model.compile(optimizer=opt, loss=sce(), steps_per_execution=4)
    cb = kg.callbacks.PreconditionerRefresh(x, y, batch_size=8)
    try:
        model.fit(x, y, batch_size=2, epochs=1, shuffle=False, verbose=0, callbacks=[cb])
    except ValueError as e:
        assert "steps_per_execution" in str(e)
        return
    assert int(to_np(opt.iterations)) == 12
    assert cb.num_refreshes == 4, f"{cb.num_refreshes} refreshes for 4 due steps (0, 3, 6, 9)"


@pytest.mark.skipif(BACKEND != "jax", reason="the truncation warning is JAX's, without x64")
def test_building_and_refreshing_gives_no_dtype_warnings():
    """The refresh counter uses Keras' integer type: no 'int64 requested ...
    truncated' warning on JAX without x64 (the tests run with x64, so a
    fresh process checks it)."""
    import subprocess
    import sys

    code = (
        "import warnings, numpy as np, keras, keras_geosam as kg\n"
        "warnings.simplefilter('always')\n"
        "m = kg.Sequential([keras.Input((3,)), keras.layers.Dense(4, activation='sigmoid'), keras.layers.Dense(3)])\n"
        "m.compile(optimizer=kg.optimizers.LLQRSAM(keras.optimizers.SGD(0.1), refresh_every=1),\n"
        "          loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))\n"
        "x = np.random.default_rng(0).normal(size=(8, 3)).astype('float32')\n"
        "m.fit(x, np.arange(8) % 3, batch_size=4, epochs=1, verbose=0)\n"
        "print('refreshes', int(keras.ops.convert_to_numpy(m.optimizer.refreshes)))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "JAX_ENABLE_X64"}
    env["KERAS_BACKEND"] = "jax"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "refreshes 2" in out.stdout
    assert "int64" not in out.stderr, out.stderr[-3000:]


@pytest.mark.parametrize("structure,every", [("diagonal", 2), ("kfac", 2), ("diagonal", 3)])
def test_a_skipped_step_leaves_u_and_the_refresh_count_alone(structure, every, step_branching):
    """A NaN batch on a refresh-due step: U, `refreshes` and every optimizer
    variable stay as they were, and the refresh happens on the next finite
    step, so [NaN, good, good] equals an uninterrupted [good, good]."""
    x, y = ref.make_data(46, 8, D_IN, K)
    bad = x[:4].copy()
    bad[1, 0] = np.nan
    runs = {}
    for name, (xs, ys) in {"with_nan": (np.concatenate([bad, x]), np.concatenate([y[:4], y])), "clean": (x, y)}.items():
        # every=3: on JAX the host's bounds decide (2 keeps the branch always).
        opt = kg.optimizers.LLQRSAM(sgd(0.1), structure=structure, refresh_every=every, rho=0.2)
        model, _ = build(opt)
        rec = Recorder()
        hist = fit(model, xs, ys, 4, callbacks=[rec])
        runs[name] = (model, rec, hist)
    model, rec, hist = runs["with_nan"]
    clean_model, clean_rec, _ = runs["clean"]
    assert hist.history["skipped_steps"] == [1.0]  # a count
    # After the NaN batch: nothing moved, U is still the identity.
    assert rec.refreshes[0] == 0
    identity = [np.ones(u.shape) if len(u.shape) != 2 or "_d" in u.name or "_s" in u.name else np.eye(u.shape[0])
                for u in model.optimizer.preconditioner.variables]
    assert_close(rec.u[0], identity, rtol=0, atol=0)
    # Then the refresh that was due: the same as without the NaN batch.
    assert rec.refreshes[1:] == clean_rec.refreshes == [1, 1]
    assert_close(rec.u[-1], clean_rec.u[-1], rtol=1e-6, atol=1e-7)
    assert_close(ref.weights_of(model), ref.weights_of(clean_model), rtol=1e-6, atol=1e-7)
    assert int(to_np(model.optimizer.iterations)) == 2


@pytest.mark.parametrize("source", ["step", "callback"])
def test_gradient_accumulation_refreshes_once_per_optimizer_step(source):
    """With gradient_accumulation_steps=2 and refresh_every=1, four
    micro-batches are two optimizer steps: two refreshes (not four), each
    before the step's first micro-batch, and U constant within a step."""
    x, y = ref.make_data(47, 16, D_IN, K)
    base = keras.optimizers.SGD(0.1, momentum=0.9, gradient_accumulation_steps=2)
    opt = kg.optimizers.LLQRSAM(base, refresh_every=1, rho=0.2, refresh_source=source)
    model, _ = build(opt)
    rec = Recorder()
    callbacks = [rec] + ([kg.callbacks.PreconditionerRefresh(x, y, batch_size=4)] if source == "callback" else [])
    fit(model, x, y, 4, callbacks=callbacks)
    assert rec.refreshes == [1, 1, 2, 2]
    assert_close(rec.u[1], rec.u[0], rtol=0, atol=0)  # the same U for both micro-batches
    assert_close(rec.u[3], rec.u[2], rtol=0, atol=0)
    assert max_abs_diff(rec.u[2], rec.u[1]) > 1e-6  # ... and a new one at the next step
    assert int(to_np(opt.iterations)) == 2


def test_decay_mask_kernels_leaves_biases_undecayed():
    """decay_mask="kernels": coupled decay on tensors of >= 2 axes only
    (NumPy reference); the biases follow U g alone."""
    wd = 0.3
    x, y = ref.make_data(48, 16, D_IN, K)
    model, init = build(kg.optimizers.LLQR(sgd(), refresh_source="callback", coupled_weight_decay=wd, decay_mask="kernels"))
    random_u(model.optimizer, np.random.default_rng(49))
    groups = u_groups(model.optimizer)
    fit(model, x, y, 4)
    params = [p.copy() for p in init]
    vel = [np.zeros_like(p) for p in params]
    for xb, yb in batches_of(x, y, 4):
        d = [u + (wd * p if p.ndim >= 2 else 0.0) for u, p in zip(apply_u(groups, grad(params, xb, yb)), params)]
        vel = [0.9 * b - 0.1 * t for b, t in zip(vel, d)]
        params = [p + b for p, b in zip(params, vel)]
    assert_close(ref.weights_of(model), params)
    everything = llqrsam_reference(init, batches_of(x, y, 4), groups, lr=0.1, momentum=0.9, rho=0.0, wd=wd, two_pass=False)
    assert max_abs_diff(params, everything) > TEETH
    with pytest.raises(ValueError, match="decay_mask"):
        kg.optimizers.LLQR(sgd(), decay_mask="biases")


def test_refresh_until_stops_refreshing():
    x, y = ref.make_data(50, 16, D_IN, K)
    opt = kg.optimizers.LLQRSAM(sgd(), refresh_every=1, refresh_until=2, rho=0.1)
    model, _ = build(opt)
    rec = Recorder()
    fit(model, x, y, 4, callbacks=[rec])
    assert rec.refreshes == [1, 2, 2, 2]
    assert_close(rec.u[3], rec.u[1], rtol=0, atol=0)
    cfg = opt.get_config()
    assert cfg["refresh_until"] == 2 and kg.optimizers.LLQRSAM.from_config(cfg).get_config() == cfg
    with pytest.raises(ValueError, match="refresh_until"):
        kg.optimizers.LLQR(sgd(), refresh_until=0)


def test_a_loss_scale_overflow_on_a_due_step_leaves_u_alone(step_branching):
    """mixed_float16: an overflowing (here NaN) batch on a refresh-due step is
    skipped by the loss-scale path too: the scale halves, U and `refreshes`
    stay, and the refresh happens on the next finite step."""
    x, y = ref.make_data(51, 8, D_IN, K)
    bad = x[:4].copy()
    bad[0, 1] = np.nan
    policy = keras.config.dtype_policy()
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        opt = kg.optimizers.LLQRSAM(sgd(0.1), refresh_every=2, rho=0.2)
        model, _ = build(opt)
        lso = model.optimizer
        assert isinstance(lso, keras.optimizers.LossScaleOptimizer)
        scale0 = float(to_np(lso.dynamic_scale))
        rec = Recorder()
        hist = fit(model, np.concatenate([bad, x]), np.concatenate([y[:4], y]), 4, callbacks=[rec])
    finally:
        keras.config.set_dtype_policy(policy)
    assert hist.history["skipped_steps"] == [1.0]
    assert float(to_np(lso.dynamic_scale)) == scale0 / 2
    assert rec.refreshes == [0, 1, 1]
    identity = [np.ones(u.shape) for u in opt.preconditioner.variables]  # diagonal U starts at ones
    assert_close(rec.u[0], identity, rtol=0, atol=0)
    assert max_abs_diff(rec.u[1], identity) > 1e-6


def test_a_step_whose_perturbed_pass_overflows_leaves_a_refreshed_u_alone():
    """The centre pass is finite (so the due refresh does move U), the
    perturbed one overflows (rho 1e38 pushes the weights to inf): the step is
    skipped, and U, `refreshes` and the weights stay as they were."""
    x, y = ref.make_data(52, 4, D_IN, K)
    opt = kg.optimizers.LLQRSAM(sgd(0.1), refresh_every=1, rho=1e38)
    model, init = build(opt)
    rec = Recorder()
    hist = fit(model, x, y, 4, callbacks=[rec])
    assert hist.history["skipped_steps"] == [1.0]
    assert rec.refreshes == [0] and int(to_np(opt.iterations)) == 0
    assert_close(rec.u[0], [np.ones(u.shape) for u in opt.preconditioner.variables], rtol=0, atol=0)
    assert_close(ref.weights_of(model), init, rtol=0, atol=0)
    # Teeth: the same refresh with a finite step does change U.
    ok = kg.optimizers.LLQRSAM(sgd(0.1), refresh_every=1, rho=0.1)
    model2, _ = build(ok)
    rec2 = Recorder()
    fit(model2, x, y, 4, callbacks=[rec2])
    assert rec2.refreshes == [1] and max_abs_diff(rec2.u[0], rec.u[0]) > 1e-6


@pytest.mark.parametrize("structure", ["diagonal", "kfac"])
def test_u_products_follow_assignments_to_u(structure):
    """U's products read U as it is now: after its variables are assigned
    (a refresh, a load, a user), the next product uses the new values.
    Eager backends keep U's operator between steps (its tensors are
    updated in place), so a stale operator would show here."""
    opt = kg.optimizers.LLQRSAM(sgd(), structure=structure, refresh_source="callback")
    model, _ = build(opt)
    rng = np.random.default_rng(5)
    vecs = [rng.normal(size=tuple(v.shape)).astype("float32") for v in model.trainable_variables]
    tensors = [ops.convert_to_tensor(v) for v in vecs]
    before = [to_np(t) for t in opt.preconditioner.precondition(tensors)]
    assert_close(before, vecs, rtol=1e-6, atol=1e-7)  # U starts as the identity
    for _ in range(2):
        random_u(opt, rng)
        got = [to_np(t) for t in opt.preconditioner.precondition(tensors)]
        assert_close(got, apply_u(u_groups(opt), vecs), rtol=1e-5, atol=1e-6)
        assert max_abs_diff(got, before) > 1e-2
        before = got
