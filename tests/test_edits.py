"""Decoding that revises committed tokens (issue 35): LLaDA2.1 edits and ReMDM-style remasking in the active block.

The pure rules on hand-made rows; the engine against an independent dense loop written from docs/decoding.md on
the tiny checkpoints; the request checks; and the default (no edit field) giving the tokens it gave before."""
import json

import httpx
import pytest
import torch

from naive_decode import naive_generate
from unmask.decoding import BlockState, decide
from unmask.decoding.edits import EditConfig, block_settled, edit_rows, own_token_probs, remask_rows
from unmask.decoding.sampling import propose
from unmask.engine.engine import Engine
from unmask.engine.params import GenerationParams
from unmask.errors import InvalidRequestError
from unmask.models.loader import load_model

NO_STOPS = torch.empty(0, dtype=torch.long)


# ------------------------------------------------------------------------------------------ the pure rules
def test_edit_rows_replace_only_differing_confident_editable_rows():
    current = torch.tensor([5, 6, 7, 8, 9])
    proposed = torch.tensor([5, 4, 4, 4, 4])
    probs = torch.tensor([0.99, 0.8, 0.5, 0.3, 0.9])
    editable = torch.tensor([True, True, True, True, False])
    got = edit_rows(current, proposed, probs, editable, 0.5, NO_STOPS)
    # row 0 agrees, row 2 is not strictly above 0.5, row 3 below, row 4 not editable (prompt / past a stop)
    assert got.tolist() == [False, True, False, False, False]
    assert edit_rows(current, proposed, probs, editable, 0.0, NO_STOPS).tolist() == [False, True, True, True, False]
    assert not edit_rows(current, proposed, probs, editable, None, NO_STOPS).any()  # edits off
    # an edit never writes a stop token
    assert not edit_rows(current, proposed, probs, editable, 0.0, torch.tensor([4])).any()


def test_remask_rows_take_the_least_likely_within_the_budget():
    own = torch.tensor([0.9, 0.1, 0.3, 0.05, 0.2])
    cand = torch.tensor([True, True, True, True, False])
    assert remask_rows(own, cand, 0.5, 2).tolist() == [False, True, False, True, False]
    assert remask_rows(own, cand, 0.5, 10).tolist() == [False, True, True, True, False]
    assert not remask_rows(own, cand, 0.5, 0).any()
    assert not remask_rows(own, cand, 0.04, 5).any()


def test_own_token_probs():
    logits = torch.tensor([[0.0, 0.0], [10.0, 0.0]])
    p = own_token_probs(logits, torch.tensor([1, 0]))
    assert torch.allclose(p, torch.tensor([0.5, 1 / (1 + torch.exp(torch.tensor(-10.0)))]))


@pytest.mark.parametrize("cfg, had, has, post, changed, settled", [
    (EditConfig(edit_threshold=0.5), True, True, 0, 3, False),    # masks left: never
    (EditConfig(edit_threshold=0.5), True, False, 0, 0, False),   # just filled: post-edit steps follow
    (EditConfig(edit_threshold=0.5, max_post_edit_steps=0), True, False, 0, 0, True),
    (EditConfig(remask_budget=2), True, False, 0, 0, True),       # remasking alone: full is final
    (EditConfig(edit_threshold=0.5), False, False, 1, 0, True),   # an edit-only step that changed nothing
    (EditConfig(edit_threshold=0.5), False, False, 3, 2, False),
    (EditConfig(edit_threshold=0.5, max_post_edit_steps=3), False, False, 3, 2, True),  # the last allowed
])
def test_block_settled(cfg, had, has, post, changed, settled):
    assert block_settled(cfg, had, has, post, changed) is settled


# ------------------------------------------------------------------------------------------ the engine, model-free
def drive_edits(params: GenerationParams, want, prompt_len: int = 4, block: int = 8, vocab: int = 16,
                shift: bool = False, after=None):
    """Decode with logits from `want(canvas) -> (tokens, logit)` over the output positions (mask id 0, stop 1);
    `shift`: a shifted family (its first token of a block committed by the block's first step, as the engine's
    shifted block-causal families are); `after(seq)` runs after each step."""
    from unmask.engine.sequence import ModelTraits, Sequence

    traits = ModelTraits(attention="block_causal", shift=shift, mask_id=0, block_size=block, stop_ids=(1,),
                         ar_first_token=shift, max_context=256)
    seq = Sequence([2 + i for i in range(prompt_len)], params, traits)
    targets, outs = [], []
    while seq.finish_reason is None:
        plan = seq.plan(4096)
        seq.after_forward(plan)
        targets.append(plan.targets.tolist())
        toks, score = want(seq.seq[seq.P:])
        idx = plan.targets - seq.P
        logits = torch.zeros(idx.numel(), vocab)
        logits[torch.arange(idx.numel()), torch.tensor(toks)[idx]] = torch.tensor(score)[idx]
        outs.append(seq.apply(plan, logits))
        if after is not None:
            after(seq)
        assert len(targets) < 100
    return seq, targets, outs


def first_guess_then_fix(canvas):
    """Output index i proposes 10 until index i + 1 is committed, then 11 (sure); a block's last index (3, 11 after
    a 4-token prompt in blocks of 8) always 12."""
    n = canvas.numel()
    toks = [12 if i % 8 == 3 else 11 if i + 1 < n and canvas[i + 1] != 0 else 10 for i in range(n)]
    return toks, [8.0] * n


def test_edits_fix_committed_tokens_and_stay_in_the_block():
    """Prompt of 4 in a block of 8: positions 0..3 are prompt and never targets; the block's 4 masks are all
    committed at once (10, 10, 10, 12), the next step edits the first three to 11, the one after changes nothing."""
    p = GenerationParams(max_tokens=12, threshold=0.9, edit_threshold=0.5, ignore_eos=True)
    seq, targets, outs = drive_edits(p, first_guess_then_fix)
    assert targets[0] == [4, 5, 6, 7] and targets[1] == [4, 5, 6, 7] and targets[2] == [4, 5, 6, 7]
    assert all(min(t) >= 4 for t in targets)
    assert outs[0] == [] and outs[1] == [] and outs[2] == [11, 11, 11, 12]  # nothing final before the block settles
    assert seq.output_ids[:4] == [11, 11, 11, 12] and seq.stats.edits == 3 + 7
    # the next block (positions 8..15) starts only after: its targets never include the first block
    assert all(min(t) >= 8 for t in targets[3:])


def test_without_edits_the_first_guess_stays():
    seq, targets, _ = drive_edits(GenerationParams(max_tokens=12, threshold=0.9, ignore_eos=True),
                                  first_guess_then_fix)
    assert seq.output_ids[:4] == [10, 10, 10, 12] and seq.stats.edits == 0 and targets[0] == [4, 5, 6, 7]


def test_post_edit_steps_are_bounded():
    """A canvas that flips index 0 between 10 and 11 on every read never settles by itself: max_post_edit_steps."""
    def flip(canvas):
        toks = [11 if canvas[0] == 10 else 10] + [12] * (canvas.numel() - 1)
        return toks, [8.0] * canvas.numel()

    for k in (0, 1, 3):
        p = GenerationParams(max_tokens=4, threshold=0.9, edit_threshold=0.5, max_post_edit_steps=k, ignore_eos=True)
        seq, targets, _ = drive_edits(p, flip)
        assert seq.stats.forwards == 1 + k and seq.stats.edits == k


def test_a_committed_stop_is_never_edited_and_ends_the_output():
    """A stop at index 2: index 0 before it is edited once the stop is in; the stop and index 3 after it are
    never read again, and the output ends at the stop."""
    def want(canvas):
        n = canvas.numel()
        toks = [11 if canvas[2] == 1 and canvas[0] != 0 else 10, 10, 1, 10][:n] + [10] * (n - 4)
        return toks, [8.0] * n

    p = GenerationParams(max_tokens=4, threshold=0.9, edit_threshold=0.5, ordered_stops=False)
    seq, targets, _ = drive_edits(p, want)
    assert seq.finish_reason == "stop" and seq.output_ids == [11, 10] and seq.stats.edits == 1
    # the first step commits all four (the stop at index 2 with them); after it only the positions before the stop
    assert targets[0] == [4, 5, 6, 7] and all(t == [4, 5] for t in targets[1:]) and len(targets) == 3


RIGHT = [4 + i % 10 for i in range(12)]  # the answer a sure model proposes (token ids 4..13; 0 mask, 1 stop)


@pytest.mark.parametrize("edit_threshold, fixed", [(0.9, True), (0.5, True), (None, False), (0.9995, False)])
def test_a_planted_wrong_token_is_corrected_by_a_sure_model(edit_threshold, fixed):
    """A model that proposes the right token everywhere with p 0.9993 (logit 10 against 15 others at 0); after the
    first step of each block a wrong token (15) is written over a committed position, once in a block that still
    has masks (output index 5: index 11 is unsure on its first read) and once in a full block (index 1, repaired by
    a post-edit step; without edits the full block is final at once, so only index 5 is planted). An edit threshold
    below the model's confidence puts the right token back; no edits, or a threshold above it, keeps the planted one."""
    from unmask.engine.sequence import ModelTraits, Sequence

    params = GenerationParams(max_tokens=12, threshold=0.9, edit_threshold=edit_threshold, ignore_eos=True)
    traits = ModelTraits(attention="block_causal", shift=False, mask_id=0, block_size=8, stop_ids=(1,),
                         ar_first_token=False, max_context=256)
    seq = Sequence([2, 3, 2, 3], params, traits)  # a 4-token prompt: output 0..3 end the first block, 4..11 the next
    reads, planted = {}, []
    while seq.finish_reason is None:
        plan = seq.plan(4096)
        seq.after_forward(plan)
        idx = (plan.targets - seq.P).tolist()
        logits = torch.zeros(len(idx), 16)
        for row, i in enumerate(idx):
            reads[i] = reads.get(i, 0) + 1
            logits[row, RIGHT[i]] = 1.0 if i == 11 and reads[i] == 1 else 10.0
        seq.apply(plan, logits)
        for i in (1, 5):  # plant once, right after the step that first committed position i
            if i not in planted and seq.seq[seq.P + i] == RIGHT[i] and seq.block_start <= seq.P + i:
                seq.seq[seq.P + i] = 15
                planted.append(i)
    # without edits a full block settles at once: only index 5 is planted while its block is open
    assert planted == ([1, 5] if edit_threshold is not None else [5])
    want = list(RIGHT)
    for i in planted if not fixed else ():
        want[i] = 15
    assert seq.output_ids == want
    assert seq.stats.edits == (2 if fixed else 0)


def test_remask_budget_is_respected():
    """Every committed token stays unsure (p 0.08 < 0.5), so each step would remask all it could: the budget of 3
    per block caps it."""
    unsure = lambda canvas: ([5] * canvas.numel(), [1.0] * canvas.numel())  # noqa: E731
    for budget in (1, 3):
        p = GenerationParams(max_tokens=12, threshold=0.9, remask_budget=budget, ignore_eos=True)
        seq, _, _ = drive_edits(p, unsure)
        assert seq.stats.remasks == 2 * budget and seq.output_ids == [5] * 12  # two blocks (4 + 8 positions)


def text_counts(seq, vocab: int = 16) -> list[float]:
    out = seq.seq[seq.P:seq.end]
    return torch.bincount(out[out != 0], minlength=vocab).float().tolist()


@pytest.mark.parametrize("kw, want", [
    (dict(edit_threshold=0.5, frequency_penalty=0.5, presence_penalty=0.5), first_guess_then_fix),
    (dict(remask_budget=3, repetition_penalty=1.5), lambda c: ([5] * c.numel(), [1.0] * c.numel())),
])
def test_penalties_count_only_the_tokens_in_the_text(kw, want):
    """After every step the penalties' counts are the histogram of the output tokens the canvas holds: an edit
    (10 -> 11) takes the 10 out and puts the 11 in, a remask takes its token out."""
    seen = []

    def check(seq):
        if seq.adjuster.counts is not None:
            assert seq.adjuster.counts.tolist() == text_counts(seq)
            seen.append(1)

    p = GenerationParams(max_tokens=12, threshold=0.9, ignore_eos=True, **kw)
    seq, _, _ = drive_edits(p, want, after=check)
    assert len(seen) == seq.stats.forwards and seq.stats.edits + seq.stats.remasks > 0


def sure_of_right(canvas, unsure_first_read={}):
    """Proposes RIGHT with logit 10 (p 0.9993); a block's last index (7, 15) with logit 1 on its first read, so the
    block is still open after its first step."""
    n = canvas.numel()
    toks, score = RIGHT[:n] + [4] * (n - len(RIGHT)), [10.0] * n
    for i in (7, 15):
        if i < n and canvas[i] == 0 and not unsure_first_read.setdefault(i, False):
            unsure_first_read[i], score[i] = True, 1.0
    return toks, score


@pytest.mark.parametrize("edit_threshold", [0.9, None])
def test_a_shifted_blocks_first_position_is_revised(edit_threshold):
    """A shifted family reads a block's first token from the row before the block, which later forwards do not
    compute: the engine keeps that row from the block's first forward, so a wrong token planted at the first
    position (output indices 0 and 8, after a prompt of one block) is put back by the edit rule, with no extra
    forward; without edits it stays."""
    planted = []

    def plant(seq):
        for i in (0, 8):
            if i not in planted and seq.seq[seq.P + i] == RIGHT[i] and seq.block_start == seq.P + i:
                seq.seq[seq.P + i] = 15
                planted.append(i)

    p = GenerationParams(max_tokens=16, threshold=0.9, edit_threshold=edit_threshold, ignore_eos=True)
    seq, targets, _ = drive_edits(p, lambda c: sure_of_right(c, {}), prompt_len=8, shift=True, after=plant)
    assert planted == [0, 8]
    want = RIGHT + [4] * 4
    if edit_threshold is None:
        want[0] = want[8] = 15
    assert seq.output_ids == want and seq.stats.edits == (2 if edit_threshold else 0)
    # the forwards after a block's first one start at the block, so the first position is none of their rows: the
    # edit reads the kept row (three forwards a block with edits: fill, fill + edit, an edit-only step that ends it)
    first, rest = list(range(8, 16)), list(range(9, 16))
    blocks = [first, rest, rest] if edit_threshold else [first, [15]]
    assert targets == blocks + [[t + 8 for t in b] for b in blocks]


def test_remasking_leaves_a_shifted_blocks_first_position():
    """Every token unsure (p 0.08 < 0.5) and a budget of the whole block: remasking takes any filled position but
    the block's first, whose row never sees the block (decoded again, it would read the same row)."""
    remasked = []
    unsure = lambda canvas: ([5] * canvas.numel(), [1.0] * canvas.numel())  # noqa: E731
    p = GenerationParams(max_tokens=16, threshold=0.9, remask_budget=8, ignore_eos=True)
    seq, _, _ = drive_edits(p, unsure, prompt_len=8, shift=True, after=lambda s: remasked.extend(s.edited))
    assert seq.output_ids == [5] * 16 and seq.stats.remasks == len(remasked) > 0
    assert 0 not in remasked and 8 not in remasked


# ------------------------------------------------------------------------------------------ the engine vs dense
def naive_edit_generate(model, spec, prompt, params: GenerationParams):
    """Dense decode with edits and remasking, from docs/decoding.md: every step recomputes the canvas up to the
    active block's end; the policy commits among the block's masks before the first committed stop token;
    filled non-prompt positions before that stop are replaced when the proposal differs with p above
    edit_threshold (never by a stop token), or, while the block has masks, put back to mask when their own
    token's p is below remask_threshold (least likely first, a budget per block; on a shifted block-causal
    family never the block's first position, whose row cannot see the block); after the block is full, edit-only
    steps until one changes nothing or max_post_edit_steps. The output ends at the first stop token. Presence and
    frequency penalties count the output tokens the canvas holds before the step (not those edited out)."""
    cfg = params.edit_config()
    adj = params.logit_adjust()
    mask, B = spec.mask_id, params.block_size or spec.block_size
    P, end = len(prompt), len(prompt) + params.max_tokens
    seq = torch.full((end,), mask)
    seq[:P] = torch.tensor(prompt)
    bidir = spec.family.attention == "bidirectional"
    start = P if bidir else (P // B) * B
    gen = torch.Generator().manual_seed(params.seed or 0)
    stops = set(params.stop_token_ids) | (set() if params.ignore_eos else set(spec.stop_ids))
    stop_t = torch.tensor(sorted(stops - {mask}), dtype=torch.long)
    ordered = spec.family.name == "unmask" if params.ordered_stops is None else params.ordered_stops
    while True:
        hi_blk = min(start + B, end)
        state = BlockState(initial_masked=int((seq[start:hi_blk] == mask).sum()))
        budget, post = cfg.remask_budget, 0
        while True:
            out = seq[P:hi_blk].tolist()
            cap = next((P + i for i, t in enumerate(out) if t in stops), hi_blk)
            masked = [i for i in range(start, cap) if seq[i] == mask]
            filled = [i for i in range(max(start, P), cap) if seq[i] != mask]
            L = end if bidir else hi_blk
            pos = torch.arange(L)
            m = None if bidir else ((pos[None, :] // B) <= (pos[:, None] // B))[None, None]
            if not masked and not filled:
                break
            with torch.no_grad():
                logits = model.logits(model.forward_dense(seq[None, :L], pos[None], m))[0].float()
            if adj.penalised:
                out_now = seq[P:end][seq[P:end] != mask]
                counts = torch.bincount(out_now, minlength=logits.shape[1]).float()
                logits -= adj.frequency_penalty * counts + adj.presence_penalty * (counts > 0).float()
            logits[:, mask] = float("-inf")
            had = bool(masked)
            if had:
                t = torch.tensor(masked)
                d = decide(params.policy_config(), logits[t - int(spec.shift)].clone(), t - start, state,
                           params.sampling(), gen)
                commit = d.commit.clone()
                if spec.ar_first_token and state.step == 1 and masked[0] == start:
                    commit[0] = True
                if ordered:
                    hole = masked[0]
                    for j, (pj, tok) in enumerate(zip(masked, d.tokens.tolist())):
                        if commit[j] and tok in stops and pj != hole:
                            commit[j] = False
                    if not commit.any():
                        commit[0] = True
            n_edit = 0
            if filled:
                f = torch.tensor(filled)
                fl = logits[f - int(spec.shift)]
                prop = propose(fl, params.sampling(), gen)
                cur = seq[f]
                rep = torch.zeros(len(filled), dtype=torch.bool)
                if cfg.edit_threshold is not None:
                    rep = (prop.tokens != cur) & (prop.probs > cfg.edit_threshold) & ~torch.isin(prop.tokens, stop_t)
                rem = torch.zeros_like(rep)
                if had and budget:
                    own = torch.softmax(fl, -1).gather(1, cur[:, None])[:, 0]
                    fixed_row = spec.shift and not bidir  # the block's first position reads the row before it
                    low = [(float(own[j]), j) for j in range(len(filled)) if not rep[j] and own[j] < cfg.remask_threshold
                           and not (fixed_row and filled[j] == start)]
                    for _, j in sorted(low)[:budget]:
                        rem[j] = True
                    budget -= int(rem.sum())
                n_edit = int(rep.sum())
            if had:
                seq[t[commit]] = d.tokens[commit]
            if filled:
                seq[f[rep]] = prop.tokens[rep]
                seq[f[rem]] = mask
            out = seq[P:hi_blk].tolist()
            cap = next((P + i for i, t in enumerate(out) if t in stops), hi_blk)
            if (seq[start:cap] == mask).any():
                continue
            if had:
                if cfg.edit_threshold is None or cfg.max_post_edit_steps == 0:
                    break
                continue
            post += 1
            if n_edit == 0 or post >= cfg.max_post_edit_steps:
                break
        out = seq[P:hi_blk].tolist()
        for i, t in enumerate(out):
            if t in stops:
                return out[:i]
        if hi_blk >= end:
            return out
        start = hi_blk


PROMPTS = [list(range(20, 33)), list(range(40, 45))]
EDIT_CASES = [dict(edit_threshold=0.1), dict(edit_threshold=0.0, max_post_edit_steps=2),
              dict(remask_budget=3, remask_threshold=0.6), dict(edit_threshold=0.2, remask_budget=2)]


def engine_matches_dense(model, spec, cases: list[dict]) -> list:
    """Both prompts under each case, in one engine, equal the dense loop's tokens; returns the engine's sequences."""
    out = []
    for kw in cases:
        p = GenerationParams(max_tokens=12, threshold=0.3, block_size=4, seed=0, ignore_eos=True, **kw)
        eng = Engine(model, spec, max_num_seqs=4)
        seqs = [eng.add_request(prompt, p) for prompt in PROMPTS]
        eng.run_to_completion()
        for prompt, s in zip(PROMPTS, seqs):
            assert s.output_ids == naive_edit_generate(model, spec, prompt, p), (kw, prompt)
        out += seqs
    return out


@pytest.mark.parametrize("family", ["sdar", "llada2", "llada", "dream", "fast_dllm_v2"])
def test_edits_match_the_dense_loop(family, family_dirs):
    seqs = engine_matches_dense(*load_model(family_dirs[family]), EDIT_CASES)
    assert sum(s.stats.edits + s.stats.remasks for s in seqs) > 0  # the random models' predictions move


@pytest.mark.parametrize("family", ["sdar", "fast_dllm_v2"])
def test_edits_under_penalties_match_the_dense_loop(family, family_dirs):
    """Frequency / presence penalties with edits and remasks: the dense loop counts the canvas's output tokens each
    step, so a token edited out or remasked stops counting (the engine counted every token ever written before)."""
    seqs = engine_matches_dense(*load_model(family_dirs[family]),
                                [dict(edit_threshold=0.0, max_post_edit_steps=2, frequency_penalty=2.0),
                                 dict(remask_budget=3, remask_threshold=0.6, presence_penalty=2.0)])
    # each case acted in both prompts: edits in the first two sequences, remasks in the last two
    assert all(s.stats.edits for s in seqs[:2]) and all(s.stats.remasks for s in seqs[2:])


@pytest.mark.parametrize("family", ["sdar", "llada"])
def test_edits_with_stop_tokens_match_the_dense_loop(family, family_dirs):
    model, spec = load_model(family_dirs[family])
    base = dict(max_tokens=12, threshold=0.3, block_size=4, seed=0, ordered_stops=False)
    eng = Engine(model, spec)
    free = eng.add_request(PROMPTS[0], GenerationParams(**base, ignore_eos=True, edit_threshold=0.1))
    eng.run_to_completion()
    for k in (2, 6):
        p = GenerationParams(**base, edit_threshold=0.1, stop_token_ids=[free.output_ids[k]])
        eng = Engine(model, spec)
        s = eng.add_request(PROMPTS[0], p)
        eng.run_to_completion()
        assert s.output_ids == naive_edit_generate(model, spec, PROMPTS[0], p)
        assert p.stop_token_ids[0] not in s.output_ids


@pytest.mark.parametrize("family", ["sdar", "llada", "dream"])
def test_the_default_gives_the_previous_tokens(family, family_dirs):
    """No edit field (or all null) is the decode of before: the engine equals the pre-existing dense loop."""
    model, spec = load_model(family_dirs[family])
    for extra in ({}, dict(edit_threshold=None, max_post_edit_steps=None, remask_budget=None, remask_threshold=None)):
        p = GenerationParams(max_tokens=12, threshold=0.3, block_size=4, seed=0, ignore_eos=True, **extra)
        eng = Engine(model, spec)
        s = eng.add_request(PROMPTS[0], p)
        eng.run_to_completion()
        assert s.output_ids == naive_generate(model, spec, PROMPTS[0], p)
        assert s.stats.edits == 0 and s.stats.remasks == 0


# ------------------------------------------------------------------------------------------ request checks
@pytest.mark.parametrize("kw, param", [
    (dict(edit_threshold=1.5), "edit_threshold"),
    (dict(edit_threshold=-0.1), "edit_threshold"),
    (dict(edit_threshold="0.5"), "edit_threshold"),
    (dict(edit_threshold=0.5, max_post_edit_steps=-1), "max_post_edit_steps"),
    (dict(edit_threshold=0.5, max_post_edit_steps=2.5), "max_post_edit_steps"),
    (dict(max_post_edit_steps=4), "max_post_edit_steps"),           # without edit_threshold
    (dict(remask_budget=-2), "remask_budget"),
    (dict(remask_budget=2, remask_threshold=0), "remask_threshold"),
    (dict(remask_threshold=0.5), "remask_threshold"),                # without a budget
    (dict(remask_budget=2, policy="low_confidence"), "remask_budget"),
    (dict(edit_threshold=0.5, multi_block_threshold=0.5), "edit_threshold"),
])
def test_bad_edit_requests_name_the_field(kw, param):
    with pytest.raises(InvalidRequestError) as e:
        GenerationParams(**kw)
    assert e.value.param == param, str(e.value)


def test_the_server_forwards_the_edit_fields():
    from unmask.server.protocol import ChatCompletionRequest, CompletionRequest

    fields = dict(edit_threshold=0.4, max_post_edit_steps=3, remask_budget=2, remask_threshold=0.3)
    chat = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], **fields)
    assert {k: chat.generation_kwargs()[k] for k in fields} == fields
    assert {k: CompletionRequest(prompt="hi", **fields).generation_kwargs()[k] for k in fields} == fields
    assert "edit_threshold" not in CompletionRequest(prompt="hi").generation_kwargs()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from test_server import Server, make_text_checkpoint

    root = tmp_path_factory.mktemp("edits")
    s = Server(make_text_checkpoint(root / "tiny-sdar"), root / "server.log")
    yield s.wait_ready()
    s.stop()


def test_http_edits_and_their_400s(server):
    body = {"model": "tiny-sdar", "prompt": "def f(x):", "max_tokens": 8, "temperature": 0}
    r = httpx.post(f"{server.url}/v1/completions", json={**body, "edit_threshold": 0.3}, timeout=60)
    assert r.status_code == 200, r.text
    r = httpx.post(f"{server.url}/v1/completions", json={**body, "edit_threshold": 2}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "edit_threshold"
    r = httpx.post(f"{server.url}/v1/completions", json={**body, "remask_budget": 1, "policy": "random"}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "remask_budget"
    # streamed with diffusing frames: they parse, and the text is the non-streamed text
    plain = httpx.post(f"{server.url}/v1/completions", json={**body, "edit_threshold": 0.0}, timeout=60).json()
    with httpx.stream("POST", f"{server.url}/v1/completions", timeout=60,
                      json={**body, "edit_threshold": 0.0, "stream": True, "diffusing": True}) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    text = "".join(c["choices"][0]["text"] for c in chunks if c.get("choices"))
    assert text == plain["choices"][0]["text"] and any("diffusing" in c for c in chunks)
