"""The step-level engine: accepts requests any time, one batched forward per step, per-request events."""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

import torch

from unmask.decoding.dry import breaker_mask
from unmask.decoding.policies import LEARNED, SPECULATIVE
from unmask.engine import memory
from unmask.engine.compiled_step import CompiledStep, cache_capacity, compile_step_requested, not_compilable
from unmask.engine.detokenizer import TextStream
from unmask.engine.outputs import StepOutput
from unmask.engine.params import DEFAULT_POLICY, GenerationParams, model_policy
from unmask.engine.prefix_cache import PrefixCache, block_keys
from unmask.engine.kv_pool import KVPool
from unmask.engine.runner import ModelRunner
from unmask.engine.scheduler import Scheduler
from unmask.engine.sequence import ModelTraits, Sequence
from unmask.engine.speculative import load_ngram_drafts
from unmask.engine.static_step import MAX_WIDTH, StaticStep, static_step_requested
from unmask.errors import ContextLengthError, InvalidRequestError, MemoryLimitError
from unmask.models.loader import ModelSpec
from unmask.models.transformer import DiffusionTransformer
from unmask.tokenizer import Tokenizer

log = logging.getLogger("unmask.engine")

@dataclass
class EngineStats:
    steps: int = 0
    forward_s: float = 0.0  # in model forwards: host clock on CPU, device time (CUDA events) on CUDA
    step_s: float = 0.0
    tokens_fed: int = 0
    batch_size_sum: int = 0

    @property
    def overhead_share(self) -> float:
        """Time outside the model's forward as a fraction of the forward's own time."""
        return (self.step_s - self.forward_s) / self.forward_s if self.forward_s else 0.0


class Engine:
    def __init__(self, model: DiffusionTransformer, spec: ModelSpec, tokenizer: Tokenizer | None = None,
                 max_num_seqs: int = 64, max_batch_tokens: int = 4096, prefix_cache_bytes: int = 256 << 20,
                 kv_cache_dtype: torch.dtype | None = None, static_step: bool | None = None,
                 kv_pool_tokens: int | None = None, memory_utilization: float = 0.9,
                 cuda_graphs: bool | None = None, compile_step: bool | str | None = None,
                 ngram_drafts: bool = True):
        """static_step: run decode steps on static buffers over a preallocated KV pool, replayed as CUDA graphs on
        a GPU (engine/static_step.py; None: UNMASK_STATIC_STEP); the pool holds `kv_pool_tokens` (None: what
        `memory_utilization` of the memory free now allows, at most what max_num_seqs full contexts need).
        cuda_graphs: capture and replay steps as CUDA graphs on a GPU (None: UNMASK_CUDA_GRAPHS, on by default).
        compile_step: on the CPU, run decode steps through forwards compiled per count of requests, the
        one-request forward compiled here; "auto": that one only, where the model qualifies (engine/compiled_step.py;
        None: UNMASK_COMPILE_STEP, off by default). ngram_drafts: False leaves the checkpoint's n-gram draft table
        unread (`unmask ngram-drafts` rebuilding it runs the model without the table it replaces)."""
        self.model, self.spec, self.tokenizer = model, spec, tokenizer
        self.kv_cache_dtype = kv_cache_dtype  # None: the weights' dtype
        probe = model.new_cache(capacity=0, dtype=kv_cache_dtype)
        self.kv_bytes_per_token = probe.bytes_per_token()
        # what the memory check counts per token of context: the cache and, for a cache in another dtype than the
        # weights', one layer's K/V read back in the compute dtype while it attends
        self.memory_per_token = self.kv_bytes_per_token + memory.read_copy_per_token(
            probe.shapes, probe.dtype, model.lm_head.weight.dtype)
        self.scheduler = Scheduler(max_num_seqs, max_batch_tokens)
        self.kv_pool, static = None, None
        if (static_step_requested(static_step) and spec.family.attention == "block_causal"
                and spec.family.sequence_class is None):
            if kv_cache_dtype == torch.int8:  # the static step attends the pool's tensors directly
                raise InvalidRequestError("an int8 KV cache is not supported with the static step "
                                          "(UNMASK_STATIC_STEP); choose auto, bfloat16 or float32", "kv_cache_dtype")
            cap = max_num_seqs * (spec.max_context + MAX_WIDTH)
            self.kv_pool = KVPool.for_model(model, kv_pool_tokens, memory_utilization, kv_cache_dtype, MAX_WIDTH, cap)
            static = StaticStep(model, self.kv_pool, spec.mask_id, cuda_graphs=cuda_graphs)
            self.scheduler.admit = lambda seq: seq.cache is not None or self._attach_cache(seq)
            log.info("static step: a KV pool of %d tokens (%s) on %s, CUDA graphs %s", self.kv_pool.capacity_tokens,
                     memory.mib(self.kv_pool.nbytes()), self.kv_pool.device, "on" if static.graphs else "off")
        compiled = None
        mode = compile_step_requested(compile_step) if static is None else False
        if mode:
            reason = not_compilable(model)
            if reason:   # asked for by name: a warning; the server's default: a note
                log.log(logging.WARNING if mode is True else logging.INFO, "compiled CPU step not used: %s", reason)
            else:
                compiled = CompiledStep(model, compile_when_met=mode is True)
                log.info("compiled CPU step on: compiling the one-request step (seconds; %s)",
                         "later row counts compile when first met" if mode is True else "several requests run eagerly")
                compiled.warm(1)
        self.runner = ModelRunner(model, static, cuda_graphs, compiled)
        self.traits = ModelTraits(
            attention=spec.family.attention, shift=spec.shift, mask_id=spec.mask_id,
            block_size=spec.block_size, stop_ids=spec.stop_ids, ar_first_token=spec.ar_first_token,
            max_context=spec.max_context, config=spec.config, generation_config=spec.generation_config,
            causal_context=spec.causal_context, family=spec.family.name,
            ngram_drafts=load_ngram_drafts(spec) if ngram_drafts else None,
        )
        self.streams: dict[str, TextStream] = {}
        # prompt K/V are reusable only where they do not depend on the answer canvas
        exact = spec.family.attention == "block_causal" and prefix_cache_bytes > 0
        self.prefix_cache = PrefixCache(prefix_cache_bytes) if exact else None
        self._pending_store: dict[str, list[str]] = {}
        self.stats = EngineStats()
        self._structured = None                  # unmask.structured.backend.GuidanceBackend, on first use
        self._structured_lock = threading.Lock()
        self._token_texts: list[str] | None = None  # DRY sequence breakers, on first use
        self._dry_breakers: dict = {}

    # ------------------------------------------------------------------ requests
    def resolve_policy(self, params: GenerationParams) -> GenerationParams:
        """`params` with the "default" policy made concrete: the model's `default_policy` where this request can
        run under it (generation_config.json; params.model_policy), else the fallback (threshold)."""
        if params.policy != DEFAULT_POLICY:
            return params
        chosen = model_policy(self.spec.generation_config)
        allowed = chosen is not None
        if allowed and chosen["policy"] == SPECULATIVE:
            from unmask.engine.speculative import speculative_refusal

            allowed = speculative_refusal(params, self.traits, self.spec.family.sequence_class) is None
        return params.with_model_policy(chosen, allowed)

    def check_request(self, prompt_ids: list[int], params: GenerationParams) -> None:
        """Raises InvalidRequestError / ContextLengthError; reads no engine state (safe from any thread)."""
        params = self.resolve_policy(params)
        if not prompt_ids:
            raise InvalidRequestError("the prompt is empty", "prompt")
        vocab = self.spec.arch.vocab_size
        if min(prompt_ids) < 0 or max(prompt_ids) >= vocab:
            raise InvalidRequestError(f"prompt token ids must be in [0, {vocab})", "prompt")
        if params.suffix_ids or params.infill_lengths:  # masked-span infilling (unmask.engine.infill)
            if self.traits.attention != "bidirectional" or self.spec.family.sequence_class is not None:
                raise InvalidRequestError(f"a masked span between a prefix and a suffix needs a bidirectional "
                                          f"masked-diffusion family, not {self.spec.family.name}", "suffix")
            if params.suffix_ids and (min(params.suffix_ids) < 0 or max(params.suffix_ids) >= vocab):
                raise InvalidRequestError(f"suffix token ids must be in [0, {vocab})", "suffix")
        if params.logit_bias and max(params.logit_bias) >= vocab:
            raise InvalidRequestError(f"logit_bias token id {max(params.logit_bias)} is outside this model's "
                                      f"vocabulary [0, {vocab})", "logit_bias")
        total = len(prompt_ids) + params.max_tokens + len(params.suffix_ids)
        if total > self.traits.max_context:
            suffix = f" plus the suffix ({len(params.suffix_ids)})" if params.suffix_ids else ""
            raise ContextLengthError(
                f"prompt ({len(prompt_ids)} tokens) plus max_tokens ({params.max_tokens}){suffix} is {total} tokens, "
                f"over this model's context of {self.traits.max_context}", "max_tokens")
        self._check_memory(len(prompt_ids), params)
        block_causal = self.traits.attention == "block_causal" and self.spec.family.sequence_class is None
        params.check_model(self.traits.block_size, block_causal, self.traits.causal_context, self.spec.family.name)
        self.traits.check_canvas(len(prompt_ids), params)  # full_last_block: the whole last block must fit
        if params.policy == LEARNED:
            try:
                flt = self.traits.commit_filter
            except ValueError as e:  # a hand-edited generation_config.json
                raise InvalidRequestError(f"policy 'learned': this model's {e}", "policy") from None
            if flt is None or self.spec.family.sequence_class is not None:
                raise InvalidRequestError("policy 'learned' needs a commit filter fitted to the model (`unmask "
                                          f"calibrate -m DIR`); {self.spec.family.name} model "
                                          f"{self.spec.path.name} has none", "policy")
        if params.policy == SPECULATIVE:
            from unmask.engine.speculative import check_speculative

            check_speculative(params, self.traits, self.spec.family.sequence_class)
        if params.stop and self.tokenizer is None:
            raise InvalidRequestError("stop strings need a tokenizer", "stop")
        if params.dry_multiplier and self.spec.family.sequence_class is not None:
            raise InvalidRequestError(f"dry_multiplier is not supported for the {self.spec.family.name} family "
                                      "(its decoder commits whole canvases, with no left context to match)",
                                      "dry_multiplier")
        if params.edit_config().active and self.spec.family.sequence_class is not None:
            name = "edit_threshold" if params.edit_threshold is not None else "remask_budget"
            raise InvalidRequestError(f"{name} is not supported for the {self.spec.family.name} family (its decoder "
                                      "re-noises the whole canvas itself)", name)
        if params.structured is not None:
            self.structured_backend().compile(params.structured)  # 400 for what it cannot enforce

    def _check_memory(self, n_prompt: int, params: GenerationParams) -> None:
        """Refuses a request whose KV cache would not fit in the memory free now (bidirectional families without
        a cache keep none); the message names how many tokens would."""
        if self.traits.attention == "bidirectional" and (params.cache not in ("prefix", "dual") or params.suffix_ids):
            return
        total = n_prompt + params.max_tokens + len(params.suffix_ids)
        if self._pooled(params):
            need = self._pool_tokens(total, params)
            if need > self.kv_pool.capacity_tokens:
                fit = self.kv_pool.capacity_tokens - self.kv_pool.scratch
                raise MemoryLimitError(
                    f"prompt ({n_prompt} tokens) plus max_tokens ({params.max_tokens}) needs {need} tokens of the "
                    f"preallocated KV pool, which holds {self.kv_pool.capacity_tokens} "
                    f"({memory.mib(self.kv_pool.nbytes())}): at most {fit} tokens (prompt plus max_tokens, rounded up "
                    f"to whole blocks) would fit", "max_tokens")
            return
        room = memory.budget(self.memory_per_token, self.model.lm_head.weight.device)
        if total > room.tokens:
            dtype = str(self.kv_cache_dtype or self.model.lm_head.weight.dtype).removeprefix("torch.")
            copy = self.memory_per_token - self.kv_bytes_per_token
            read = f" (and {memory.mib(total * copy)} to read a layer of it back)" if copy else ""
            raise MemoryLimitError(
                f"prompt ({n_prompt} tokens) plus max_tokens ({params.max_tokens}) needs "
                f"{memory.mib(total * self.kv_bytes_per_token)} of {dtype} KV cache{read}, more than the "
                f"{memory.mib(room.available)} of memory free now allows: at most {room.tokens} tokens "
                f"(prompt plus max_tokens) would fit", "max_tokens")

    def add_request(self, prompt_ids: list[int], params: GenerationParams | None = None,
                    request_id: str | None = None) -> Sequence:
        params = self.resolve_policy(params or GenerationParams())
        self.check_request(prompt_ids, params)
        seq_class = self.spec.family.sequence_class or Sequence
        if params.policy == SPECULATIVE:
            from unmask.engine.speculative import SpeculativeSequence

            seq_class = SpeculativeSequence
        if params.infill_lengths and params.structured is None:
            from unmask.engine.infill import InfillSequence  # probes the candidate span lengths first

            seq_class = InfillSequence
        seq = seq_class(list(prompt_ids), params, self.traits)
        if request_id is not None:
            seq.request_id = request_id
        if params.structured is not None:
            seq.constraint = self.structured_backend().constraint(params.structured)
            if seq.constraint.holds_back and not hasattr(seq, "_restart_constrained"):
                raise InvalidRequestError(f"{params.structured.param} cannot be enforced on the "
                                          f"{self.spec.family.name} family: it uses "
                                          f"{', '.join(seq.constraint.relaxed)}, which unmask checks after the "
                                          "draft and retries, and this family's decoder cannot start an answer over",
                                          params.structured.param)
        if getattr(seq, "dry", None) is not None and self.tokenizer is not None:  # GemmaSequence has none
            seq.dry_breakers = self.dry_breakers(seq.dry.breakers)
        if not self._pooled(params):  # a pooled cache is taken at admission (Scheduler.admit)
            self._attach_cache(seq)
        if self.tokenizer is not None:
            self.streams[seq.request_id] = TextStream(self.tokenizer, params.stop, params.include_stop_str,
                                                         params.min_tokens)
        self.scheduler.add(seq)
        return seq

    def _pooled(self, params: GenerationParams) -> bool:
        """Whether a request's cache is a run of the KV pool (plain block-causal requests of an engine with one)."""
        return self.kv_pool is not None and params.policy != SPECULATIVE and not params.infill_lengths

    def _pool_tokens(self, total: int, params: GenerationParams) -> int:
        """Pool tokens a request takes: prompt + max_tokens up to whole blocks (full_last_block decodes the last
        block whole), plus the scratch a static step's padding writes past a segment."""
        b = params.resolved(self.traits.defaults, self.traits.block_size).block_size or self.traits.block_size
        return -(-total // b) * b + self.kv_pool.scratch

    def _attach_cache(self, seq: Sequence) -> bool:
        """The request's KV cache and the prompt blocks the prefix cache holds; False (the request waits) when the
        KV pool has no free run long enough now."""
        if self._pooled(seq.params):
            cache = self.kv_pool.allocate(seq.request_id, self._pool_tokens(seq.P + seq.params.max_tokens, seq.params))
            if cache is None:
                return False
            seq.cache = cache
        elif not (seq.bidirectional and seq.cache_mode == "none"):
            total = seq.P + seq.params.max_tokens + len(seq.params.suffix_ids)
            compiled = self.runner.compiled is not None and self.kv_cache_dtype in (None, self.runner.compiled.dtype)
            cap = cache_capacity(total) if compiled else None
            if cap is not None:  # one buffer from the start with room for the compiled step's padded segments
                seq.cache = self.model.new_cache(capacity=cap, max_capacity=cap)
                for t in seq.cache.k + seq.cache.v:
                    t.zero_()   # it attends over the whole buffer, masked: unwritten keys must be finite
            else:
                seq.cache = self.model.new_cache(capacity=min(total, 4096), max_capacity=total,
                                                 dtype=self.kv_cache_dtype)
        if self.prefix_cache is not None:
            keys = block_keys(seq.prompt_ids[:seq.block_start], seq.B)
            seq.cached = self.prefix_cache.load(keys[:seq.prefill_limit // seq.B], seq.cache, seq.B)
            if len(keys) * seq.B > seq.cached:
                self._pending_store[seq.request_id] = keys
        return True

    def dry_breakers(self, breakers: tuple[str, ...]):
        """[V] bool: the tokens whose text holds one of `breakers` (cached per breaker set)."""
        if breakers not in self._dry_breakers:
            if self._token_texts is None:
                n = min(self.tokenizer.vocab_size, self.spec.arch.vocab_size)
                self._token_texts = self.tokenizer.token_texts(n)
                self._token_texts += [""] * (self.spec.arch.vocab_size - n)
            if len(self._dry_breakers) > 16:
                self._dry_breakers.clear()
            self._dry_breakers[breakers] = breaker_mask(self._token_texts, breakers)
        return self._dry_breakers[breakers]

    def structured_backend(self):
        """The grammar engine (unmask.structured), built on the first constrained request."""
        if self._structured is None:
            seq_class = self.spec.family.sequence_class or Sequence
            if not getattr(seq_class, "supports_constraints", False):
                raise InvalidRequestError(f"structured output is not supported for the {self.spec.family.name} "
                                          "family (its decoder has no grammar hook)", "response_format")
            if self.tokenizer is None:
                raise InvalidRequestError("structured output needs a tokenizer", "response_format")
            from unmask.structured.backend import GuidanceBackend

            with self._structured_lock:
                if self._structured is None:
                    self._structured = GuidanceBackend(self.tokenizer, self.spec.arch.vocab_size, self.traits.stop_ids)
        return self._structured

    def abort(self, request_id: str) -> StepOutput | None:
        seq = self.scheduler.abort(request_id)
        if seq is None:
            return None
        self._pending_store.pop(request_id, None)
        self.streams.pop(request_id, None)
        if self.kv_pool is not None:
            self.kv_pool.release(request_id)
        return self._output(seq, [], "")

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    # ------------------------------------------------------------------ the step
    def step(self) -> list[StepOutput]:
        t0 = time.perf_counter()
        plans = self.scheduler.schedule()
        if not plans:
            return []
        result = self.runner.execute(plans)
        prepare = getattr(self.spec.family.sequence_class, "prepare_batch", None)
        if prepare is not None:  # families that decide every request's step in one batched computation
            prepare(plans, result.logits)
        outputs = []
        for plan, logits in zip(plans, result.logits):
            seq = plan.seq
            seq.after_forward(plan)
            if plan.targets.numel() == 0 and plan.segment.write and plan.segment.start + plan.segment.write <= seq.P:
                seq.stats.prefill_forwards += 1
            keys = self._pending_store.get(seq.request_id)
            if keys is not None and seq.cached >= len(keys) * seq.B:
                self.prefix_cache.store(keys, seq.cache, seq.B)
                del self._pending_store[seq.request_id]
            new = seq.apply(plan, logits)
            delta = ""
            stream = self.streams.get(seq.request_id)
            if stream is not None:
                delta = stream.push(new)
                if stream.stopped and not seq.finish_reason:
                    # tokens committed in this step after the stop string are not output (ids, logprobs, usage)
                    keep = stream.tokens_through_stop()
                    new = new[:max(0, len(new) - (len(stream.ids) - keep))]
                    seq.final_end = seq.P + keep
                    seq.finish("stop")
                if seq.finish_reason:
                    delta += stream.flush()
                    self.streams.pop(seq.request_id, None)
            if new or seq.finish_reason or seq.params.snapshots:
                outputs.append(self._output(seq, new, delta))
        for done in self.scheduler.release_finished():
            self._pending_store.pop(done.request_id, None)
            if self.kv_pool is not None:
                self.kv_pool.release(done.request_id)
        s = self.stats
        s.steps += 1
        s.forward_s += result.forward_s
        if not self.scheduler.has_unfinished():  # idle: collect the device time still in flight
            s.forward_s += self.runner.settle_timing()
        s.step_s += time.perf_counter() - t0
        s.tokens_fed += result.num_tokens
        s.batch_size_sum += len(plans)
        return outputs

    def _output(self, seq: Sequence, new: list[int], delta: str) -> StepOutput:
        lp = top = None
        start = seq.final_end - len(new) - seq.P
        if seq.logprobs is not None and new:
            lp = seq.logprobs[start:start + len(new)].tolist()
        if seq.top is not None and new:
            top = seq.top.slice(start, len(new))
        return StepOutput(
            request_id=seq.request_id, new_token_ids=new, text_delta=delta,
            finished=seq.finish_reason is not None, finish_reason=seq.finish_reason,
            num_prompt_tokens=seq.P, num_generated=seq.num_generated, forwards=seq.stats.forwards,
            # the last frame is the finished output, with nothing masked: a client's view ends where the text does
            snapshot=(seq.output_ids if seq.finish_reason else seq.snapshot()) if seq.params.snapshots else None,
            new_logprobs=lp, new_top_logprobs=top, error=getattr(seq, "error", None),
            edits=getattr(seq.stats, "edits", 0), remasks=getattr(seq.stats, "remasks", 0),
            edited=list(getattr(seq, "edited", [])) if seq.params.snapshots else None,
        )

    def run_to_completion(self) -> None:
        while self.has_unfinished():
            self.step()
