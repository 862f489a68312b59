"""What chat, completions and edits send back: response bodies, stream chunks, usage and logprobs
(OpenAI's field order; unmask's extensions fenced off at the end of each model). Re-exported by
unmask.server.protocol, where the requests are."""
from __future__ import annotations

import time
from typing import Any, ClassVar, Literal

from pydantic import Field

from unmask.server.protocol_base import ResponseModel


class Usage(ResponseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class TopLogprob(ResponseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(ResponseModel):
    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[TopLogprob]


class ChoiceLogprobs(ResponseModel):
    content: list[TokenLogprob]


class FunctionCall(ResponseModel):
    name: str
    arguments: str      # JSON text, as the model wrote it


class ToolCall(ResponseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class AssistantMessage(ResponseModel):
    _omit_if_none = frozenset({"tool_calls", "annotations"})
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCall] | None = None
    annotations: list[dict[str, Any]] | None = None   # file_citation, with a file_search tool (unmask.retrieval)


class ChatChoice(ResponseModel):
    index: int
    message: AssistantMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None


class ChatCompletionResponse(ResponseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage


class DeltaFunction(ResponseModel):
    _omit_if_none = frozenset({"name", "arguments"})
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(ResponseModel):
    """A call's first delta carries index, id, type, name and arguments ""; later ones index and arguments."""

    _omit_if_none = frozenset({"id", "type"})
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunction


class Delta(ResponseModel):
    _omit_if_none = frozenset({"role", "content", "tool_calls"})
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatChunkChoice(ResponseModel):
    index: int
    delta: Delta
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None = None


class DiffusingFrame(ResponseModel):
    """unmask extension: the full current text of choice `index`, masked positions shown as "░".

    Each frame replaces the previous one; frames carry `choices: []` so clients that do not ask
    for them (or skip chunks without choices, like the usage chunk) never mistake them for content.
    """

    index: int
    text: str
    masked: int
    forwards: int | None = None  # forwards this choice has taken part in so far, prefill included
    # with edit_threshold / remask_budget: committed tokens replaced / remasked so far (left out when neither is on)
    edits: int | None = None
    remasks: int | None = None
    # [start, end) offsets in `text` (code points) of the tokens committed since the previous frame, and of those
    # this step replaced or put back to mask (server/frames.py)
    committed: list[list[int]] = []
    edited: list[list[int]] = []

    _omit_if_none: ClassVar[frozenset[str]] = frozenset({"forwards", "edits", "remasks"})


class ChatCompletionChunk(ResponseModel):
    _omit_if_none = frozenset({"usage", "diffusing"})
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    # ---- unmask extension
    diffusing: DiffusingFrame | None = None


class EditCompletionResponse(ResponseModel):
    """Next-edit answer: the chat shape with object `edit.completion` (as the closed diffusion API)."""

    id: str
    object: Literal["edit.completion"] = "edit.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage


class CompletionLogprobs(ResponseModel):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]] | None
    text_offset: list[int]


class CompletionChoice(ResponseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class CompletionResponse(ResponseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class CompletionChunk(ResponseModel):
    _omit_if_none = frozenset({"usage", "diffusing"})
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    # ---- unmask extension
    diffusing: DiffusingFrame | None = None
