"""Request handling of the OpenAI-compatible API: engine types in, response objects or SSE text out.

No web framework here. A route hands over a parsed request and an `is_disconnected` callable and
gets back either a response model or an async iterator of SSE frames. A stream is started before
it is returned, so admission errors (429) are raised while the HTTP status can still say so.

Each choice of a request is one engine request (`Job`); `n > 1` and batched completion prompts
submit several and merge their events. Admission is counted here, in engine requests: at most
`max_num_seqs` run and `max_queue` wait; one more is refused at once with 429 and Retry-After.
"""
from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from contextvars import ContextVar
from dataclasses import dataclass

from pydantic import BaseModel

from unmask.engine.async_engine import AsyncEngine, EngineDeadError, QueueFullError
from unmask.engine.llm import LLM
from unmask.engine.outputs import StepOutput
from unmask.engine.params import INTERACTIVE_PRIORITY, GenerationParams, sampling_defaults
from unmask.errors import ContextLengthError, InvalidRequestError, UnmaskError
from unmask.server import chat_history, logsafe
from unmask.server.admission import Admission
from unmask.server.formats import ChatFormat, ChoiceState, CompletionFormat, _Format
from unmask.server.frames import render_frame
from unmask.server.metrics import Metrics, arrival
from unmask.server.protocol import (
    APIError, ChatCompletionRequest, CompletionRequest, DetokenizeRequest, DetokenizeResponse, DiffusingFrame,
    ModelCard, ModelList, TokenizeRequest, TokenizeResponse, TokenPiece, Usage,
)
from unmask.structured import StructuredSpec, from_request
from unmask.structured.tools import ChatPlan, history_as_text, plan_chat, special_tags, tool_format

logger = logging.getLogger("unmask.server")

DISCONNECT_POLL_S = 0.1      # how often a non-streamed request checks that its client is still there

Disconnected = Callable[[], Awaitable[bool]]
# the engine priority of the requests submitted from this context: the batch runner (unmask.batch) sets
# BATCH_PRIORITY in its tasks, so its lines run through this same code below interactive requests
request_priority: ContextVar[int] = ContextVar("unmask_request_priority", default=INTERACTIVE_PRIORITY)


@dataclass
class ServingConfig:
    model_name: str
    max_num_seqs: int = 64
    max_queue: int = 256
    max_prompt_tokens: int | None = None     # None: the model's context
    default_max_tokens: int = 1024           # when a request names none (capped by the context left)
    force_include_usage: bool = False


@dataclass
class Job:
    """One engine request: choice `index` of an API request."""

    index: int
    request_id: str
    prompt_ids: list[int]
    params: GenerationParams


def log_ignored_fields(req: BaseModel) -> None:
    """Log the unknown fields a request carries (their names escaped and capped: clients choose them)."""
    if req.model_extra:
        logger.info("ignoring unknown request fields: %s", logsafe.names(sorted(req.model_extra)))


def as_api_error(e: Exception) -> APIError:
    if isinstance(e, APIError):
        return e
    if isinstance(e, QueueFullError):
        return APIError(429, str(e), code="queue_full", headers={"Retry-After": "1"})
    if isinstance(e, InvalidRequestError):  # over the context, or over what memory holds (MemoryLimitError)
        code = "context_length_exceeded" if isinstance(e, ContextLengthError) else None
        return APIError(400, str(e), param=e.param, code=code)
    if isinstance(e, EngineDeadError):
        return APIError(503, str(e), code="engine_dead")
    if isinstance(e, UnmaskError):
        return APIError(500, str(e))
    raise e


class OpenAIServing:
    def __init__(self, llm: LLM, engine: AsyncEngine, metrics: Metrics, cfg: ServingConfig):
        self.llm, self.engine, self.metrics, self.cfg = llm, engine, metrics, cfg
        self.tok, self.spec = llm.tokenizer, llm.spec
        self.defaults = sampling_defaults(llm.spec.generation_config)
        self.chat_defaults = sampling_defaults(llm.spec.generation_config, chat=True)
        self.admission = Admission(cfg.max_num_seqs, cfg.max_queue)   # the one count (admission.py)
        self.created = int(time.time())
        self._template_tools: bool | None = None   # does the chat template render `tools`? (probed once)

    @property
    def capacity(self) -> int:
        return self.admission.capacity

    @property
    def inflight(self) -> int:
        """Engine requests admitted and not yet released."""
        return self.admission.inflight

    # ------------------------------------------------------------------ models
    def models(self) -> ModelList:
        return ModelList(data=[self.model_card()])

    def model_card(self, model_id: str | None = None) -> ModelCard:
        if model_id is not None:
            self._check_model(model_id)
        return ModelCard(id=self.cfg.model_name, created=self.created, max_model_len=self.spec.max_context)

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.cfg.model_name:
            raise APIError(404, f"model {model!r} does not exist; this server serves {self.cfg.model_name!r}",
                           param="model", code="model_not_found")

    # ------------------------------------------------------------------ endpoints
    async def chat(self, req: ChatCompletionRequest, is_disconnected: Disconnected | None = None):
        t0 = arrival()
        self._validate(req)
        plan, prompts, jobs = self.chat_jobs(req)
        return await self._run(ChatFormat(self, req, plan), jobs, req, prompts, is_disconnected, t0)

    def chat_jobs(self, req: ChatCompletionRequest, param: str = "messages") -> tuple[ChatPlan, list[list[int]],
                                                                                      list[Job]]:
        """A validated chat request -> (tool/constraint plan, [prompt ids], engine jobs); 400s on bad input."""
        plan, prompt = self.chat_prompt(req, param)
        return plan, [prompt], self._jobs([prompt], req, param, plan.structured)

    def chat_prompt(self, req: ChatCompletionRequest, param: str = "messages",
                    add_generation_prompt: bool = True) -> tuple[ChatPlan, list[int]]:
        """The plan (tools, constraint, parser) and the prompt token ids a chat request is answered from."""
        if not req.messages:
            raise APIError(400, f"{param} must not be empty", param=param)
        chat_history.check_tool_calls(req.messages, param)
        plan = self._chat_plan(req)
        text = chat_history.render(self.tok, plan.messages, plan.template_tools, add_generation_prompt, param,
                                   source=req.messages if param == "messages" else None)  # else not the client's
        return plan, self.tok.encode(text)

    # ------------------------------------------------------------------ tokenizer
    def tokenize(self, req: TokenizeRequest) -> TokenizeResponse:
        """The token ids an endpoint would feed the model: a completion prompt as /v1/completions encodes it,
        messages (and tools) as /v1/chat/completions renders and encodes them."""
        self._check_model(req.model)
        given = [name for name in ("prompt", "content", "messages") if getattr(req, name) is not None]
        if len(given) != 1:
            raise APIError(400, "send exactly one of prompt, content (llama.cpp's name) or messages",
                           param=given[1] if len(given) > 1 else "prompt")
        if req.messages is not None:
            chat = ChatCompletionRequest(messages=req.messages, tools=req.tools)
            ids = self.chat_prompt(chat, add_generation_prompt=req.add_generation_prompt)[1]
        else:
            ids = self.tok.encode(req.prompt if req.prompt is not None else req.content)
        pieces = [self.tok.decode([t], skip_special_tokens=False) for t in ids] if (
            req.return_token_strs or req.with_pieces) else None
        tokens = [TokenPiece(id=t, piece=p) for t, p in zip(ids, pieces)] if req.with_pieces else ids
        return TokenizeResponse(tokens=tokens, count=len(ids), max_model_len=self.spec.max_context,
                                token_strs=pieces if req.return_token_strs else None)

    def detokenize(self, req: DetokenizeRequest) -> DetokenizeResponse:
        self._check_model(req.model)
        vocab = self.spec.arch.vocab_size
        bad = next((t for t in req.tokens if t < 0 or t >= vocab), None)
        if bad is not None:
            raise APIError(400, f"token id {bad} is outside this model's vocabulary [0, {vocab})", param="tokens")
        text = self.tok.decode(req.tokens, skip_special_tokens=False)
        return DetokenizeResponse(prompt=text, content=text)

    def _chat_plan(self, req: ChatCompletionRequest) -> ChatPlan:
        """Tools, tool_choice and output constraints -> prompt messages, constraint, parser (400 on errors)."""
        messages = [m.to_template() for m in req.messages]
        try:
            content = from_request(req.response_format, req.regex, req.choice, req.grammar)
            if not req.tools and req.tool_choice in (None, "none", "auto"):
                if not self._template_renders_tools() and any(m["role"] == "tool" or m.get("tool_calls")
                                                               for m in messages):
                    messages = history_as_text(messages, tool_format(self.spec.family.name))
                return ChatPlan(messages, None, content, None)
            plan = plan_chat(messages, req.tools, req.tool_choice, req.parallel_tool_calls, content,
                             self.spec.family.name, self._template_renders_tools(),
                             special_tags(self.tok, tool_format(self.spec.family.name)))
            for spec in plan.param_specs or []:  # a schema error names its tool
                self.llm.engine.structured_backend().compile(spec)
        except InvalidRequestError as e:
            raise APIError(400, str(e), param=e.param) from None
        return plan

    def _template_renders_tools(self) -> bool:
        if self._template_tools is None:
            probe = {"type": "function", "function": {"name": "unmask_probe_tool", "parameters": {"type": "object"}}}
            try:
                text = self.tok.apply_chat_template([{"role": "user", "content": "hi"}], tools=[probe])
            except Exception:  # noqa: BLE001 - a template that fails on tools does not render them
                text = ""
            self._template_tools = "unmask_probe_tool" in text
        return self._template_tools

    async def completion(self, req: CompletionRequest, is_disconnected: Disconnected | None = None):
        t0 = arrival()
        self._validate(req)
        prompts = [self.tok.encode(p) if isinstance(p, str) else list(p) for p in req.prompts()]
        if not prompts:
            raise APIError(400, "the prompt is empty", param="prompt")
        vocab = self.spec.arch.vocab_size
        if any(t < 0 or t >= vocab for ids in prompts for t in ids):
            raise APIError(400, f"prompt token ids must be in [0, {vocab})", param="prompt")
        fmt = CompletionFormat(self, req, [self.tok.decode(ids) for ids in prompts])
        try:
            structured = from_request(req.response_format, req.regex, req.choice, req.grammar)
        except InvalidRequestError as e:
            raise APIError(400, str(e), param=e.param) from None
        return await self._run(fmt, self._jobs(prompts, req, "prompt", structured), req, prompts, is_disconnected, t0)

    # ------------------------------------------------------------------ request -> jobs
    def _validate(self, req: ChatCompletionRequest | CompletionRequest) -> None:
        self._check_model(req.model)
        bad = req.unsupported()
        if bad:
            raise APIError(400, bad[1], param=bad[0], code="unsupported")
        log_ignored_fields(req)

    def _jobs(self, prompts: list[list[int]], req, prompt_param: str,
              structured: StructuredSpec | None = None) -> list[Job]:
        if len(prompts) * req.n > self.capacity:
            raise APIError(400, f"{len(prompts) * req.n} choices requested; this server holds at most "
                                f"{self.capacity} requests (--max-num-seqs + --max-queue)",
                           param="n" if req.n > 1 else prompt_param)  # the field that made it too many
        defaults = self.chat_defaults if isinstance(req, ChatCompletionRequest) else self.defaults
        kw = {**defaults, **req.generation_kwargs()}
        if structured is not None:
            try:  # compiled here so that a stream can still answer 400 (the engine reuses the compiled grammar)
                self.llm.engine.structured_backend().compile(structured)
            except InvalidRequestError as e:
                raise APIError(400, str(e), param=e.param) from None
            kw["structured"] = structured
        logprobs = bool(req.logprobs) if isinstance(req, ChatCompletionRequest) else req.logprobs is not None
        top_k = (req.top_logprobs or 0) if isinstance(req, ChatCompletionRequest) else (req.logprobs or 0)
        base = uuid.uuid4().hex[:16]
        jobs = []
        for p, ids in enumerate(prompts):
            max_tokens = self._max_tokens(req, len(ids), prompt_param)
            for j in range(req.n):
                seed = None if req.seed is None else (req.seed + j) % 2**63
                try:
                    params = GenerationParams(max_tokens=max_tokens, seed=seed, logprobs=logprobs,
                                              top_logprobs=top_k if logprobs else 0,
                                              snapshots=req.diffusing and req.stream,
                                              priority=request_priority.get(), **kw)
                except InvalidRequestError as e:
                    raise APIError(400, str(e), param=e.param) from None
                index = p * req.n + j
                jobs.append(Job(index, f"{base}-{index}", ids, params))
        return jobs

    def _max_tokens(self, req, n_prompt: int, prompt_param: str) -> int:
        ctx = self.spec.max_context
        limit = min(self.cfg.max_prompt_tokens or ctx, ctx)
        if n_prompt == 0:
            raise APIError(400, "the prompt is empty", param=prompt_param)
        if n_prompt > limit:
            raise APIError(400, f"the prompt has {n_prompt} tokens, over this server's limit of {limit} "
                                "prompt tokens (--max-prompt-tokens, at most the model's context)",
                           param=prompt_param, code="context_length_exceeded")
        asked = getattr(req, "max_completion_tokens", None)
        field = "max_tokens" if asked is None else "max_completion_tokens"  # errors name the field the client sent
        asked = req.max_tokens if asked is None else asked
        room = ctx - n_prompt
        if asked is None:
            if room < 1:
                raise APIError(400, f"the prompt ({n_prompt} tokens) fills this model's context of {ctx}",
                               param=prompt_param, code="context_length_exceeded")
            return min(self.cfg.default_max_tokens, room)
        if asked < 1:
            raise APIError(400, f"{field} must be at least 1, got {asked}", param=field)
        if asked > room:
            raise APIError(400, f"the prompt ({n_prompt} tokens) plus {field} ({asked}) is over this model's "
                                f"context of {ctx} tokens", param=field, code="context_length_exceeded")
        return asked

    # ------------------------------------------------------------------ running jobs
    async def _run(self, fmt: _Format, jobs: list[Job], req, prompts: list[list[int]],
                   is_disconnected: Disconnected | None, t0: float):
        prompt_tokens = sum(map(len, prompts))
        if req.stream:
            asked = bool(req.stream_options and req.stream_options.include_usage)
            include_usage = self.cfg.force_include_usage or asked
            stream = self._stream(fmt, jobs, prompt_tokens, include_usage, req.diffusing, t0)
            await anext(stream)  # admission: raises 429 here, before the response starts
            return stream
        self._admit(len(jobs))
        try:
            states = await self._until_done(self._collect(jobs, t0), is_disconnected)
        finally:
            self._release(len(jobs))
        self.metrics.e2e.observe(time.perf_counter() - t0)
        return fmt.response(states, self._usage(prompt_tokens, states))

    def _admit(self, n: int) -> None:
        # batch lines are bounded by the batch runner, not counted here: a batch never takes an interactive slot
        if request_priority.get() == INTERACTIVE_PRIORITY:
            self.admission.acquire(n)   # 429 when they do not fit

    def _release(self, n: int) -> None:
        if request_priority.get() == INTERACTIVE_PRIORITY:
            self.admission.release(n)

    async def _events(self, jobs: list[Job], t0: float) -> AsyncIterator[tuple[int, StepOutput]]:
        """Every job's engine events as (choice index, event). Closing it early aborts the jobs."""
        queue: asyncio.Queue = asyncio.Queue()
        tasks = [asyncio.create_task(self._drive(job, queue, t0)) for job in jobs]
        left = len(tasks)
        try:
            while left:
                index, item = await queue.get()
                if item is None:
                    left -= 1
                elif isinstance(item, BaseException):
                    raise item
                elif item.finish_reason == "abort":
                    raise APIError(503, "the request was aborted (the server is shutting down)")
                else:
                    yield index, item
        except (asyncio.CancelledError, GeneratorExit):  # counted by the caller (one outcome per request)
            logger.info("aborted request %s: the client went away", jobs[0].request_id.rsplit("-", 1)[0])  # engine id
            raise
        finally:
            for t in tasks:
                t.cancel()  # a cancelled engine generator aborts its request before the next step

    async def _drive(self, job: Job, queue: asyncio.Queue, t0: float) -> None:
        m = self.metrics
        m.prompt_tokens.inc(len(job.prompt_ids))
        first = True
        try:
            async for out in self.engine.generate(job.prompt_ids, job.params, request_id=job.request_id):
                if out.new_token_ids:
                    if first:
                        m.ttft.observe(time.perf_counter() - t0)
                        first = False
                    m.generation_tokens.inc(len(out.new_token_ids))
                if out.finished and out.finish_reason != "abort":
                    m.tokens_per_forward.observe(out.num_generated / max(out.forwards, 1))
                queue.put_nowait((job.index, out))
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - handed to the consumer, which reports it
            queue.put_nowait((job.index, e))
        else:
            queue.put_nowait((job.index, None))

    async def _collect(self, jobs: list[Job], t0: float) -> dict[int, ChoiceState]:
        states = {job.index: ChoiceState() for job in jobs}
        try:
            async with aclosing(self._events(jobs, t0)) as events:
                async for index, out in events:
                    states[index].add(out)
        except Exception as e:  # noqa: BLE001 - engine errors become API errors; others propagate
            raise as_api_error(e) from None
        return states

    async def _until_done(self, coro, is_disconnected: Disconnected | None):
        """Await `coro`, cancelling it if the client goes away first (counted as a cancellation)."""
        task = asyncio.ensure_future(coro)
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
                if done:
                    return task.result()
                if is_disconnected is not None and await is_disconnected():
                    self.metrics.cancellations.inc()
                    raise APIError(499, "the client disconnected")   # not counted again as an error
        finally:
            task.cancel()

    async def _stream(self, fmt: _Format, jobs: list[Job], prompt_tokens: int, include_usage: bool,
                      diffusing: bool, t0: float) -> AsyncIterator[str]:
        self._admit(len(jobs))
        try:
            yield ""  # admitted; the caller primes the stream up to here
            states = {job.index: ChoiceState() for job in jobs}
            shown: dict[int, list[int]] = {}     # each choice's last `diffusing` snapshot
            waiting = set(states)                # choices whose first chunk with text is still to come
            for chunk in fmt.opening(sorted(states)):
                yield fmt.frame(chunk)
            async with aclosing(self._events(jobs, t0)) as events:
                async for index, out in events:
                    st = states[index]
                    st.add(out)
                    for chunk in fmt.chunks(index, st, out):
                        if index in waiting and _carries_text(chunk):
                            waiting.discard(index)
                            self.metrics.ttfc.observe(time.perf_counter() - t0)
                        yield fmt.frame(chunk)
                    if diffusing and out.snapshot is not None:
                        revised = ({"edits": out.edits, "remasks": out.remasks}
                                   if out.edits or out.remasks or out.edited else {})
                        view = render_frame(self.tok.decode, self.spec.mask_id, out.snapshot, shown.get(index),
                                            out.edited or ())
                        shown[index] = out.snapshot
                        yield fmt.frame(fmt.diffusing(DiffusingFrame(index=index, **view, forwards=out.forwards,
                                                                     **revised)))
            for chunk in fmt.closing(states, self._usage(prompt_tokens, states), include_usage):
                yield fmt.frame(chunk)
            self.metrics.e2e.observe(time.perf_counter() - t0)
        except (asyncio.CancelledError, GeneratorExit):
            # the client went away (or the web layer dropped the stream) at any point before the end: one
            # cancellation, whether or not the engine requests had started (an error frame is counted below)
            self.metrics.cancellations.inc()
            raise
        except Exception as e:  # noqa: BLE001 - a stream reports its error in-band, then its end marker
            try:
                err = as_api_error(e)
            except Exception:  # noqa: BLE001
                logger.exception("request failed while streaming")
                err = APIError(500, "internal server error")
            self.metrics.error(err.status)
            for chunk in fmt.failure(err):
                yield fmt.frame(chunk)
        finally:
            self._release(len(jobs))
        for chunk in fmt.trailer():
            yield fmt.frame(chunk)

    # ------------------------------------------------------------------ helpers
    @staticmethod
    def _usage(prompt_tokens: int, states: dict[int, ChoiceState]) -> Usage:
        completion = sum(s.num_generated for s in states.values())
        return Usage(prompt_tokens=prompt_tokens, completion_tokens=completion, total_tokens=prompt_tokens + completion)


def _carries_text(chunk) -> bool:
    """Whether a chat or completions chunk carries generated output (content, tool call or text), as a client's
    TTFT counts it (unmask.loadtest.client); other formats' events are not counted."""
    for c in getattr(chunk, "choices", None) or ():
        delta = getattr(c, "delta", None)
        if (delta.content or delta.tool_calls) if delta is not None else getattr(c, "text", None):
            return True
    return False
