"""How many masked tokens a step may commit: the fixed schedules of LLaDA and Dream.

Pure integer/float helpers; the policies in `policies.py` turn them into per-step quotas.
"""

from __future__ import annotations

import torch


def even_split(total: int, steps: int) -> list[int]:
    """Split `total` commits over `steps` steps: base = total // steps, the first total % steps steps get one more.

    Source: ML-GSAI/LLaDA generate.py `get_num_transfer_tokens`.
    """
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    if total < 0:
        raise ValueError(f"total must be >= 0, got {total}")
    base, extra = divmod(total, steps)
    return [base + 1 if i < extra else base for i in range(steps)]


def even_split_at(total: int, steps: int, step: int) -> int:
    """`even_split(total, steps)[step]` without building the list; 0 past the end."""
    if step >= steps:
        return 0
    base, extra = divmod(total, steps)
    return base + 1 if step < extra else base


def _dream_times(step: int, steps: int, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    # Dream builds linspace(1, eps, steps + 1) in float32 and truncates a float32 product with int();
    # computing the same way keeps our counts identical to theirs at the rounding edges.
    ts = torch.linspace(1.0, eps, steps + 1, dtype=torch.float32)
    return ts[step], ts[step + 1]


def dream_reveal_prob(step: int, steps: int, eps: float = 1e-3) -> float:
    """Fraction of the still-masked tokens that step `step` (0-based) should reveal: 1 - s/t; 1.0 on the last step.

    Source: DreamLM/Dream generation_utils `_sample` (timesteps = linspace(1, eps, steps + 1)).
    """
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    if step >= steps - 1:
        return 1.0
    t, s = _dream_times(step, steps, eps)
    return float(1 - s / t)


def dream_count(num_masked: int, step: int, steps: int, eps: float = 1e-3) -> int:
    """Dream's count for 0-based `step` of `steps`: int(num_masked * (1 - s/t)); the last step (or later) takes all.

    May be 0 on early steps with few masks; the policies clamp it to at least one.
    Source: DreamLM/Dream generation_utils `_sample`.
    """
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    if step >= steps - 1:
        return num_masked
    t, s = _dream_times(step, steps, eps)
    return int(torch.tensor(float(num_masked), dtype=torch.float32) * (1 - s / t))
