"""``bench/scale.py`` and its FLOP counts (``bench/_flops.py``): the forward
count of every product kind against hand-computed values, U's count
against its blocks' shapes, and a smoke run of the bench on a tiny GPT-2
on this backend (seconds; the real shapes never run in the tests)."""

import json
import os
import subprocess
import sys

import keras
import numpy as np
import pytest

from locations import REPO

sys.path.insert(0, f"{REPO}/bench")
import _flops  # noqa: E402


def test_forward_flops_of_attention_dense_convolution_and_depthwise_layers():
    """2 FLOPs per multiply-add, every product the layers run, whichever op
    the backend's layer uses (torch's MultiHeadAttention may call
    ``dot_product_attention`` where the others use two einsums)."""
    B, T, V, d, H, dk = 2, 5, 11, 8, 2, 4
    tokens = keras.Input((T,), dtype="int32")
    h = keras.layers.Embedding(V, d)(tokens)  # a gather: no product
    h = keras.layers.MultiHeadAttention(H, dk)(h, h)
    h = keras.layers.Dense(16)(h)
    attention = keras.Model(tokens, h)
    projections = 4 * 2 * B * T * d * H * dk  # query, key, value, output
    scores_and_values = 2 * (2 * B * H * T * T * dk)
    expected = projections + scores_and_values + 2 * B * T * d * 16
    x = np.random.default_rng(0).integers(0, V, (B, T))
    assert _flops.forward_flops(attention, x) == expected

    image = keras.Input((6, 6, 3))
    g = keras.layers.Conv2D(4, 3, padding="same")(image)  # 6x6 out, 3x3x3 -> 4
    g = keras.layers.Conv2D(5, 3, strides=2)(g)  # valid: 2x2 out, 3x3x4 -> 5
    g = keras.layers.DepthwiseConv2D(3, padding="same")(g)  # 2x2 out, 3x3 per channel, 5 channels
    g = keras.layers.Dense(3)(keras.layers.Flatten()(g))
    convolutional = keras.Model(image, g)
    expected = 2 * B * (36 * 27 * 4 + 4 * 36 * 5 + 4 * 9 * 5 + 20 * 3)
    assert _flops.forward_flops(convolutional, np.zeros((B, 6, 6, 3), "float32")) == expected


def test_u_flops_from_the_block_shapes():
    """K-FAC: A X B^T, 2 (m^2 n + m n^2); EK-FAC twice that; an Embedding's
    diagonal-input blocks 2 m n^2 (K-FAC) and 4 m n^2 (EK-FAC); diagonal
    blocks nothing."""
    from keras_geosam import curvature as kc

    layout = [(kc.KFAC, (3, 2, 5), 2), (kc.EKFAC, (4, 6), 1), (kc.DiagonalInputKFAC, (50, 7), 1),
              (kc.DiagonalInputEKFAC, (50, 7), 1), (kc.Diagonal, (9,), None)]
    m, n = 6, 5
    expected = 2 * (m * m * n + m * n * n) + 2 * 2 * (16 * 6 + 4 * 36) + 2 * 50 * 49 + 4 * 50 * 49
    assert _flops.u_flops(layout) == expected


def test_the_bench_runs_every_method_on_a_tiny_gpt2(tmp_path):
    """Every column of the table is filled on this backend, U's FLOPs are
    those of the tiny model's layout, and no compilation follows the first
    two steps or the first refresh."""
    pytest.importorskip("keras_hub")
    out = tmp_path / "scale.json"
    env = dict(os.environ, KERAS_BACKEND=keras.backend.backend())
    proc = subprocess.run([sys.executable, f"{REPO}/bench/scale.py", "--toy", "--methods", "sam,llqr_kfac,llqr_ekfac",
                           "--json", str(out)], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {r["method"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"sam", "llqr_kfac", "llqr_ekfac"}
    # the toy: 1 block of width 16 (MLP 32), 2 heads; vocabulary 96, tied
    qkvo = 2 * (16**2 * 16 + 16 * 16**2)
    mlp = 2 * 2 * (16**2 * 32 + 16 * 32**2)
    embedding = 2 * 96 * 16**2
    assert rows["llqr_kfac"]["u_flops"] == 4 * qkvo + mlp + embedding
    assert rows["llqr_ekfac"]["u_flops"] == 2 * rows["llqr_kfac"]["u_flops"]
    for name in ("llqr_kfac", "llqr_ekfac"):
        r = rows[name]
        assert r["over_sam"] > 0 and r["floor_s"] > rows["sam"]["step_s"] and r["refresh_over_floor"] > 0
        assert r["refresh_compiles_s"] == 0 and r["compile_after_first_step_s"] == 0
    assert "Goals:" in proc.stdout and proc.stdout.count(f"| {keras.backend.backend()} | toy | small |") == 3


class _Memory:
    """Known peaks in the order the estimator bench reads them (the step's,
    tr H's, S_R's) above a resident set of 100: this test process already
    holds memory from earlier tests, so its real set need not grow."""

    def __init__(self, peaks):
        self.device, self.peaks = None, iter(peaks)

    def rss(self):
        return 100

    def reset(self):
        pass

    def peak(self):
        return next(self.peaks)


@pytest.mark.parametrize("step_peak, ratios", [(300, (1.5, 3.0)), (100, (None, None))])
def test_the_estimator_bench_reads_a_probe_in_gradients_on_a_tiny_gpt2(monkeypatch, step_peak, ratios):
    """``--estimators`` on the toy, in this process: a probe's cost in
    gradients and the peak over a training step's are read, and both
    estimates are finite numbers with their stderr. A step whose peak
    does not rise above the set before it gives no ratio, not a division
    by zero."""
    pytest.importorskip("keras_hub")
    import scale

    monkeypatch.setattr(scale, "Memory", lambda backend: _Memory([step_peak, 400, 700]))
    row = scale.run_estimators(None, "toy", probes=2)
    assert row["gradient_s"] > 0 and row["step_peak_bytes"] == step_peak - 100
    for name, ratio, peak in zip(("hessian_trace", "riemannian_sharpness_kfac"), ratios, (300, 600)):
        e = row[name]
        assert e["per_probe_gradients"] == pytest.approx(e["per_probe_s"] / row["gradient_s"])
        assert e["marginal_gradients"] <= e["per_probe_gradients"]
        assert np.isfinite(e["value"]) and e["stderr"] > 0
        assert e["peak_bytes"] == peak and e["peak_over_step"] == ratio
    assert row["hessian_trace"]["setup_gradients"] == 0 and row["riemannian_sharpness_kfac"]["setup_gradients"] > 0
    assert "| toy | hessian_trace |" in scale.estimator_table([row])
    assert scale.estimator_table([row]).splitlines()[2].endswith("| 1.50 |" if ratios[0] else "| - |")


def test_paired_runs_take_their_steps_in_turn_and_read_ratios_within_a_round():
    """``--paired`` on the toy, in this process: one row per method, each
    ratio the median of the per-round ratios (SAM's own exactly 1), and the
    table's /SAM column reads it."""
    pytest.importorskip("keras_hub")
    import argparse

    import scale

    args = argparse.Namespace(steps=3, refresh_steps=2)
    rows = scale.run_paired(args, "toy", "small", ["sam", "llqr_diag"])
    assert [r["method"] for r in rows] == ["sam", "llqr_diag"]
    sam, diag = rows
    assert sam["paired_ratios"] == {"sam": 1.0} and len(diag["step_s_all"]) == 3
    per_round = [d / s for d, s in zip(diag["step_s_all"], sam["step_s_all"])]
    assert diag["paired_ratios"]["sam"] == pytest.approx(float(np.median(per_round)))
    scale.derive(rows)
    assert diag["over_sam"] == diag["paired_ratios"]["sam"] and diag["floor_over_sam"] == 1.0
    assert "| toy | small/paired | LLQR+SAM diag |" in scale.table(rows)
