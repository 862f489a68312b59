"""The bench report's merge of the opt-in long-prefill rows into the cost section's prefill curve."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from benchlib.common import with_long_prefill  # noqa: E402


def _row(L: int, seconds: float) -> dict:
    one = lambda x: {"median": x, "min": x, "max": x, "n": 1, "values": [x]}  # noqa: E731
    return {"length": L, "prefill_s": one(seconds), "s_per_token": one(0.01), "delta_mb": one(L / 1000),
            "kv_cache_mb": L / 256, "kv_alloc_mb": L / 128}


def test_long_rows_join_the_curve_and_the_fit_is_redone():
    power = lambda L: 1e-6 * L ** 1.5  # noqa: E731
    pre = {"rows": [_row(L, power(L)) for L in (1024, 2048, 4096)],
           "fits": {"prefill_s": {"slope": 9.0, "slope_per_round": {"median": 9.0}},
                    "s_per_token": {"slope": 0.0}, "delta_mb": {"slope": 1.0}}}
    long = {"prefill": {"rows": [_row(L, power(L)) for L in (4096, 32768, 131072)]}}
    merged = with_long_prefill(pre, long)
    assert [r["length"] for r in merged["rows"]] == [1024, 2048, 4096, 32768, 131072]
    assert merged["rows"][2] is pre["rows"][2]  # a length both have keeps the interleaved suite's row
    assert merged["fits"]["prefill_s"]["slope"] == pytest.approx(1.5)
    assert merged["fits"]["prefill_s"]["slope_upper_half"] == pytest.approx(1.5)
    assert merged["fits"]["delta_mb"]["slope"] == pytest.approx(1.0)
    assert merged["fits"]["prefill_s"]["slope_per_round"] == {"median": 9.0}  # per-round slopes: the suite's own
    assert with_long_prefill(pre, None) is pre


def test_core_wall_leaves_out_opt_in_sections():
    from suite import core_wall_s

    done = {"policies": {"wall_s": 100.0}, "batch": {"wall_s": 50.0}, "longprefill": {"wall_s": 300.0}}
    assert core_wall_s(done, ["policies", "batch", "longprefill"], 420.0) == 120.0   # this run: wall less opt-in
    assert core_wall_s(done, ["policies", "batch"], 160.0) == 160.0                   # an earlier opt-in run
    assert core_wall_s(done, ["batch"], None) == 150.0                                # partial: recorded core times
