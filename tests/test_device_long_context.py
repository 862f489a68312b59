"""scripts/device_long_context.py: the YaRN factors per stage, the rate read from a resumed run's log, the time
plan, and its one-line errors (the whole path runs as `--quick` on the CPU in about a minute: docs/training.md)."""
from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _script():
    spec = importlib.util.spec_from_file_location("device_long_context", ROOT / "scripts" / "device_long_context.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_factors_give_each_stage_four_times_its_length_and_the_last_the_longest_needle():
    m = _script()
    built_in = json.loads((ROOT / "src" / "unmask" / "assets" / "unmask-tiny" / "config.json").read_text())
    original = m.original_context(built_in)
    assert original == 2048  # its max_position_embeddings: what long_context.scale_rope scales
    assert m.stage_factors([2048, 8192, 32768], original, 4.0, 131072) == [4.0, 16.0, 64.0]
    # a last stage short of the longest needle is scaled up to it; a context already long enough is not scaled
    assert m.stage_factors([256, 4096], original, 4.0, 65536) == [None, 32.0]
    # a model that already has a scaling is scaled relative to the same original, as scale_rope does
    scaled = {**built_in, "max_position_embeddings": 8192,
              "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 2048}}
    assert m.original_context(scaled) == 2048


def test_steady_rate_of_a_resumed_run_counts_from_the_step_it_resumed_at():
    m = _script()
    # resumed at 20; 10 steps of 1,000 tokens took 10 s (1,000 tokens/s average), 20 steps 15 s: the last 10
    # steps ran at 2,000 tokens/s
    log = ("unmask model, ..., resumed at step 20\nstep 30/50 loss 2.0 lr 3e-4 1,000 tok/s eta 00:00:20\n"
           "step 40/50 loss 2.0 lr 3e-4 1,333 tok/s eta 00:00:10\n")
    assert m.steady_rate(log, 1000) == pytest.approx(2000, rel=1e-3)
    assert m.steady_rate("step 10/10 loss 2 lr 1e-4 900 tok/s eta 00:00:00\n", 1000) is None  # one line: no rate


def test_plan_shares_the_time_left_after_each_stage_start_up():
    m = _script()
    # 300 s left, 3 stages of 20 s start-up: 240 s to share; 0.2 of 1.0 -> 48 s at 10,000 tokens/s of 2 x 1,000
    assert m.plan_stage(300, 0.2, 1.0, 20, 3, 10_000, 2, 1000) == (pytest.approx(48.0), 240)
    assert m.plan_stage(10, 0.5, 1.0, 20, 1, 10_000, 2, 1000)[1] == m.MIN_STEPS  # no time: the floor


def test_cost_model_grows_linearly_with_the_row_length():
    m = _script()
    cfg = json.loads((ROOT / "src" / "unmask" / "assets" / "unmask-tiny" / "config.json").read_text())
    c2, c8, c32 = (m.cost_per_token(cfg, n) for n in (2048, 8192, 32768))
    assert c8 - c2 == pytest.approx((c32 - c8) / 4)  # the attention term: 4x the length, 4x the increase
    assert 1.5 < c8 / c2 < 2.5 and 2.5 < c32 / c8 < 3.5  # the linear part still counts at 2K, less at 32K
    c512, c1k = m.cost_per_token(cfg, 512), m.cost_per_token(cfg, 1024)  # the dense mask's whole square
    assert c1k - c512 == pytest.approx(3.5 * 2 * 2 * 4 * 512 * 8 * 64 * 5)


def test_predicted_rate_scales_by_flops_and_charges_the_mask_copy_on_cuda():
    m = _script()
    cfg = json.loads((ROOT / "src" / "unmask" / "assets" / "unmask-tiny" / "config.json").read_text())
    for cuda in (False, True):  # the shape it was measured at gives the measured rate back
        assert m.predict_rate(cfg, 8192, 4, 70_000, 8192, 4, cuda) == pytest.approx(70_000)
    cpu = m.predict_rate(cfg, 8192, 4, 70_000, 32768, 1, False)
    assert cpu == pytest.approx(70_000 * m.cost_per_token(cfg, 8192) / m.cost_per_token(cfg, 32768))
    # on CUDA the [64K, 64K] mask's copy each step (4.3 GB at the assumed 10 GB/s) adds to the 32K step
    step = 32768 / m.predict_rate(cfg, 8192, 4, 70_000, 32768, 1, True)
    copy_8k = 16384 ** 2 / m.MASK_COPY_BYTES_PER_S
    flops_step = 32768 * m.cost_per_token(cfg, 32768) * (4 * 8192 / 70_000 - copy_8k) / (
        4 * 8192 * m.cost_per_token(cfg, 8192))
    assert step == pytest.approx(flops_step + 65536 ** 2 / m.MASK_COPY_BYTES_PER_S)


@pytest.mark.parametrize("args, message", [
    (["--stages", "8192:4,2048:16"], "--stages: lengths of at least 16 tokens, growing"),
    (["--stages", "2048"], "--stages takes LENGTH:ROWS"),
    (["--needle-trials", "4,2"], "--needle-trials: one count >= 1, or one per length (5)"),
])
def test_bad_options_are_one_line(args, message):
    p = subprocess.run([sys.executable, str(ROOT / "scripts" / "device_long_context.py"), *args],
                       capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert p.returncode == 2 and message in p.stderr.strip().splitlines()[-1]
