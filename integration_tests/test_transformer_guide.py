"""The guide ``guides/llqr_sam_transformer.py`` in its default small mode, as a
user runs it (tests/guides/test_guide_transformer.py checks the smoke mode in
detail)."""

import importlib.util
import math
import os
import time

import keras
import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
GUIDE = os.path.join(HERE, os.pardir, "guides", "llqr_sam_transformer.py")


@pytest.mark.small_guide
def test_small_mode_end_to_end(tmp_path, report):
    spec = importlib.util.spec_from_file_location("llqr_sam_transformer_small", GUIDE)
    guide = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(guide)
    t0 = time.perf_counter()
    facts = guide.main(["--output", str(tmp_path)])
    seconds = time.perf_counter() - t0
    assert facts["mode"] == "small" and facts["backend"] == keras.backend.backend()
    lm, vit = facts["lm"], facts["vit"]
    assert tuple(lm["optimizers"]) == ("AdamW", "SAM", "LLQR", "LLQR+SAM")
    assert tuple(vit["optimizers"]) == ("AdamW", "LLQR+SAM")
    vocab = lm["data"]["vocab_size"]
    for part, metric in ((lm, "val_perplexity"), (vit, "val_accuracy")):
        for name, entry in part["optimizers"].items():
            runs = entry["runs"]
            assert len(runs) == part["sizes"]["seeds"] >= 2
            assert all(math.isfinite(r["val_loss"]) and r["steps"] == part["steps"] for r in runs)
            lo, hi = entry[metric]["interval"]
            assert lo <= entry[metric]["mean"] <= hi
            if name in ("LLQR", "LLQR+SAM"):
                assert all(n > 0 for n in entry["refreshes"])
                assert all(r["refresh_seconds"] >= 0 for r in runs)
        assert part["conclusion"]
    # the language model learned: well below a uniform guess over the vocabulary
    for entry in lm["optimizers"].values():
        assert all(r["val_perplexity"] < vocab / 4 for r in entry["runs"])
    # the stripes are learnable: AdamW well above chance (1/8), every
    # optimizer above it (SAM's perturbation slows this early phase)
    assert vit["optimizers"]["AdamW"]["val_accuracy"]["mean"] > 0.5
    for entry in vit["optimizers"].values():
        assert entry["val_accuracy"]["mean"] > 1.5 / vit["num_classes"]
    table = ", ".join(f"{name} {guide.fmt(e['val_perplexity'])}" for name, e in lm["optimizers"].items())
    vit_table = ", ".join(f"{name} {guide.fmt(e['val_accuracy'])}" for name, e in vit["optimizers"].items())
    report(f"transformer guide small mode: {seconds:.0f}s; val perplexity {table}; ViT accuracy {vit_table}")
    report(f"lm conclusion: {lm['conclusion']}")
