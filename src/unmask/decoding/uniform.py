"""Uniform-noise block diffusion (DiffusionGemma): pure tensor functions for one denoising step.

The canvas starts as uniform random tokens (no mask token). Each step (transformers'
DiffusionGemmaGenerationMixin._denoising_step, EntropyBoundSampler, LinearTemperatureScheduleLogitsProcessor,
StableAndConfidentStoppingCriteria):
  1. processed = logits / T with T = t_min + (t_max - t_min) * remaining / max_steps (remaining = N..1);
  2. sampled = one multinomial draw per position from softmax(processed); draft = argmax(processed);
  3. entropy-bound acceptance: sort positions by entropy ascending, accept the longest prefix whose
     sum of entropies minus its largest entropy is <= entropy_bound (arXiv 2505.24857); accepted positions
     take the sampled token, the others keep the current canvas ...
  4. ... and are then re-noised with fresh uniform tokens (nothing is frozen between steps);
  5. stop when the draft equals the drafts of the previous `stability_threshold` steps and the mean entropy
     is below `confidence_threshold`; a canvas also ends after `max_steps` steps. Its result is the draft.

Random draws, in this order per step and from one generator: the multinomial over [rows, V], then
randint for the re-noise (also on the step that stops). A canvas starts with one randint.
Arithmetic mirrors the reference op for op (float32 temperature, Categorical's entropy), so the same
generator state gives the same tokens.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

# transformers DiffusionGemmaGenerationConfig._get_default_generation_params
DEFAULTS = {"max_steps": 48, "entropy_bound": 0.1, "t_min": 0.4, "t_max": 0.8,
            "stability_threshold": 1, "confidence_threshold": 0.005}


# "reference" reproduces the reference's random stream (multinomial over every position, uniform noise over
# every position); "lean" draws one uniform and one noise id per position and samples by inverting the CDF:
# the same distribution over outputs, a different stream, and no [C, V] exponential draw per step (torch's
# multinomial races V exponentials per row: ~220 us for [16, 512] on one CPU core against ~13 us here).
DRAWS = ("reference", "lean")


@dataclass(frozen=True)
class UniformConfig:
    max_steps: int = 48            # denoising steps per canvas at most
    entropy_bound: float = 0.1     # gamma of the acceptance rule, nats, > 0
    t_min: float = 0.4             # temperature at the last step (approached), >= 0
    t_max: float = 0.8             # temperature at the first step, > t_min
    stability_threshold: int = 1   # steps the draft must stay unchanged (0: stability always holds)
    confidence_threshold: float = 0.005  # mean entropy below which the canvas is confident, > 0
    draws: str = "reference"       # "reference": every draw the reference makes; "lean": only the used ones

    def __post_init__(self) -> None:
        def check(ok: bool, name: str, rule: str) -> None:
            if not ok:
                raise ValueError(f"{name} must be {rule}, got {getattr(self, name)!r}")

        check(isinstance(self.max_steps, int) and self.max_steps >= 1, "max_steps", "an integer >= 1")
        check(self.entropy_bound > 0, "entropy_bound", "> 0")
        check(self.t_min >= 0, "t_min", ">= 0")
        check(self.t_max > self.t_min, "t_max", f"> t_min ({self.t_min})")
        check(isinstance(self.stability_threshold, int) and self.stability_threshold >= 0,
              "stability_threshold", "an integer >= 0")
        check(self.confidence_threshold > 0, "confidence_threshold", "> 0")
        check(self.draws in DRAWS, "draws", f"one of {', '.join(DRAWS)}")


def linear_temperature(remaining: int, max_steps: int, t_min: float, t_max: float,
                       device: torch.device | str = "cpu") -> Tensor:
    """0-dim float32 T = t_min + (t_max - t_min) * remaining / max_steps; `remaining` counts N..1.

    Computed on an int32 tensor as the reference does (its step counter is a tensor), so T is bitwise its T.
    Filled on the device, not copied there: a blocking host-to-device copy would wait for the forward.
    """
    step = torch.full((), remaining, dtype=torch.int32, device=device)
    return t_min + ((t_max - t_min) * (step / max_steps))


def categorical_entropy(logits: Tensor) -> Tensor:
    """Entropy over the last dim, as torch.distributions.Categorical(logits=...).entropy() computes it."""
    norm = logits - logits.logsumexp(dim=-1, keepdim=True)
    probs = torch.softmax(norm, dim=-1)
    return -(torch.clamp(norm, min=torch.finfo(norm.dtype).min) * probs).sum(-1)


def entropy_bound_mask(entropy: Tensor, bound: float) -> Tensor:
    """Bool mask over the last dim: the lowest-entropy positions with sum(H) - max(H) <= bound.

    Sorted ascending, the max of the first k is H_k, so the test is cumsum_k - H_k <= bound (monotone in k;
    the lowest-entropy position always passes when bound >= 0). Ties keep torch.sort's order.
    """
    h, order = torch.sort(entropy, dim=-1, descending=False)
    keep = torch.cumsum(h, dim=-1) - h <= bound
    return torch.scatter(torch.zeros_like(keep), -1, order, keep)


def uniform_tokens(shape: tuple[int, ...], vocab_size: int, generator: torch.Generator | None,
                   device: torch.device | str) -> Tensor:
    """Uniform random token ids over the whole vocabulary (a fresh canvas, or the re-noise).

    Drawn on the generator's device (then moved) so a generator's stream never depends on where the result goes.
    """
    src = generator.device if generator is not None else device
    return torch.randint(0, vocab_size, shape, generator=generator, device=src).to(device)


def renoise(canvas: Tensor, keep: Tensor, vocab_size: int, generator: torch.Generator | None) -> Tensor:
    """Positions not in `keep` get fresh uniform tokens (drawn for every position, as the reference does)."""
    noise = uniform_tokens(tuple(canvas.shape), vocab_size, generator, canvas.device)
    return torch.where(~keep, noise, canvas)


def stable_and_confident(history: Tensor | None, draft: Tensor, entropy: Tensor, stability_threshold: int,
                         confidence_threshold: float) -> tuple[Tensor, Tensor | None]:
    """(stop [B] bool, new history) for drafts [B, C] and entropies [B, C].

    history [S, B, C] holds the previous S = stability_threshold drafts (-1 before they exist).
    """
    if stability_threshold == 0:
        stable = torch.ones(draft.shape[0], dtype=torch.bool, device=draft.device)
    else:
        if history is None:
            history = torch.full((stability_threshold, *draft.shape), -1, dtype=draft.dtype, device=draft.device)
        stable = (history == draft[None]).all(dim=-1).all(dim=0)
        history = torch.roll(history, shifts=-1, dims=0)
        history[-1] = draft
    confident = torch.mean(entropy, dim=-1) < confidence_threshold
    return stable & confident, history


@dataclass
class StepResult:
    canvas: Tensor      # [B, C] long: next canvas (accepted samples + re-noise)
    draft: Tensor       # [B, C] long: argmax of the processed logits (the canvas's answer)
    processed: Tensor   # [B, C, V] float32: temperature-scaled logits (next step's self-conditioning)
    entropy: Tensor     # [B, C] float32
    accepted: Tensor    # [B, C] bool
    stop: Tensor        # [B] bool: stable and confident
    history: Tensor | None


def _probs_and_entropy(processed: Tensor, lean: bool) -> tuple[Tensor, Tensor]:
    """(sampling distribution, entropy) of the processed logits over the last dim."""
    if not lean:  # two separate passes, exactly as the reference computes them
        return torch.softmax(processed, dim=-1, dtype=torch.float32), categorical_entropy(processed)
    logp = torch.log_softmax(processed, dim=-1)
    probs = logp.exp()
    return probs, -(torch.clamp(logp, min=torch.finfo(logp.dtype).min) * probs).sum(-1)


def _reference_row(probs: Tensor, canvas: Tensor, accepted: Tensor, vocab: int,
                   generator: torch.Generator | None) -> Tensor:
    """One request's next canvas [C] in the reference's draw order: multinomial over every position, then
    uniform noise over every position."""
    dev = probs.device
    src = probs if generator is None or generator.device == dev else probs.to(generator.device)
    sampled = torch.multinomial(src, num_samples=1, generator=generator).to(dev)[:, 0]
    kept = torch.where(accepted, sampled, canvas)
    noise = uniform_tokens((1, canvas.numel()), vocab, generator, dev)[0]
    return torch.where(~accepted, noise, kept)


def lean_next(probs: Tensor, accepted: Tensor, vocab: int, generators: list[torch.Generator | None]) -> Tensor:
    """Next canvases [B, C] for probs [B, C, V]: accepted positions sample their distribution, the others get
    uniform noise. Each row draws C uniforms then C noise ids from its own generator; the sampling itself
    (inverse CDF: the first token whose cumulative probability exceeds u * total) is one batched pass."""
    b, c, _ = probs.shape
    dev = probs.device
    us, noises = [], []
    for g in generators:  # drawn where each generator lives and kept on the device (no round trip to the host)
        src = g.device if g is not None else dev
        us.append(torch.rand(c, generator=g, device=src).to(dev, non_blocking=True))
        noises.append(torch.randint(0, vocab, (c,), generator=g, device=src).to(dev, non_blocking=True))
    u, noise = torch.stack(us), torch.stack(noises)
    cdf = probs.float().cumsum(dim=-1)
    # u < 1, so u * total < cdf[-1] and the index stays in range; a zero-probability token is never chosen
    target = (u * cdf[..., -1])[..., None]
    sampled = torch.searchsorted(cdf, target, right=True)[..., 0]
    return torch.where(accepted, sampled, noise)


def denoise_step(logits: Tensor, canvas: Tensor, remaining: int, cfg: UniformConfig, history: Tensor | None,
                 generator: torch.Generator | None) -> StepResult:
    """One step for a [B, C, V] block of logits; with draws="reference", the reference's draws in its order
    (one multinomial over all B*C rows, then one randint [B, C])."""
    b, c, v = logits.shape
    lean = cfg.draws == "lean"
    temp = linear_temperature(remaining, cfg.max_steps, cfg.t_min, cfg.t_max, logits.device)
    processed = logits / temp
    probs, entropy = _probs_and_entropy(processed, lean)
    draft = torch.argmax(processed, dim=-1)
    if lean:
        accepted = entropy_bound_mask(entropy, cfg.entropy_bound)
        nxt = lean_next(probs, accepted, v, [generator] * b)
    else:
        src = probs.view(-1, v)
        if generator is not None and generator.device != probs.device:
            src = src.to(generator.device)
        sampled = torch.multinomial(src, num_samples=1, generator=generator).to(probs.device).view(b, c)
        accepted = entropy_bound_mask(entropy, cfg.entropy_bound)
        nxt = renoise(torch.where(accepted, sampled, canvas), accepted, v, generator)
    stop, history = stable_and_confident(history, draft, entropy, cfg.stability_threshold, cfg.confidence_threshold)
    return StepResult(nxt, draft, processed, entropy, accepted, stop, history)


def denoise_batch(logits: Tensor, canvas: Tensor, remaining: list[int], cfgs: list[UniformConfig],
                  histories: list[Tensor | None], generators: list[torch.Generator | None]) -> list[StepResult]:
    """`denoise_step` for B independent requests at once (logits [B, C, V], canvas [B, C]).

    Every row computes exactly what `denoise_step` computes for it alone (row-wise ops, per-row temperature,
    bound and thresholds as float32 like the reference's scalars); each request draws from its own generator,
    in its own order, so rows never share randomness. All rows must use the same `draws` mode.
    Returns one [1, C]-shaped result per row.
    """
    b, c, v = logits.shape
    if b == 1:
        return [denoise_step(logits, canvas, remaining[0], cfgs[0], histories[0], generators[0])]
    lean = cfgs[0].draws == "lean"
    if any((g.draws == "lean") != lean for g in cfgs):
        raise ValueError("denoise_batch: rows mix draws modes")
    dev = logits.device
    f32 = torch.float32

    def rows(values: list, dtype: torch.dtype) -> Tensor:
        # built on the host and sent without blocking: a blocking copy would wait for the forward to finish
        return torch.tensor(values, dtype=dtype).to(dev, non_blocking=True)

    step = rows(remaining, torch.int32)
    steps = rows([g.max_steps for g in cfgs], torch.int32)
    span = rows([g.t_max - g.t_min for g in cfgs], f32)
    t_min = rows([g.t_min for g in cfgs], f32)
    temp = t_min + span * (step / steps)
    processed = logits / temp[:, None, None]
    probs, entropy = _probs_and_entropy(processed, lean)
    draft = torch.argmax(processed, dim=-1)
    h, order = torch.sort(entropy, dim=-1, descending=False)
    bound = rows([g.entropy_bound for g in cfgs], f32)
    keep = torch.cumsum(h, dim=-1) - h <= bound[:, None]
    accepted = torch.scatter(torch.zeros_like(keep), -1, order, keep)
    if lean:
        nxt = lean_next(probs, accepted, v, generators)
    else:
        nxt = torch.stack([_reference_row(probs[i], canvas[i], accepted[i], v, g) for i, g in enumerate(generators)])
    conf = rows([g.confidence_threshold for g in cfgs], f32)
    confident = torch.mean(entropy, dim=-1) < conf
    stable, new_hist = _stability_batch(draft, histories, [g.stability_threshold for g in cfgs])
    stop = (stable & confident).tolist()
    return [StepResult(nxt[i:i + 1], draft[i:i + 1], processed[i:i + 1], entropy[i:i + 1], accepted[i:i + 1],
                       torch.tensor([stop[i]]), new_hist[i]) for i in range(b)]


def _stability_batch(draft: Tensor, histories: list[Tensor | None],
                     thresholds: list[int]) -> tuple[Tensor, list[Tensor | None]]:
    """Row-wise `stable_and_confident` stability part; rows with the same threshold share one comparison."""
    b = draft.shape[0]
    stable = torch.ones(b, dtype=torch.bool, device=draft.device)
    new: list[Tensor | None] = [None] * b
    for s in sorted(set(thresholds)):
        rows = [i for i in range(b) if thresholds[i] == s]
        if s == 0:
            continue
        hist = torch.cat([histories[i] if histories[i] is not None else
                          torch.full((s, 1, draft.shape[1]), -1, dtype=draft.dtype, device=draft.device)
                          for i in rows], dim=1)
        if len(rows) == b:  # the usual case: no index tensor (a list index is a blocking copy to a GPU)
            d = draft
            stable = (hist == d[None]).all(dim=-1).all(dim=0)
        else:
            index = torch.tensor(rows).to(draft.device, non_blocking=True)
            d = draft[index]
            stable[index] = (hist == d[None]).all(dim=-1).all(dim=0)
        hist = torch.roll(hist, shifts=-1, dims=0)
        hist[-1] = d
        for j, i in enumerate(rows):
            new[i] = hist[:, j:j + 1]
    return stable, new
