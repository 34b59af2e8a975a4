"""The guide ``guides/llqr_sam_resnet.py`` in its default small mode, as a
user runs it (tests/guides/test_guide_resnet.py checks the smoke mode in detail)."""

import importlib.util
import math
import os
import time

import keras
import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
GUIDE = os.path.join(HERE, os.pardir, "guides", "llqr_sam_resnet.py")


@pytest.mark.small_guide
def test_small_mode_end_to_end(tmp_path, report):
    spec = importlib.util.spec_from_file_location("llqr_sam_resnet_small", GUIDE)
    guide = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(guide)
    t0 = time.perf_counter()
    facts = guide.main(["--output", str(tmp_path)])
    seconds = time.perf_counter() - t0
    assert facts["mode"] == "small" and facts["backend"] == keras.backend.backend()
    assert facts["refreshes"] > 0 and facts["resumed_refreshes"] >= facts["reload_refreshes"] == facts["refreshes"]
    assert facts["resumed_iterations"] > facts["reload_iterations"] == facts["iterations"]
    history = facts["history"]
    assert all(math.isfinite(v) for v in history["loss"])
    assert history["refreshes"][-1] == facts["refreshes"]
    assert all(v >= 0 for v in history["refresh_seconds"])
    assert any(math.isfinite(v) for v in history["hessian_trace"])
    report(f"resnet guide small mode: {seconds:.0f}s, {facts['refreshes']} refreshes, "
           f"refresh seconds {history['refresh_seconds'][-1]:.2f}")
