"""The learned commit rule: fitting, the `learned` policy, the replay of a model's own decoding, `unmask calibrate`."""
from __future__ import annotations

import json
import math

import pytest
import torch

from test_distill import TEXT, base, corpus  # noqa: F401 (fixtures)
from test_train import _cli, _one_line_error, tokdir  # noqa: F401 (tokdir: a fixture)
from unmask.decoding import BlockState, PolicyConfig, decide
from unmask.decoding.commit_filter import FEATURES, CommitFilter, commit_rows, features, fit
from unmask.decoding.sampling import SamplingParams
from unmask.engine.llm import LLM
from unmask.engine.params import GenerationParams
from unmask.errors import InvalidRequestError
from unmask.train.calibrate import calibrate_model, replay, write_filter
from unmask.train.model_init import load_trainable
from unmask.train.objectives import Objective
from unmask.train.trajectories import TrajectoryConfig, generate, text_prompts


def test_fit_recovers_a_known_logistic_rule():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(20000, len(FEATURES), generator=g)
    true_w, true_b = torch.tensor([2.0, -1.0, 0.5, 0.0, 1.5]), -0.5
    y = torch.rand(20000, generator=g) < torch.sigmoid(x @ true_w + true_b)
    flt, stats = fit(x, y, l2=0.0)
    assert torch.allclose(torch.tensor(flt.weights), true_w, atol=0.1)
    assert flt.bias == pytest.approx(true_b, abs=0.1)
    assert stats["rows"] == 20000 and 0.0 < stats["log_loss"] < math.log(2)


def test_filter_json_round_trip_and_errors():
    flt = CommitFilter((1.0, 2.0, 3.0, 4.0, 5.0), -1.0)
    assert CommitFilter.from_json(flt.to_json()) == flt
    with pytest.raises(ValueError, match="must name the features"):
        CommitFilter.from_json({"weights": [1, 2], "bias": 0})
    with pytest.raises(ValueError, match="needs 5 weights"):
        CommitFilter((1.0,), 0.0)
    with pytest.raises(ValueError, match="finite"):
        CommitFilter((1.0, 2.0, 3.0, 4.0, float("nan")), 0.0)


def test_learned_policy_commits_what_the_filter_predicts_final():
    logits = torch.tensor([[4.0, 0.0, 0.0, 0.0], [0.0, 1.0, 0.9, 0.0], [0.0, 0.0, 0.0, 3.0]])
    offsets = torch.tensor([2, 3, 6])
    flt = CommitFilter((1.0, 0.0, 0.0, -2.0, 0.0), 1.0)  # confident and near the left end
    cfg = PolicyConfig(name="learned", threshold=0.8, commit_filter=flt)
    d = decide(cfg, logits, offsets, BlockState(initial_masked=6), SamplingParams())
    p = torch.softmax(logits, -1)
    top = p.max(-1).values
    logit = torch.log(top / (1 - top))
    want = torch.sigmoid(logit - 2.0 * torch.log1p((offsets - 2).float()) + 1.0) >= 0.8
    want[torch.sigmoid(logit - 2.0 * torch.log1p((offsets - 2).float()) + 1.0).argmax()] = True
    assert d.commit.tolist() == want.tolist() == [True, False, False]
    feats = features(top, p.topk(2).values[:, 0] - p.topk(2).values[:, 1], -(p * p.log()).sum(-1), offsets, 6)
    assert feats[:, 4].tolist() == [0.5, 0.5, 0.5]  # three of six masks left
    assert commit_rows(flt, feats, 0.8).tolist() == want.tolist()
    with pytest.raises(ValueError, match="unmask calibrate"):
        decide(PolicyConfig(name="learned"), logits, offsets, BlockState(initial_masked=6), SamplingParams())


def test_a_filter_on_confidence_alone_decodes_exactly_as_the_threshold_rule(tmp_path, base):
    model = tmp_path / "m"
    model.mkdir()
    for f in base.iterdir():
        (model / f.name).write_bytes(f.read_bytes())
    write_filter(model, CommitFilter((1.0, 0.0, 0.0, 0.0, 0.0), 0.0), {})  # p(final) = p(x0)
    llm = LLM(model, dtype="float32", device="cpu")
    prompts = [llm.encode(t) for t in ("def add(a, b):\n", "the cat", "the dog ate")]
    for tau in (0.3, 0.6, 0.9):
        a = llm.generate(prompts, GenerationParams(max_tokens=16, policy="threshold", threshold=tau))
        b = llm.generate(prompts, GenerationParams(max_tokens=16, policy="learned", threshold=tau))
        assert [o.token_ids for o in a] == [o.token_ids for o in b]
        assert [o.forwards for o in a] == [o.forwards for o in b]


def test_learned_without_a_filter_is_a_request_error(base):
    llm = LLM(base, dtype="float32", device="cpu")
    with pytest.raises(InvalidRequestError, match="needs a commit filter") as e:
        llm.generate("def", GenerationParams(max_tokens=4, policy="learned"))
    assert e.value.param == "policy"


def test_replay_reproduces_the_reference_decoders_states(base, corpus):
    """In every replayed state the row the reference committed next (its most confident one) is labelled final:
    the replay reads what the engine read, for every block and step."""
    llm = LLM(base, dtype="float32", device="cpu")
    import random
    cfg = TrajectoryConfig(prompts=6, max_tokens=12, context_chars=40, min_context_chars=8)
    prompts = text_prompts(corpus, llm.tokenizer, 6, cfg, random.Random(0))
    trajs, _ = generate(llm.engine, prompts, cfg.params())
    tm = load_trainable(base)
    obj = Objective(mask_id=tm.mask_id, block_sizes=(llm.spec.block_size,), shift=tm.family.shifted(tm.config),
                    causal_context=tm.family.causal_context(tm.config))
    rows = replay(tm.model, obj, trajs, llm.spec.block_size, tm.eos_id, batch=4)
    answer_tokens = sum(len(t.answer) for t in trajs)
    assert int((rows.step == 0).sum()) == answer_tokens  # state 0: every answer token of every block masked
    # a state's best row: the highest confidence among the rows seen in that state of that block
    conf = rows.feats[:, 0]
    starts = torch.nonzero(rows.feats[:, 3] == 0).flatten()  # distance 0: the first masked row of a block
    assert int(starts[0]) == 0
    groups = torch.cumsum(torch.zeros_like(conf, dtype=torch.long).index_fill_(0, starts, 1), 0)
    for g in groups.unique():
        sel = groups == g
        assert bool(rows.final[sel][conf[sel].argmax()])


def test_calibrate_cli_writes_the_filter_and_serves_it(tmp_path, base, corpus):
    model = tmp_path / "m"
    model.mkdir()
    for f in base.iterdir():
        (model / f.name).write_bytes(f.read_bytes())
    r = _cli("calibrate", "-m", model, "--text", corpus, "--prompts", 4, "--answer-tokens", 8, "--device", "cpu",
             "--json", tmp_path / "fit.json")
    assert r.exit_code == 0, r.output
    assert "learned, threshold 0.90: commits" in r.output
    gc = json.loads((model / "generation_config.json").read_text())
    flt = CommitFilter.from_json(gc["commit_filter"])
    assert json.loads((tmp_path / "fit.json").read_text())["filter"] == flt.to_json()
    out = LLM(model, dtype="float32", device="cpu").generate("the cat", GenerationParams(max_tokens=8, policy="learned"))
    assert len(out[0].token_ids) >= 1
    _one_line_error(_cli("calibrate", "-m", model), "--text, --chat or both")
