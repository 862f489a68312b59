"""Offline API: `LLM(model=DIR).generate(prompts, params)` drives the same step engine as the server."""
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from unmask.defaults import default_model_path
from unmask.engine.engine import Engine
from unmask.engine.memory import resolve_kv_cache_dtype
from unmask.engine.outputs import RequestOutput, StepOutput
from unmask.engine.params import GenerationParams
from unmask.errors import InvalidRequestError, ModelLoadError
from unmask.models.cpu_linear import PackedLinear
from unmask.models.loader import load_model
from unmask.tokenizer import Tokenizer

Prompt = str | list[int]


class LLM:
    def __init__(self, model: str | Path | None = None, dtype: str | None = None, device: str = "auto",
                 max_num_seqs: int = 64, max_batch_tokens: int = 4096, chat_template: str | None = None,
                 kv_cache_dtype: str | None = None, static_step: bool | None = None,
                 kv_pool_tokens: int | None = None, memory_utilization: float = 0.9,
                 cuda_graphs: bool | None = None, compile_step: bool | str | None = None, ngram_drafts: bool = True):
        """static_step, kv_pool_tokens, memory_utilization, cuda_graphs: the block-causal static-buffer step, its KV
        pool and graph capture (Engine; engine/static_step.py); compile_step: CPU decode steps compiled per count of requests
        (engine/compiled_step.py); ngram_drafts: False leaves the model's n-gram draft table unread."""
        if model is None and not default_model_path().is_dir():
            raise ModelLoadError(f"the built-in model is not installed at {default_model_path()}; pass --model DIR")
        path = Path(model) if model is not None else default_model_path()
        self.model, self.spec = load_model(path, dtype=dtype, device=device)
        # on the CPU load_model ran the linears through oneDNN on packed weights (models/cpu_linear.py)
        self.packed_linears = sum(type(m) is PackedLinear for m in self.model.modules())
        self.tokenizer = Tokenizer(self.spec.path, chat_template=chat_template)
        self.engine = Engine(self.model, self.spec, self.tokenizer, max_num_seqs, max_batch_tokens,
                             kv_cache_dtype=resolve_kv_cache_dtype(kv_cache_dtype), static_step=static_step,
                             kv_pool_tokens=kv_pool_tokens, memory_utilization=memory_utilization,
                             cuda_graphs=cuda_graphs, compile_step=compile_step, ngram_drafts=ngram_drafts)

    def encode(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, (list, tuple)):
            return list(prompt)
        if not isinstance(prompt, str):
            raise InvalidRequestError(f"a prompt is a string or a list of token ids, got {type(prompt).__name__}",
                                      "prompt")
        return self.tokenizer.encode(prompt)

    def chat_prompt(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        return self.tokenizer.encode(self.tokenizer.apply_chat_template(messages, tools=tools))

    def stream(self, prompt: Prompt, params: GenerationParams | None = None) -> Iterator[StepOutput]:
        """One request, its StepOutputs as the engine produces them (text_delta: newly final text). Closing
        the generator early aborts the request."""
        seq = self.engine.add_request(self.encode(prompt), params or GenerationParams())
        done = False
        try:
            while not done and self.engine.has_unfinished():
                for out in self.engine.step():
                    if out.request_id == seq.request_id:
                        done = out.finished
                        yield out
        finally:
            if not done:
                self.engine.abort(seq.request_id)

    def generate(self, prompts: Prompt | list[Prompt], params: GenerationParams | list[GenerationParams] | None = None,
                 progress: bool = False) -> list[RequestOutput]:
        single = isinstance(prompts, str) or (isinstance(prompts, (list, tuple)) and prompts
                                              and isinstance(prompts[0], int))
        batch = [prompts] if single else list(prompts)
        plist = params if isinstance(params, list) else [params or GenerationParams()] * len(batch)
        if len(plist) != len(batch):
            raise ValueError(f"{len(batch)} prompts but {len(plist)} parameter sets")
        seqs = []
        try:
            for p, sp in zip(batch, plist):
                seqs.append(self.engine.add_request(self.encode(p), sp))
        except BaseException:  # a later prompt refused: the earlier ones must not linger in the engine
            for seq in seqs:
                self.engine.abort(seq.request_id)
            raise
        texts = {s.request_id: "" for s in seqs}
        logprobs: dict[str, list[float]] = {s.request_id: [] for s in seqs}
        tops: dict[str, list] = {s.request_id: [] for s in seqs}
        bar = _progress_bar(len(seqs)) if progress else None   # requests finished, as vLLM's use_tqdm
        try:
            while self.engine.has_unfinished():
                for out in self.engine.step():
                    if out.request_id in texts:
                        texts[out.request_id] += out.text_delta
                        if out.new_logprobs:
                            logprobs[out.request_id].extend(out.new_logprobs)
                        if out.new_top_logprobs:
                            tops[out.request_id].extend(out.new_top_logprobs)
                        if out.finished and bar is not None:
                            bar.advance(bar.task_ids[0])
        finally:
            if bar is not None:
                bar.stop()
        for s in seqs:
            if getattr(s, "error", None) is not None:  # a constrained answer that failed its after-draft check
                raise s.error
        return [RequestOutput(
            request_id=s.request_id, prompt_ids=s.prompt_ids, token_ids=s.output_ids,
            text=texts[s.request_id], finish_reason=s.finish_reason, forwards=s.stats.forwards,
            prefill_forwards=s.stats.prefill_forwards,
            logprobs=logprobs[s.request_id] if s.params.logprobs else None,
            top_logprobs=tops[s.request_id] if s.params.top_logprobs else None,
        ) for s in seqs]


def _progress_bar(total: int):
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    bar = Progress(TextColumn("generating"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(), transient=True)
    bar.add_task("generate", total=total)
    bar.start()
    return bar
