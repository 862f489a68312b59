"""Response objects of the chat and completions endpoints, built from engine events: one `_Format` subclass per
endpoint (ids, chunks, logprobs, tool calls, usage), and the SSE framing they share. `serving.py` drives
requests; this module only shapes what they return."""
from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pydantic import BaseModel

from unmask.engine.outputs import StepOutput
from unmask.server.protocol import (
    APIError, AssistantMessage, ChatChoice, ChatChunkChoice, ChatCompletionChunk, ChatCompletionRequest,
    ChatCompletionResponse, ChoiceLogprobs, CompletionChoice, CompletionChunk, CompletionLogprobs,
    CompletionRequest, CompletionResponse, Delta, DeltaFunction, DeltaToolCall, DiffusingFrame, FunctionCall,
    TokenLogprob, ToolCall, TopLogprob, Usage,
)
from unmask.structured.tools import ChatPlan, ToolParser, parse_tool_calls
from unmask.tokenizer import IncrementalDecoder

if TYPE_CHECKING:
    from unmask.server.serving import OpenAIServing


@dataclass
class ChoiceState:
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    finish_reason: str | None = None
    num_generated: int = 0

    def add(self, out: StepOutput) -> None:
        self.text += out.text_delta
        self.token_ids += out.new_token_ids
        self.logprobs += out.new_logprobs or []
        self.top_logprobs += out.new_top_logprobs or []
        self.num_generated = out.num_generated
        if out.finished:
            self.finish_reason = out.finish_reason


def sse(obj: BaseModel | str) -> str:
    return f"data: {obj if isinstance(obj, str) else obj.model_dump_json()}\n\n"


class _Format:
    """Builds one endpoint's response objects; `logprobs` is None when not asked, else the top-k count."""

    id_prefix = ""

    def __init__(self, serving: OpenAIServing, logprobs: int | None):
        self.tok = serving.tok
        self.model = serving.cfg.model_name
        self.id = f"{self.id_prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.logprobs = logprobs

    # stream framing: chat and completions send `data:` lines, then a usage chunk if asked, then [DONE]
    @staticmethod
    def frame(obj: BaseModel | str) -> str:
        return sse(obj)

    def closing(self, states: dict[int, ChoiceState], usage: Usage, include_usage: bool) -> list:
        return [self.usage_chunk(usage)] if include_usage else []

    def failure(self, err: APIError) -> list:
        return [err.response()]

    def trailer(self) -> list:
        return ["[DONE]"]

    def token_strings(self, ids: list[int]) -> list[str]:
        return [self.tok.decode([t], skip_special_tokens=False) for t in ids]

    def alternative_ids(self, tops: list | None, i: int) -> list[int]:
        if not self.logprobs or not tops or i >= len(tops):
            return []
        return [t for t, _ in tops[i][: self.logprobs]]

    def alternatives(self, tops: list | None, i: int) -> list[tuple[str, float]]:
        """The k most likely tokens at output position i as (text, logprob), most likely first."""
        if not self.logprobs or not tops or i >= len(tops):
            return []
        pairs = tops[i][: self.logprobs]
        return list(zip(self.token_strings([t for t, _ in pairs]), [lp for _, lp in pairs]))


class ChatFormat(_Format):
    """Chat responses; with tools, each choice's output goes through a ToolParser (special tokens kept,
    since a tool tag may be one) and comes back as content plus tool_calls."""

    id_prefix = "chatcmpl"

    def __init__(self, serving: OpenAIServing, req: ChatCompletionRequest, plan: ChatPlan | None = None):
        super().__init__(serving, (req.top_logprobs or 0) if req.logprobs else None)
        self.tools = plan.parse if plan is not None else None
        self.parallel = plan.parallel if plan is not None else True
        self.forced = plan.forced if plan is not None else False
        self._parsers: dict[int, ToolParser] = {}
        self._decoders: dict[int, IncrementalDecoder] = {}

    def _logprobs(self, ids: list[int], lps: list[float], tops: list | None) -> ChoiceLogprobs | None:
        if self.logprobs is None:
            return None
        content = []
        for i, (t, s, lp) in enumerate(zip(ids, self.token_strings(ids), lps)):
            top = [TopLogprob(token=a, logprob=alp, bytes=list(self.tok.token_bytes(a_id)))
                   for (a, alp), a_id in zip(self.alternatives(tops, i), self.alternative_ids(tops, i))]
            content.append(TokenLogprob(token=s, logprob=lp, bytes=list(self.tok.token_bytes(t)), top_logprobs=top))
        return ChoiceLogprobs(content=content)

    def _chunk(self, choices: list[ChatChunkChoice], **kw) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=self.id, created=self.created, model=self.model, choices=choices, **kw)

    def opening(self, indices: list[int]) -> list[ChatCompletionChunk]:
        return [self._chunk([ChatChunkChoice(index=i, delta=Delta(role="assistant", content=""))]) for i in indices]

    def chunks(self, index: int, st: ChoiceState, out: StepOutput) -> list[ChatCompletionChunk]:
        if self.tools is not None:
            return self._tool_chunks(index, out)
        if not (out.text_delta or out.finished or (self.logprobs is not None and out.new_token_ids)):
            return []
        delta = Delta(content=out.text_delta) if out.text_delta or not out.finished else Delta()
        return [self._chunk([ChatChunkChoice(index=index, delta=delta,
                                             logprobs=self._logprobs(out.new_token_ids, out.new_logprobs or [],
                                                                     out.new_top_logprobs),
                                             finish_reason=out.finish_reason if out.finished else None)])]

    def _tool_chunks(self, index: int, out: StepOutput) -> list[ChatCompletionChunk]:
        """Content deltas, then per call a first delta (index, id, type, name, arguments "") and argument
        fragments, then exactly one finish chunk (`tool_calls` when a call was made)."""
        parser = self._parsers.setdefault(index, ToolParser(self.tools, self.parallel, forced=self.forced))
        decoder = self._decoders.setdefault(index, IncrementalDecoder(self.tok, skip_special_tokens=False))
        content, deltas = parser.feed(decoder.push(out.new_token_ids))
        if out.finished:
            tail, more = parser.finish()
            content, deltas = content + tail, deltas + more
        pieces = [Delta(content=content)] if content else []
        pieces += [Delta(tool_calls=[DeltaToolCall(
            index=d.index, id=d.id, type="function" if d.id else None,
            function=DeltaFunction(name=d.name, arguments=d.arguments))]) for d in deltas]
        logprobs = self._logprobs(out.new_token_ids, out.new_logprobs or [], out.new_top_logprobs)
        if logprobs is not None and out.new_token_ids and not pieces:
            pieces = [Delta()]
        chunks = [self._chunk([ChatChunkChoice(index=index, delta=d, logprobs=logprobs if i == 0 else None)])
                  for i, d in enumerate(pieces)]
        if out.finished:
            reason = "tool_calls" if parser.calls and out.finish_reason == "stop" else out.finish_reason
            chunks.append(self._chunk([ChatChunkChoice(index=index, delta=Delta(), finish_reason=reason)]))
        return chunks

    def diffusing(self, frame: DiffusingFrame) -> ChatCompletionChunk:
        return self._chunk([], diffusing=frame)

    def usage_chunk(self, usage: Usage) -> ChatCompletionChunk:
        return self._chunk([], usage=usage)

    def response(self, states: dict[int, ChoiceState], usage: Usage) -> ChatCompletionResponse:
        choices = [self._choice(i, st) for i, st in sorted(states.items())]
        return ChatCompletionResponse(id=self.id, created=self.created, model=self.model, choices=choices,
                                      usage=usage)

    def _choice(self, index: int, st: ChoiceState) -> ChatChoice:
        logprobs = self._logprobs(st.token_ids, st.logprobs, st.top_logprobs)
        if self.tools is None:
            return ChatChoice(index=index, message=AssistantMessage(content=st.text), logprobs=logprobs,
                              finish_reason=st.finish_reason)
        text = self.tok.decode(st.token_ids, skip_special_tokens=False)
        content, calls = parse_tool_calls(text, self.tools, self.parallel, forced=self.forced)
        message = AssistantMessage(content=content if content or calls else "", tool_calls=[
            ToolCall(id=c.id, function=FunctionCall(name=c.name, arguments=c.arguments)) for c in calls] or None)
        reason = "tool_calls" if calls and st.finish_reason == "stop" else st.finish_reason
        return ChatChoice(index=index, message=message, logprobs=logprobs, finish_reason=reason)


class CompletionFormat(_Format):
    id_prefix = "cmpl"

    def __init__(self, serving: OpenAIServing, req: CompletionRequest, prompt_texts: list[str]):
        super().__init__(serving, req.logprobs)
        self.n = req.n
        self.echo = [t if req.echo else "" for t in prompt_texts]

    def _prefix(self, index: int) -> str:
        return self.echo[index // self.n]

    def _logprobs(self, ids: list[int], lps: list[float], offset: int, tops: list | None) -> CompletionLogprobs | None:
        if self.logprobs is None:
            return None
        tokens = self.token_strings(ids)
        offsets = []
        for s in tokens:
            offsets.append(offset)
            offset += len(s)
        # legacy shape: one {token text: logprob} object per position (texts that decode alike merge)
        top = [dict(self.alternatives(tops, i)) for i in range(len(tokens))] if self.logprobs else None
        return CompletionLogprobs(tokens=tokens, token_logprobs=list(lps), top_logprobs=top, text_offset=offsets)

    def _chunk(self, choices: list[CompletionChoice], **kw) -> CompletionChunk:
        return CompletionChunk(id=self.id, created=self.created, model=self.model, choices=choices, **kw)

    def opening(self, indices: list[int]) -> list[CompletionChunk]:
        return [self._chunk([CompletionChoice(index=i, text=self._prefix(i))]) for i in indices if self._prefix(i)]

    def chunks(self, index: int, st: ChoiceState, out: StepOutput) -> list[CompletionChunk]:
        if out.text_delta or out.finished or (self.logprobs is not None and out.new_token_ids):
            return [self.chunk(index, st, out)]
        return []

    def chunk(self, index: int, st: ChoiceState, out: StepOutput) -> CompletionChunk:
        offset = len(self._prefix(index)) + len(st.text) - len(out.text_delta)
        return self._chunk([CompletionChoice(index=index, text=out.text_delta,
                                             logprobs=self._logprobs(out.new_token_ids, out.new_logprobs or [], offset,
                                                                     out.new_top_logprobs),
                                             finish_reason=out.finish_reason if out.finished else None)])

    def diffusing(self, frame: DiffusingFrame) -> CompletionChunk:
        return self._chunk([], diffusing=frame)

    def usage_chunk(self, usage: Usage) -> CompletionChunk:
        return self._chunk([], usage=usage)

    def response(self, states: dict[int, ChoiceState], usage: Usage) -> CompletionResponse:
        choices = [CompletionChoice(index=i, text=self._prefix(i) + st.text,
                                    logprobs=self._logprobs(st.token_ids, st.logprobs, len(self._prefix(i)),
                                                            st.top_logprobs),
                                    finish_reason=st.finish_reason)
                   for i, st in sorted(states.items())]
        return CompletionResponse(id=self.id, created=self.created, model=self.model, choices=choices, usage=usage)
