"""Editor endpoints: fill in the middle, apply-edit and next-edit (no web framework here).

  fim     /v1/fim/completions, and /v1/completions with a `suffix`: one infill per prompt and choice
          (unmask.engine.infill), through OpenAIServing's job runner, so streaming, n, stop, logprobs,
          admission and cancellation behave exactly as on /v1/completions.
  apply   /v1/apply/completions: the snippet is merged deterministically (unmask.edits.apply); each
          ambiguous region becomes one infill constrained to that region's options (a grammar choice),
          the rest of the merged file on both sides. All regions run at once, batched by the engine.
  edit    /v1/edit/completions: the lines to rewrite (unmask.edits.next_edit) become free infills, the
          rest of the file on both sides; every other byte of the region is returned unchanged.
"""
from __future__ import annotations

import difflib
import time
import uuid
from collections.abc import AsyncIterator

from unmask.edits import (Choice, EditPlan, Fixed, Rewrite, choice_infill, parse_apply_prompt, parse_next_edit_prompt,
                          plan_merge, plan_next_edit)
from unmask.edits.next_edit import clean_rewrite
from unmask.engine.infill import InfillPrompt, build_infill, infill_mode, infill_params
from unmask.engine.params import GenerationParams
from unmask.errors import ContextLengthError, InvalidRequestError
from unmask.server.protocol import (APIError, AssistantMessage, ChatChoice, ChatChunkChoice, ChatCompletionChunk,
                                    ChatCompletionResponse, CompletionRequest, Delta, EditCompletionResponse,
                                    EditRequest, Usage)
from unmask.server.formats import CompletionFormat, sse
from unmask.server.metrics import arrival
from unmask.server.serving import Disconnected, Job, OpenAIServing, request_priority
from unmask.structured import StructuredSpec, from_request

FIM_DEFAULT_MAX_TOKENS = 256     # a FIM request without max_tokens (also capped by --default-max-tokens)
REWRITE_MAX_TOKENS = 128         # tokens one next-edit rewrite may take when the request gives no max_tokens
CHOICE_SLACK = 8                 # span tokens beyond an apply option's own length (tokenization may differ)
MAX_MODEL_REGIONS = 16           # regions one edit request asks the model about; the rest keep their default
NO_SUFFIX = "<|endoftext|>"      # a suffix of just this means "no suffix"


def _bad(e: InvalidRequestError) -> APIError:
    code = "context_length_exceeded" if isinstance(e, ContextLengthError) else None
    return APIError(400, str(e), param=e.param, code=code)


class EditServing:
    def __init__(self, serving: OpenAIServing):
        self.s = serving
        self.tok, self.spec = serving.tok, serving.spec
        self.engine = serving.llm.engine

    # ------------------------------------------------------------------ fill in the middle
    async def fim(self, req: CompletionRequest, is_disconnected: Disconnected | None = None):
        t0 = arrival()
        s = self.s
        s._validate(req)
        try:
            mode = infill_mode(self.spec, self.tok)
            structured = from_request(req.response_format, req.regex, req.choice, req.grammar)
        except InvalidRequestError as e:
            raise _bad(e) from None
        if req.infill_lengths is not None and mode != "masked_span":
            raise APIError(400, f"infill_lengths applies to masked-span infilling (bidirectional families); this "
                                f"{self.spec.family.name} model fills the middle with fill-in-the-middle tokens and "
                                "ends it at its end-of-sequence token", param="infill_lengths")
        prompts = req.prompts()
        if not prompts:
            raise APIError(400, "the prompt is empty", param="prompt")
        if len(prompts) * req.n > s.capacity:
            raise APIError(400, f"{len(prompts) * req.n} choices requested; this server holds at most "
                                f"{s.capacity} requests (--max-num-seqs + --max-queue)",
                           param="n" if req.n > 1 else "prompt")
        max_tokens = self._max_tokens(req.max_tokens, min(FIM_DEFAULT_MAX_TOKENS, s.cfg.default_max_tokens))
        kw = {**s.defaults, **req.generation_kwargs()}
        if structured is not None:
            self._compile(structured)
            kw["structured"] = structured
        suffix = req.suffix or ""
        if suffix.strip() == NO_SUFFIX:  # what Continue's inception provider sends for an empty suffix
            suffix = ""
        base, jobs, counted = uuid.uuid4().hex[:16], [], []
        for p, prompt in enumerate(prompts):
            ip = self._infill(prompt, suffix, max_tokens)
            counted.append(ip.prompt_ids + ip.suffix_ids)
            for j in range(req.n):
                seed = None if req.seed is None else (req.seed + j) % 2**63
                params = self._params(ip, req.infill_lengths, max_tokens=max_tokens, seed=seed,
                                      logprobs=req.logprobs is not None, top_logprobs=req.logprobs or 0,
                                      snapshots=req.diffusing and req.stream, **kw)
                jobs.append(Job(p * req.n + j, f"{base}-{p * req.n + j}", ip.prompt_ids, params))
        fmt = CompletionFormat(s, req, [""] * len(prompts))
        return await s._run(fmt, jobs, req, counted, is_disconnected, t0)

    def _max_tokens(self, asked: int | None, default: int, field: str = "max_tokens") -> int:
        ctx = self.spec.max_context
        n = default if asked is None else asked
        if n < 1:
            raise APIError(400, f"{field} must be at least 1, got {n}", param=field)
        if n >= ctx:
            raise APIError(400, f"{field} ({n}) leaves no room for the prefix and suffix in this model's "
                                f"context of {ctx} tokens", param=field, code="context_length_exceeded")
        return n

    def _infill(self, prefix: str | list[int], suffix: str, max_tokens: int) -> InfillPrompt:
        """The infill prompt, prefix and suffix trimmed (far ends first) to fit the context and --max-prompt-tokens."""
        ctx = self.spec.max_context
        limit = min(ctx - max_tokens, self.s.cfg.max_prompt_tokens or ctx)
        vocab = self.spec.arch.vocab_size
        if isinstance(prefix, list) and any(t < 0 or t >= vocab for t in prefix):
            raise APIError(400, f"prompt token ids must be in [0, {vocab})", param="prompt")
        try:
            return build_infill(self.tok, self.spec, prefix, suffix, limit)
        except InvalidRequestError as e:
            raise _bad(e) from None

    def _params(self, ip: InfillPrompt, lengths: list[int] | None, **kw) -> GenerationParams:
        try:
            params = infill_params(ip, GenerationParams(priority=request_priority.get(), **kw), lengths)
            self.engine.check_request(ip.prompt_ids, params)  # a 400 now rather than an error frame mid-stream
        except InvalidRequestError as e:
            raise _bad(e) from None
        return params

    def _compile(self, spec: StructuredSpec) -> None:
        try:
            self.engine.structured_backend().compile(spec)
        except InvalidRequestError as e:
            raise _bad(e) from None

    # ------------------------------------------------------------------ apply-edit and next-edit
    async def apply(self, req: EditRequest, is_disconnected: Disconnected | None = None):
        t0 = arrival()
        content = self._edit_content(req)
        try:
            original, snippet = parse_apply_prompt(content)
        except InvalidRequestError as e:
            raise _bad(e) from None
        plan = plan_merge(original, snippet)
        text, finish, generated = await self._decide(plan, req, is_disconnected, t0, required=False)
        return self._answer(req, "chat.completion", text, finish, len(self.tok.encode(content)), generated)

    async def next_edit(self, req: EditRequest, is_disconnected: Disconnected | None = None):
        t0 = arrival()
        content = self._edit_content(req)
        try:
            plan = plan_next_edit(parse_next_edit_prompt(content))
        except InvalidRequestError as e:
            raise _bad(e) from None
        text, finish, generated = await self._decide(plan, req, is_disconnected, t0, required=True)
        return self._answer(req, "edit.completion", text, finish, len(self.tok.encode(content)), generated)

    @staticmethod
    def _asked_max_tokens(req: EditRequest) -> tuple[int | None, str]:
        """(the request's token limit, the field it came from); checked before any merge, so a bad value is a
        400 even for an edit that needs no model call."""
        if req.max_completion_tokens is not None:
            asked, field = req.max_completion_tokens, "max_completion_tokens"
        else:
            asked, field = req.max_tokens, "max_tokens"
        if asked is not None and asked < 1:
            raise APIError(400, f"{field} must be at least 1, got {asked}", param=field)
        return asked, field

    def _edit_content(self, req: EditRequest) -> str:
        self.s._validate(req)
        self._asked_max_tokens(req)
        content = req.user_content()
        if content is None:
            raise APIError(400, "edit endpoints take exactly one user message holding the tagged sections",
                           param="messages")
        return content

    async def _decide(self, plan: EditPlan, req: EditRequest, is_disconnected: Disconnected | None, t0: float,
                      required: bool) -> tuple[str, str, int]:
        """Run one infill per model-decided piece (all at once); returns (answer, finish_reason, tokens generated).

        `required`: the model must be able to infill (next-edit); otherwise (apply-edit) a model that
        cannot leaves every ambiguous piece at its deterministic default."""
        opened = plan.open_pieces()[:MAX_MODEL_REGIONS]
        if not opened:
            return plan.render(), "stop", 0
        try:
            infill_mode(self.spec, self.tok)
        except InvalidRequestError as e:
            if required:  # an edit request has no suffix field: the model cannot serve what its messages ask
                raise APIError(400, str(e), param="messages") from None
            return plan.render(), "stop", 0
        kw = {**self.s.defaults, **req.generation_kwargs()}
        kw.pop("stop", None)          # stop strings would cut a region short
        base, jobs, decode = uuid.uuid4().hex[:16], [], {}
        asked, field = self._asked_max_tokens(req)
        for i in opened:
            piece = plan.pieces[i]
            before, after = plan.context(i)
            seed = req.seed
            if isinstance(piece, Choice):
                job = self._choice_job(f"{base}-{i}", i, piece, before, after, seed, kw)
                if job is None:
                    continue
                jobs.append(job[0])
                decode[i] = job[1]
            else:
                max_tokens = self._max_tokens(asked, REWRITE_MAX_TOKENS, field)
                ip = self._infill(before, after, max_tokens)
                params = self._params(ip, None, max_tokens=max_tokens, seed=seed, **kw)
                jobs.append(Job(i, f"{base}-{i}", ip.prompt_ids, params))
                nxt = plan.pieces[i + 1] if i + 1 < len(plan.pieces) else None
                nxt = nxt.text if isinstance(nxt, Fixed) else ""
                decode[i] = lambda text, nxt=nxt: clean_rewrite(text, nxt)
        if not jobs:
            return plan.render(), "stop", 0
        self.s._admit(len(jobs))
        try:
            states = await self.s._until_done(self.s._collect(jobs, t0), is_disconnected)
        finally:
            self.s._release(len(jobs))
        self.s.metrics.e2e.observe(time.perf_counter() - t0)
        answers = {i: decode[i](st.text) for i, st in states.items()}
        cut = any(st.finish_reason == "length" and isinstance(plan.pieces[i], Rewrite) for i, st in states.items())
        return plan.render(answers), "length" if cut else "stop", sum(st.num_generated for st in states.values())

    def _choice_job(self, rid: str, i: int, piece: Choice, before: str, after: str, seed: int | None, kw: dict):
        """A Choice as a constrained infill, with the function mapping its text back to an option;
        None (keep the default) if the family cannot enforce a choice or the options cannot be posed."""
        ci = choice_infill(before, after, piece.options)
        if ci is None:
            return None
        spec = StructuredSpec("choice", ci.middles, "messages")
        try:
            self.engine.structured_backend().compile(spec)
        except InvalidRequestError:
            return None
        max_tokens = max(len(self.tok.encode(m)) for m in ci.middles) + CHOICE_SLACK
        ip = self._infill(ci.before, ci.after, self._max_tokens(max_tokens, max_tokens))
        params = self._params(ip, None, max_tokens=max_tokens, seed=seed, structured=spec, **kw)

        def decode(text: str) -> str:
            k = ci.option_for(text)
            if k is None:  # detokenization differs slightly: the closest option
                ratio = [difflib.SequenceMatcher(None, m, text).ratio() for m in ci.middles]
                k = ratio.index(max(ratio))
            return piece.options[k]

        return Job(i, rid, ip.prompt_ids, params), decode

    def _answer(self, req: EditRequest, obj: str, text: str, finish: str, prompt_tokens: int, generated: int):
        usage = Usage(prompt_tokens=prompt_tokens, completion_tokens=generated, total_tokens=prompt_tokens + generated)
        rid = f"{'chatcmpl' if obj == 'chat.completion' else 'cmpl'}-{uuid.uuid4().hex}"
        model = self.s.cfg.model_name
        if not req.stream:
            choice = ChatChoice(index=0, message=AssistantMessage(content=text), finish_reason=finish)
            cls = ChatCompletionResponse if obj == "chat.completion" else EditCompletionResponse
            return cls(id=rid, model=model, choices=[choice], usage=usage)
        include_usage = self.s.cfg.force_include_usage or bool(req.stream_options and req.stream_options.include_usage)
        created = int(time.time())

        def chunk(choices, **extra) -> str:
            return sse(ChatCompletionChunk(id=rid, created=created, model=model, choices=choices, **extra))

        async def frames() -> AsyncIterator[str]:  # the answer is complete already: role, content, finish
            yield chunk([ChatChunkChoice(index=0, delta=Delta(role="assistant", content=""))])
            yield chunk([ChatChunkChoice(index=0, delta=Delta(content=text))])
            yield chunk([ChatChunkChoice(index=0, delta=Delta(), finish_reason=finish)])
            if include_usage:
                yield chunk([], usage=usage)
            yield sse("[DONE]")

        return frames()
