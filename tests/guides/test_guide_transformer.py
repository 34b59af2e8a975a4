"""The guide ``guides/llqr_sam_transformer.py`` end to end in its ``--smoke``
mode (a one-block character-level Transformer on standard-library source
with AdamW, SAM, LLQR and LLQR+SAM, then a one-block ViT on generated
stripes with AdamW and LLQR+SAM, one seed each), and the facts it reports.

Run once per backend (``KERAS_BACKEND=jax|tensorflow|torch``).
"""

import importlib.util
import json
import math
import os
import subprocess
import sys

import keras
import numpy as np
import pytest
import scipy.stats
from locations import GUIDES

GUIDE = os.path.join(GUIDES, "llqr_sam_transformer.py")
LM_OPTIMIZERS = ("AdamW", "SAM", "LLQR", "LLQR+SAM")
LEARNS_U = ("LLQR", "LLQR+SAM")


@pytest.fixture(scope="module")
def guide():
    spec = importlib.util.spec_from_file_location("llqr_sam_transformer_guide", GUIDE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def facts(tmp_path_factory):
    """The guide's facts from a fresh interpreter: the guide compiles a dozen
    steps, and in a worker that had already run the rest of the suite XLA's
    compiler once crashed the process (a segfault takes the xdist worker down
    and leaves the run hanging); a subprocess fails the test instead."""
    out = str(tmp_path_factory.mktemp("transformer_guide"))
    env = dict(os.environ, KERAS_BACKEND=keras.backend.backend())
    if keras.backend.backend() == "torch":
        # Tiny models: torch's intra-op threads only add overhead, and on a
        # busy runner they made these steps several times slower.
        env["OMP_NUM_THREADS"] = "1"
    run = subprocess.run(
        [sys.executable, "-X", "faulthandler", GUIDE, "--smoke", "--output", out],
        env=env, capture_output=True, text=True, timeout=900,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-6000:]
    with open(os.path.join(out, "facts.json")) as f:
        saved = json.load(f)
    assert saved["backend"] == keras.backend.backend()
    assert saved["mode"] == "smoke"
    return saved


def _check_part(part, optimizers, metric):
    assert tuple(part["optimizers"]) == optimizers
    for name, entry in part["optimizers"].items():
        runs = entry["runs"]
        assert len(runs) == part["sizes"]["seeds"] >= 1
        for r in runs:
            assert math.isfinite(r["val_loss"]) and math.isfinite(r["train_loss"]), (name, r)
            assert r["val_perplexity"] == pytest.approx(math.exp(r["val_loss"]), rel=1e-9)
            assert 0.0 <= r["val_accuracy"] <= 1.0
            assert r["steps"] == part["steps"] > 0
        for key in ("val_loss", metric):
            stat = entry[key]
            assert stat["n"] == len(runs)
            assert stat["mean"] == pytest.approx(np.mean([r[key] for r in runs]), rel=1e-9)
            if stat["n"] >= 2:
                lo, hi = stat["interval"]
                assert lo <= stat["mean"] <= hi
            else:  # one seed: no interval, and the guide says so
                assert stat["interval"] is None and stat["half_width"] is None
        if name in LEARNS_U:
            # from the fit history (kg.callbacks.RefreshMonitor)
            assert all(n > 0 for n in entry["refreshes"]), (name, entry["refreshes"])
            # one refresh per period begun, step 0 included
            every = part["sizes"]["refresh_every"]
            assert all(n == -(-part["steps"] // every) for n in entry["refreshes"])
            assert all(r["refresh_seconds"] >= 0 for r in runs)
        else:
            assert "refreshes" not in entry
        if name != "AdamW":
            diffs = [r[metric] - b[metric] for r, b in zip(runs, part["optimizers"]["AdamW"]["runs"])]
            assert entry["minus_adamw"]["mean"] == pytest.approx(np.mean(diffs), rel=1e-9, abs=1e-12)
    assert isinstance(part["conclusion"], str) and part["conclusion"]


def test_language_model_part(facts):
    lm = facts["lm"]
    _check_part(lm, LM_OPTIMIZERS, "val_perplexity")
    data = lm["data"]
    assert data["vocab_size"] == 101 and data["train_characters"] > data["val_characters"] > 0
    assert data["modules"][0] == "argparse"
    # training moved the model away from its initial, near-uniform guess
    for entry in lm["optimizers"].values():
        for r in entry["runs"]:
            assert r["val_perplexity"] < data["vocab_size"]


def test_preconditioner_summary_shows_attention_views(facts):
    lines = facts["preconditioner_summary"]
    assert lines and "2-D view" in lines[0]
    rows = {line.split()[0]: line.split()[1:] for line in lines[1:]}
    d, heads = facts["lm"]["sizes"]["d"], facts["lm"]["sizes"]["heads"]
    query = rows["block0_attention/query/kernel"]
    assert query[0] == "KFAC" and " ".join(query[2:]) == f"{d} x {d}"
    out = rows["block0_attention/attention_output/kernel"]
    assert out[0] == "KFAC" and out[1] == f"{heads}x{d // heads}x{d}"
    assert rows["block0_norm1/gamma"][0] == "Diagonal"


def test_vit_part_ran(facts):
    vit = facts["vit"]
    assert vit["data"] == "stripes" and vit["num_classes"] == 8
    _check_part(vit, ("AdamW", "LLQR+SAM"), "val_accuracy")


def test_t_interval(guide):
    values = [1.0, 2.0, 4.0]
    stat = guide.t_interval(values)
    half = scipy.stats.t.ppf(0.975, 2) * np.std(values, ddof=1) / math.sqrt(3)
    assert stat["mean"] == pytest.approx(7 / 3)
    assert stat["interval"] == pytest.approx([7 / 3 - half, 7 / 3 + half])
    assert guide.t_interval([3.0])["interval"] is None


def test_conclusion_reads_the_intervals(guide):
    def results(per_optimizer):
        out = {}
        base = per_optimizer["AdamW"]
        for name, values in per_optimizer.items():
            out[name] = {"m": guide.t_interval(values)}
            if name != "AdamW":
                out[name]["minus_adamw"] = guide.t_interval([v - b for v, b in zip(values, base)])
        return out

    overlapping = results({"AdamW": [5.0, 5.2, 5.4], "SAM": [5.1, 5.3, 5.5], "LLQR": [4.9, 5.3, 5.6]})
    text = guide.conclude(overlapping, "m", "perplexity", lower_is_better=True)
    assert text.startswith("AdamW has the lowest") and "no difference between the three optimizers" in text
    separated = results({"AdamW": [5.0, 5.1, 5.2], "SAM": [6.0, 6.1, 6.2], "LLQR": [5.05, 5.1, 5.25]})
    text = guide.conclude(separated, "m", "perplexity", lower_is_better=True)
    assert "clear of SAM" in text and "overlaps LLQR" in text and "SAM worse by 1" in text
    one_seed = results({"AdamW": [5.0], "SAM": [6.0]})
    assert "no intervals" in guide.conclude(one_seed, "m", "perplexity", lower_is_better=True)
