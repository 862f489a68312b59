"""The static step's inputs stay on the device between steps (engine/static_inputs.py): the step writes each row's
committed tokens, its remaining read rows and counters into its own input buffers, and the host stages only the
rows whose plan is not what the device left. Checked against a fresh host staging of every step's plans."""
import pytest
import torch

from test_static_step import FAMILIES, PROMPTS, checked_device_decisions, models  # noqa: F401 (fixture)
from unmask.engine.engine import Engine
from unmask.engine.params import GenerationParams
from unmask.engine.static_inputs import PADDING, columns, fill_rows
from unmask.engine.static_step import StaticStep


def watch_inputs(monkeypatch) -> list[int]:
    """After each step's staging, the device buffers must equal a fresh staging of every row from the host (padding
    rows' draw counters aside: they count steps nobody reads). Returns [rows compared, steps with a resident row]."""
    seen = [0, 0]
    real = StaticStep._stage

    def stage(self, key, shape, plans, rules):
        res = self.resident
        before = res.resident if res is not None else 0
        out = real(self, key, shape, plans, rules)
        if shape is None:
            return out
        rows, w, context, k, _ = key
        fresh = torch.empty_like(shape.stage)
        floats = torch.empty_like(shape.floats)
        pad = rows - len(plans)
        fill_rows(fresh, floats, w, k, context, plans + [None] * pad, rules + [PADDING] * pad, self.pool.scratch_pages)
        got = shape.inputs.clone()
        columns(got, w, k).counter[len(plans):] = 0
        columns(fresh, w, k).counter[len(plans):] = 0
        assert torch.equal(got, fresh), (key, (got != fresh).nonzero()[:8].tolist())
        assert torch.equal(shape.dfloats, floats)
        seen[0] += len(plans)
        seen[1] += res is not None and res.resident > before
        return out

    monkeypatch.setattr(StaticStep, "_stage", stage)
    return seen


def run(model, spec, prompts, params, static=True, resident=True, sticky_rows=0):
    eng = Engine(model, spec, max_num_seqs=16, static_step=static, kv_pool_tokens=4096)
    if static:
        eng.runner.static.sticky_rows = sticky_rows
        if not resident:
            eng.runner.static.resident = None
    params = params if isinstance(params, list) else [params] * len(prompts)
    seqs = [eng.add_request(p, q) for p, q in zip(prompts, params)]
    eng.run_to_completion()
    return [s.output_ids for s in seqs], eng


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("knobs", [dict(policy="threshold", threshold=0.3), dict(policy="topk", tokens_per_step=2)])
@pytest.mark.parametrize("sticky_rows", [0, 8])
def test_the_device_advances_the_inputs_the_host_would_stage(family, knobs, sticky_rows, models, monkeypatch):
    """Blocks of 8 (several steps inside a block): at every step the buffers equal a fresh staging of the plans,
    rows of the steps inside a block come from the device (with the width kept, sticky_rows, also the step
    after a block's first, whose segment the device moves past the block it wrote), and the tokens are the
    eager path's."""
    model, spec = models[family]
    params = GenerationParams(max_tokens=16, block_size=8, **knobs)
    eager, _ = run(model, spec, PROMPTS, params, static=False)
    made = checked_device_decisions(monkeypatch)
    seen = watch_inputs(monkeypatch)
    got, eng = run(model, spec, PROMPTS, params, sticky_rows=sticky_rows)
    assert got == eager and made[0] > 0
    res = eng.runner.static.resident
    assert seen[1] > 0 and res.resident > 0 and res.staged > 0, (seen, res.resident, res.staged)


def test_rows_the_host_decides_or_commits_otherwise_are_staged_again(models, monkeypatch):
    """In one batch: a greedy threshold request (advanced on the device), one under a rule the host runs over the
    device's proposal (factor), one sampling on the host (its logits copied out), one whose stops the host defers
    (ordered_stops: its commit can differ from the device's): every step's buffers still equal a fresh staging,
    and every request's tokens are the eager path's."""
    model, spec = models["sdar"]
    base = dict(max_tokens=14, block_size=8)
    params = [GenerationParams(policy="threshold", threshold=0.95, **base),  # one or two tokens a step
              GenerationParams(policy="factor", **base),
              GenerationParams(policy="threshold", threshold=0.95, temperature=0.9, seed=5, **base),
              GenerationParams(policy="topk", tokens_per_step=3, ordered_stops=True, **base)]
    eager, _ = run(model, spec, PROMPTS[:4], params, static=False)
    seen = watch_inputs(monkeypatch)
    got, eng = run(model, spec, PROMPTS[:4], params, sticky_rows=4)
    assert got == eager and seen[1] > 0
    rows = eng.runner.static.resident.rows
    assert rows == [] or all(r is None or r.rule.code != 0 for r in rows)  # host-decided rows are never resident


def test_resident_and_restaged_inputs_give_the_same_tokens(models):
    """The same requests with every row staged every step (resident off): the same tokens, more rows staged."""
    model, spec = models["unmask_shifted"]
    prompts = [[20 + i, 31, 40 + 2 * i] + list(range(50, 50 + i)) for i in range(6)]
    params = GenerationParams(max_tokens=20, policy="topk", tokens_per_step=2, block_size=8, ignore_eos=True)
    on, eng = run(model, spec, prompts, params)
    off, _ = run(model, spec, prompts, params, resident=False)
    res = eng.runner.static.resident
    assert on == off and res.resident > res.staged / 2, (res.resident, res.staged)


def test_small_batches_keep_the_wider_width_inside_a_block(models, monkeypatch):
    """sticky_rows (on a GPU: up to 4 rows) keeps a block's first-step width for the steps after it, so those steps
    replay one shape whose inputs the device advanced, the step right after a block's first included (its
    segment moved past the block it wrote): the host stages a row only at a block's first step. The same
    tokens, one width, fewer rows staged."""
    from unmask.engine.static_inputs import Resident

    model, spec = models["sdar"]
    params = GenerationParams(max_tokens=24, policy="topk", tokens_per_step=2, block_size=8, ignore_eos=True)
    seen = watch_inputs(monkeypatch)
    narrow, eng0 = run(model, spec, PROMPTS[:2], params)
    staged_at = []
    real = Resident.stale_rows

    def stale_rows(self, key, plans, rules):
        stale = real(self, key, plans, rules)
        staged_at.append(([i for i in stale if i < len(plans)], [i for i, p in enumerate(plans) if p.segment.write]))
        return stale

    monkeypatch.setattr(Resident, "stale_rows", stale_rows)
    wide, eng = run(model, spec, PROMPTS[:2], params, sticky_rows=4)
    assert wide == narrow and seen[1] > 0
    st, st0 = eng.runner.static, eng0.runner.static
    assert {k[1] for k in st.shapes} == {16} and {k[1] for k in st0.shapes} == {8, 16}
    assert all(stale == writes for stale, writes in staged_at[1:]), staged_at
    assert st.resident.staged < st0.resident.staged and st.resident.resident > st0.resident.resident
