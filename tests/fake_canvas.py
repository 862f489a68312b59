"""Drives a Sequence through plan / after_forward / apply without a model: each output position has a fixed token
and a score (fixed, or a function of what is committed), so every decision of a policy is known in advance and
counts are exact."""
from typing import Callable

import torch
from torch import Tensor

from unmask.engine.params import GenerationParams
from unmask.engine.sequence import ModelTraits, Sequence

MASK, STOP, VOCAB = 0, 1, 32
RUNNER_UP = 3  # every row's second choice (logit 0.5), so a row whose token is banned proposes a known one
SURE = 10.0    # the wanted token's logit: p = 0.9986 against the runner-up and 29 others at 0 (never the mask)
UNSURE = 1.0   # p = 0.081: under any threshold used here; larger logits rank first


def traits(block_size: int = 8, causal_context: bool = False) -> ModelTraits:
    return ModelTraits(attention="block_causal", shift=False, mask_id=MASK, block_size=block_size,
                       stop_ids=(STOP,), ar_first_token=False, max_context=256, causal_context=causal_context)


Scores = list[float] | Callable[[Tensor], list[float]]  # or from the output canvas so far ([max_tokens], masks in)


def drive(params: GenerationParams, tokens: list[int], scores: Scores, prompt_len: int = 8, block_size: int = 8,
          causal_context: bool = False, plans: list | None = None) -> tuple[Sequence, list[list[int]]]:
    """Decode until finished; output index i proposes tokens[i] with logit scores[i].

    Returns the sequence and, per forward, the output indices it committed; `plans` collects the step plans."""
    seq = Sequence([2 + i % 20 for i in range(prompt_len)], params, traits(block_size, causal_context))
    want = torch.tensor(tokens)
    committed = []
    while seq.finish_reason is None:
        plan = seq.plan(4096)
        seq.after_forward(plan)
        if plans is not None:
            plans.append(plan)
        score = torch.tensor(scores(seq.seq[seq.P:]) if callable(scores) else scores)
        index = plan.targets - seq.P
        logits = torch.zeros(index.numel(), VOCAB)
        logits[:, RUNNER_UP] = 0.5
        logits[torch.arange(index.numel()), want[index]] = score[index]
        before = seq.seq.clone()
        seq.apply(plan, logits)
        committed.append(((seq.seq != before).nonzero().flatten() - seq.P).tolist())
    return seq, committed
