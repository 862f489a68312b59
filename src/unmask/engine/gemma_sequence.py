"""One DiffusionGemma request: canvases of uniform noise denoised against an encoder KV cache.

Per canvas (transformers DiffusionGemmaGenerationMixin.generate, batch 1):
  encoder pass over the unprocessed tokens (the prompt, then each accepted canvas) -> writes the cache;
  canvas <- uniform random tokens; then up to N denoising steps (decoder pass, self-conditioned on the
  previous step's processed logits; decoding/uniform.py); the canvas ends when stable and confident or
  after N steps, and its *draft* (argmax) is appended. Stop on a stop token anywhere in the canvas, or when
  ceil(max_tokens / C) canvases are done; the output is cut at max_tokens.

Each step is one plan with one segment: [encoder tokens still to cache ; canvas]. The encoder tokens are
causal and written (Segment.write), the canvas is a decoder pass that sees them, so accepting a canvas and
the first denoising step of the next one share a forward. A prompt longer than the step's token budget is
first encoded alone, in chunks.

Randomness: one generator per request (seeded by `seed`), on the model's device, drawn in the reference's
order: randint [1, C] per canvas, then per step multinomial [C, V] and randint [1, C]. With
`torch.manual_seed(s)` before the reference's `generate` and `seed=s` here, a batch-1 run draws the same
numbers. A request's draws never depend on other requests (see docs/diffusion-gemma.md for batches).

Structured output (a grammar constraint: JSON schema, regex, choice, tool calls): the canvas gains a *fixed
prefix*. Each step the first unfixed position is decoded under the grammar's token mask, and its draft plus
the run of entropy-accepted drafts after it are verified left to right by the matcher
(structured/constraint.py) and fixed: they are pinned in the canvas (one-hot logits: never re-noised, zero
entropy, peaked self-conditioning). When the stop rule fires or the steps run out, the rest of the canvas
is filled from the drafts the same way (a refused draft is replaced by the best allowed token). So a
confident canvas still lands in one step, and every token reaches the matcher in order.
"""
from __future__ import annotations

import math
import os

import torch
from torch import Tensor

from unmask.decoding.logit_adjust import Adjuster, ban_early_stops
from unmask.decoding.sampling import SamplingParams
from unmask.decoding.uniform import DEFAULTS, StepResult, UniformConfig, denoise_batch, denoise_step, uniform_tokens
from unmask.engine.params import GenerationParams
from unmask.engine.sequence import ModelTraits, Stats, Status, StepPlan, _ids, new_top_store
from unmask.errors import InvalidRequestError
from unmask.models.attention import Segment


def _config_defaults(gen: dict) -> dict:
    """The checkpoint's generation_config.json overrides of the reference's global defaults."""
    out = dict(DEFAULTS)
    if gen.get("max_denoising_steps"):
        out["max_steps"] = int(gen["max_denoising_steps"])
    sampler = gen.get("sampler_config")
    if isinstance(sampler, dict) and sampler.get("entropy_bound") is not None:
        out["entropy_bound"] = float(sampler["entropy_bound"])
    for key in ("t_min", "t_max", "confidence_threshold"):
        if gen.get(key) is not None:
            out[key] = float(gen[key])
    if gen.get("stability_threshold") is not None:
        out["stability_threshold"] = int(gen["stability_threshold"])
    return out


def uniform_config(params: GenerationParams, generation_config: dict) -> UniformConfig:
    d = _config_defaults(generation_config)
    chosen = {
        "max_steps": params.steps if params.steps is not None else d["max_steps"],
        "entropy_bound": params.entropy_bound if params.entropy_bound is not None else d["entropy_bound"],
        "t_min": params.t_min if params.t_min is not None else d["t_min"],
        "t_max": params.t_max if params.t_max is not None else d["t_max"],
        "stability_threshold": (params.stability_threshold if params.stability_threshold is not None
                                else d["stability_threshold"]),
        "confidence_threshold": (params.confidence_threshold if params.confidence_threshold is not None
                                 else d["confidence_threshold"]),
        "draws": params.uniform_draws,
    }
    try:
        return UniformConfig(**chosen)
    except ValueError as e:
        name = str(e).split(" ", 1)[0]
        raise InvalidRequestError(str(e), "steps" if name == "max_steps" else name) from None


_GREEDY = SamplingParams()  # a refused draft is replaced by the best allowed token (the draft is an argmax)


class GemmaSequence:
    """Same interface as engine.sequence.Sequence (what Engine, Scheduler and the server read)."""

    bidirectional = False
    cache_mode = "exact"
    supports_constraints = True

    def __init__(self, prompt_ids: list[int], params: GenerationParams, traits: ModelTraits):
        self.prompt_ids, self.params, self.traits = prompt_ids, params, traits
        self.request_id = f"req-{next(_ids)}"
        self.status = Status.WAITING
        self.finish_reason: str | None = None
        self.stats = Stats()
        self.cache = None
        self.constraint = None   # unmask.structured.Constraint, set by the engine for structured requests
        if params.top_k or params.top_p < 1:
            raise InvalidRequestError("top_k / top_p do not apply to DiffusionGemma: its sampler draws from the "
                                      "full distribution at the scheduled temperature (t_min..t_max)",
                                      "top_k" if params.top_k else "top_p")
        images = set(_image_ids(traits.config)) & set(prompt_ids)
        if images:
            raise InvalidRequestError(f"DiffusionGemma image input is not supported (prompt holds image token(s) "
                                      f"{sorted(images)}): unmask serves the text path only", "prompt")
        self.cfg = uniform_config(params, traits.generation_config)
        self.vocab = int(traits.config.get("text_config", {}).get("vocab_size") or 0) or None
        self.P = len(prompt_ids)
        self.B = self.C = params.block_size or traits.block_size
        self.limit = self.P + params.max_tokens                      # output is cut here
        self.num_canvases = math.ceil(params.max_tokens / self.C)   # the reference runs whole canvases
        self.tokens = torch.zeros(self.P + self.num_canvases * self.C, dtype=torch.long)
        self.tokens[: self.P] = torch.tensor(prompt_ids, dtype=torch.long)
        self.stops = set(params.stop_token_ids) | (set() if params.ignore_eos else set(traits.stop_ids))
        self.seed = params.seed if params.seed is not None else int.from_bytes(os.urandom(8), "little") >> 2
        self.generator: torch.Generator | None = None
        self.block_start = self.P     # first position of the active canvas
        self.cached = 0               # positions whose encoder K/V are in the cache
        self.final_end = self.P
        self.logprobs = torch.zeros(params.max_tokens) if params.logprobs else None
        self.top = new_top_store(params)
        self.canvases_done = 0
        adjust = params.logit_adjust()   # applied to every step's logits; counts grow by finished canvases
        self.adjuster = Adjuster(adjust, prompt_ids) if adjust.active else None
        self._prepared: StepResult | None = None  # this step's result when computed batched (prepare_batch)
        self._reset_canvas()

    def _reset_canvas(self) -> None:
        self.canvas: Tensor | None = None      # [1, C] on the model's device
        self.draft: Tensor | None = None       # [1, C] argmax of the last step
        self.sc_logits: Tensor | None = None   # [1, C, V] processed logits of the last step
        self.history: Tensor | None = None
        self.remaining = self.cfg.max_steps
        self.fixed: list[int] = []             # constrained decoding: the canvas's verified prefix

    # ------------------------------------------------------------------ planning
    def _device(self) -> torch.device:
        return self.cache.device if self.cache is not None else torch.device("cpu")

    def _new_canvas(self) -> None:
        dev = self._device()
        if self.generator is None:
            self.generator = torch.Generator(device=dev).manual_seed(self.seed)
        if self.vocab is None:
            raise InvalidRequestError("config.json lacks text_config.vocab_size", "model")
        self.canvas = uniform_tokens((1, self.C), self.vocab, self.generator, dev)

    def plan(self, token_budget: int) -> StepPlan:
        pending = self.block_start - self.cached
        if pending > token_budget:  # long prompt: encoder-only chunks first
            n = max(1, token_budget)
            return self._plan(self.tokens[self.cached:self.cached + n], n, None)
        if self.canvas is None:
            self._new_canvas()
        # a canvas-only step keeps the canvas on its device (no copy to the host and back each step)
        ids = self.canvas[0] if pending == 0 else torch.cat([self.tokens[self.cached:self.block_start],
                                                              self.canvas[0].cpu()])
        return self._plan(ids, pending, self.sc_logits)

    def _plan(self, ids: Tensor, n_enc: int, sc_logits: Tensor | None) -> StepPlan:
        lo, n = self.cached, ids.numel()
        positions = torch.arange(lo, lo + n)
        extra = {"encoder": n_enc, "sc_logits": sc_logits}
        segment = Segment(start=lo, length=n, write=n_enc, cache=self.cache, extra=extra)
        rows = torch.arange(n_enc, n)
        return StepPlan(self, ids, positions, segment, rows, rows + lo)

    # ------------------------------------------------------------------ applying results
    def after_forward(self, plan: StepPlan) -> None:
        self.stats.forwards += 1
        seg = plan.segment
        if seg.write:
            self.stats.prefill_tokens += max(0, min(seg.start + seg.write, self.P) - seg.start)
            self.cached = seg.start + seg.write

    @staticmethod
    def prepare_batch(plans: list[StepPlan], logits: list[Tensor]) -> None:
        """Engine hook, before the per-request `apply` calls of a step: run the denoising step of every
        request in one batched computation (requests with the same canvas length and device)."""
        groups: dict[tuple, list[tuple[GemmaSequence, Tensor]]] = {}
        for plan, lg in zip(plans, logits):
            seq = plan.seq
            if isinstance(seq, GemmaSequence) and plan.targets.numel() and seq.constraint is None:
                groups.setdefault((seq.C, lg.device, seq.cfg.draws), []).append((seq, lg))
        for members in groups.values():
            if len(members) < 2:
                continue
            seqs = [s for s, _ in members]
            for s, lg in members:
                s._adjust(lg.view(s.C, -1))
            results = denoise_batch(torch.stack([lg.view(s.C, -1) for s, lg in members]),
                                    torch.cat([s.canvas for s in seqs]), [s.remaining for s in seqs],
                                    [s.cfg for s in seqs], [s.history for s in seqs], [s.generator for s in seqs])
            for s, r in zip(seqs, results):
                s._prepared = r

    def apply(self, plan: StepPlan, logits: Tensor) -> list[int]:
        """One denoising step; returns the newly final tokens (a whole canvas when it ends)."""
        if plan.targets.numel() == 0:
            return []
        if self.constraint is not None:
            return self._apply_constrained(logits.view(self.C, -1))
        step: StepResult | None = self._prepared
        self._prepared = None
        if step is None:
            self._adjust(logits.view(self.C, -1))
            step = denoise_step(logits.view(1, self.C, -1), self.canvas, self.remaining, self.cfg, self.history,
                                self.generator)
        self.stats.denoise_steps += 1
        self.remaining -= 1
        self.canvas, self.draft, self.history = step.canvas, step.draft, step.history
        self.sc_logits = step.processed
        if bool(step.stop[0]) or self.remaining == 0:
            return self._finish_canvas(step.processed)
        return []

    def _apply_constrained(self, logits: Tensor) -> list[int]:
        """One denoising step with the fixed prefix pinned and the next position under the grammar's mask."""
        self._adjust(logits)
        k = len(self.fixed)
        if k:  # pinned: the fixed token alone, so it is drafted, sampled and kept, with zero entropy
            logits[:k] = float("-inf")
            logits[torch.arange(k, device=logits.device), torch.tensor(self.fixed, device=logits.device)] = 0.0
        self.constraint.mask_row(logits[k])
        step = denoise_step(logits[None], self.canvas, self.remaining, self.cfg, self.history, self.generator)
        self.stats.denoise_steps += 1
        self.remaining -= 1
        self.history, self.sc_logits = step.history, step.processed
        processed, drafts = step.processed[0], step.draft[0].tolist()
        accepted = step.accepted[0].tolist()
        self._fix(processed, drafts, accepted)
        span = self._span()
        if len(self.fixed) < span and not self._fixed_stop() and (bool(step.stop[0]) or self.remaining == 0):
            while len(self.fixed) < span and not self._fixed_stop():  # fill the rest from the drafts
                self._fix(processed, drafts, [True] * len(drafts))
        fixed = torch.tensor(self.fixed, dtype=torch.long, device=step.canvas.device)
        step.canvas[0, :len(self.fixed)] = fixed
        step.draft[0, :len(self.fixed)] = fixed
        self.canvas, self.draft = step.canvas, step.draft
        if len(self.fixed) < span and not self._fixed_stop():
            return []
        new = self._finish_canvas(processed, recorded=True)
        if self.finish_reason == "length" and self.constraint.complete():
            self.finish_reason = "stop"  # the grammar's output is complete: not truncated
        return new

    def _adjust(self, logits: Tensor) -> None:
        """Request-level logit changes of this canvas's [C, V] logits, in place: logit_bias and penalties, and
        min_tokens (vLLM's meaning: no stop token among the first min_tokens outputs) as a ban of the stop
        tokens at those canvas positions, so neither the draft nor the sample can end the output there."""
        if self.adjuster is not None:
            self.adjuster.adjust(logits)
        output_index = torch.arange(logits.shape[0]) + (self.block_start - self.P)
        ban_early_stops(logits, output_index, self.params.min_tokens, self.stops)

    def _span(self) -> int:
        """Canvas positions that reach the output (all but the part past max_tokens)."""
        return min(self.C, self.limit - self.block_start)

    def _fixed_stop(self) -> bool:
        return bool(self.fixed) and self.fixed[-1] in self.constraint.stops

    def _fix(self, processed: Tensor, drafts: list[int], confident: list[bool]) -> None:
        """Verify the drafts from the first unfixed position on and fix what the grammar accepts (>= 1 token)."""
        k, span = len(self.fixed), self._span()
        rows = processed[k:span]
        probs = torch.softmax(rows.float(), dim=-1).gather(1, torch.tensor(drafts[k:span], device=rows.device)[:, None])
        tokens, p = self.constraint.verify(rows, drafts[k:span], confident[k:span], probs[:, 0].tolist(), _GREEDY,
                                           self.generator, room=self.limit - self.block_start - k)
        self.fixed += tokens
        lo = self.block_start - self.P + k
        if self.logprobs is not None:
            self.logprobs[lo:lo + len(tokens)] = torch.tensor(p).clamp_min(1e-30).log()
        if self.top is not None:  # rows as decoded: the first one under the grammar's mask
            self.top.record(torch.arange(lo, lo + len(tokens)), rows[: len(tokens)], 0.0)

    def _finish_canvas(self, processed: Tensor, recorded: bool = False) -> list[int]:
        lo, hi = self.block_start, self.block_start + self.C
        self.tokens[lo:hi] = self.draft[0].cpu()
        self.canvases_done += 1
        end = min(hi, self.limit)
        new = self.tokens[lo:end].tolist()
        if self.adjuster is not None:
            self.adjuster.commit(self.tokens[lo:end])
        if self.logprobs is not None and not recorded:
            lp = torch.log_softmax(processed[0].float(), dim=-1).gather(1, self.draft[0][:, None])[:, 0]
            self.logprobs[lo - self.P:end - self.P] = lp[: end - lo].cpu()
        if self.top is not None and not recorded:  # processed = logits / T at this step: T is already applied
            self.top.record(torch.arange(lo - self.P, end - self.P), processed[0][: end - lo], 0.0)
        for i, t in enumerate(new):
            if t in self.stops:
                self.final_end = lo + i
                self.finish("stop")
                return new[:i]
        self.final_end = end
        if end >= self.limit or self.canvases_done >= self.num_canvases:
            self.finish("length")
        else:
            self.block_start = hi
            self._reset_canvas()
        return new

    def finish(self, reason: str) -> None:
        self.status, self.finish_reason = Status.FINISHED, reason
        self.cache = None
        self.sc_logits = self.history = None

    # ------------------------------------------------------------------ views
    @property
    def output_ids(self) -> list[int]:
        return self.tokens[self.P:self.final_end].tolist()

    @property
    def num_generated(self) -> int:
        return self.final_end - self.P

    def snapshot(self) -> list[int]:
        """Final text so far plus the active canvas's current draft (argmax), as TextDiffusionStreamer shows it."""
        done = self.output_ids
        if self.draft is None or self.finish_reason:
            return done
        return done + self.draft[0].tolist()[: self.limit - self.block_start]


def _image_ids(config: dict) -> list[int]:
    keys = ("boi_token_id", "image_token_id", "eoi_token_id")
    return [int(config[k]) for k in keys if isinstance(config.get(k), int)]
