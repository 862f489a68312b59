"""Stop tokens in order (`ordered_stops`, decoding/targets.py): a stop token is committed only at the first
undecided position, so a block's confidently-EOS tail cannot pull the answer's end forward.

The pure rule is checked on hand-made rows; the end-to-end checks use the built-in model, whose
fill-in-the-middle answer to `def area(r):` / `return result` came back empty before (issue 30, item 6).
"""
from __future__ import annotations

import httpx
import pytest
import torch

from unmask.decoding.targets import defer_late_stops
from unmask.defaults import default_model_path
from unmask.engine.infill import infill
from unmask.engine.llm import LLM
from unmask.engine.params import GenerationParams, model_defaults

from test_server import Server

STOPS = torch.tensor([2, 5])
PREFIX, SUFFIX = "def area(r):\n    ", "\n    return result\n"


def test_stops_right_of_the_first_hole_wait():
    targets = torch.tensor([10, 11, 12, 13])
    tokens = torch.tensor([7, 2, 9, 5])            # stops proposed at 11 and 13
    commit = torch.tensor([True, True, True, True])
    kept = defer_late_stops(commit, tokens, targets, 10, STOPS)
    assert kept.tolist() == [True, False, True, False]
    assert commit.tolist() == [True] * 4           # the caller's mask is not changed in place


def test_a_stop_at_the_first_hole_is_committed():
    kept = defer_late_stops(torch.tensor([True, True]), torch.tensor([2, 2]), torch.tensor([4, 5]), 4, STOPS)
    assert kept.tolist() == [True, False]


def test_a_step_of_only_late_stops_commits_the_leftmost_target():
    # the first hole (3) is outside this window's targets: nothing is "at the hole", so the leftmost target goes
    commit = torch.tensor([False, True, True])
    kept = defer_late_stops(commit, torch.tensor([9, 5, 2]), torch.tensor([6, 7, 8]), 3, STOPS)
    assert kept.tolist() == [True, False, False]


def test_nothing_to_defer_returns_the_same_mask():
    commit = torch.tensor([True, False])
    assert defer_late_stops(commit, torch.tensor([7, 2]), torch.tensor([0, 1]), 0, STOPS) is commit


def test_defaults_on_for_the_builtin_family_only():
    assert model_defaults("unmask", {})["ordered_stops"] is True
    assert "ordered_stops" not in model_defaults("sdar", {})
    assert model_defaults("unmask", {"ordered_stops": False})["ordered_stops"] is False
    assert model_defaults("llada", {"ordered_stops": True})["ordered_stops"] is True


@pytest.fixture(scope="module")
def builtin():
    return LLM(default_model_path(), dtype="float32", device="cpu")


def test_builtin_infill_is_no_longer_empty(builtin):
    # the threshold rule, whose commit order the switch is about (the model's default policy decodes left to right)
    on = infill(builtin, PREFIX, SUFFIX, GenerationParams(max_tokens=24, policy="threshold"))
    off = infill(builtin, PREFIX, SUFFIX, GenerationParams(max_tokens=24, policy="threshold", ordered_stops=False))
    assert off.text == ""                          # the tail's EOS, committed first, ended it at once
    assert on.text == "return result\n"
    assert on.finish_reason == "stop"
    default = infill(builtin, PREFIX, SUFFIX, GenerationParams(max_tokens=24))
    assert (default.text, default.finish_reason) == ("return result\n", "stop")


def test_ordered_stops_never_changes_one_token_per_forward_left_to_right(builtin):
    # block size 1 decodes left to right: every stop is at the first hole, so the rule changes nothing
    p = dict(max_tokens=16, block_size=1, policy="topk", tokens_per_step=1)
    a = builtin.generate("def add(a, b):", GenerationParams(**p))[0]
    b = builtin.generate("def add(a, b):", GenerationParams(**p, ordered_stops=False))[0]
    assert a.token_ids == b.token_ids


def test_fim_endpoint_and_the_request_switch(tmp_path):
    s = Server(default_model_path(), tmp_path / "log").wait_ready()
    try:
        body = {"model": "unmask-tiny", "prompt": PREFIX, "suffix": SUFFIX, "max_tokens": 24, "policy": "threshold"}
        on = httpx.post(f"{s.url}/v1/fim/completions", json=body, timeout=60).json()
        off = httpx.post(f"{s.url}/v1/completions", json={**body, "ordered_stops": False}, timeout=60).json()
        bad = httpx.post(f"{s.url}/v1/completions", json={**body, "ordered_stops": "yes please"}, timeout=60)
    finally:
        s.stop()
    assert on["choices"][0]["text"] == "return result\n"
    assert off["choices"][0]["text"] == ""
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "ordered_stops"
