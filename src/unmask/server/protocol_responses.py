"""Request and response models of the OpenAI Responses API (POST /v1/responses), stateless.

The shared pieces (RequestModel, ResponseModel, TokenLogprob, the extension field lists) live in
unmask.server.protocol; unmask.server.serving_responses turns these requests into chat requests.
"""
from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from unmask.server.protocol import (DRY_FIELDS, EDIT_FIELDS, POLICY_FIELDS, REFERENCE_SWITCHES, UNIFORM_FIELDS,
                                    RequestModel, ResponseModel, TokenLogprob)


# chat-request fields a /v1/responses request may also set (unmask's and vLLM's extensions): passed through as they are
RESPONSES_PASSTHROUGH = ("seed", "stop", "frequency_penalty", "presence_penalty", "repetition_penalty", "logit_bias",
                         "top_k", *DRY_FIELDS, "policy", "threshold", "steps", "factor", "tokens_per_step", *POLICY_FIELDS,
                         "block_size", "small_block_size", "multi_block_threshold", "draft_all_outcomes", "draft_lookup",
                         "draft_ngrams", *REFERENCE_SWITCHES, *EDIT_FIELDS,
                         "ignore_eos", "min_tokens", *UNIFORM_FIELDS, "regex", "choice", "grammar", "diffusing")


class ResponsesRequest(RequestModel):
    """POST /v1/responses, stateless: the whole conversation comes in `input` every time (as with `store: false`).

    Items are checked and turned into chat messages by unmask.server.serving_responses; fields in
    RESPONSES_PASSTHROUGH arrive as extra fields and go to the chat request unchanged."""

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    background: bool | None = None
    conversation: str | dict[str, Any] | None = None
    include: list[str] | None = None
    max_output_tokens: int | None = None
    max_tool_calls: int | None = None
    metadata: dict[str, str] | None = None
    parallel_tool_calls: bool | None = None
    previous_response_id: str | None = None
    prompt: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    store: bool | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    temperature: float | None = None
    text: dict[str, Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    top_p: float | None = None
    truncation: Literal["auto", "disabled"] | None = None
    user: str | None = None

    def unsupported(self) -> tuple[str, str] | None:
        """(param, reason) of the first field whose meaning a stateless server cannot honour."""
        stateless = "this server keeps no responses or conversations: send the whole conversation in `input`"
        if self.previous_response_id is not None:
            return "previous_response_id", f"previous_response_id is not supported; {stateless}"
        if self.conversation is not None:
            return "conversation", f"conversation is not supported; {stateless}"
        if self.background:
            return "background", "background responses are not supported (they need stored responses)"
        if self.prompt is not None:
            return "prompt", "stored prompt templates are not supported; send the instructions and input instead"
        return None

    def passthrough(self) -> dict[str, Any]:
        extra = self.model_extra or {}
        return {k: extra[k] for k in RESPONSES_PASSTHROUGH if k in extra}

    def ignored_fields(self) -> list[str]:
        return sorted(set(self.model_extra or {}) - set(RESPONSES_PASSTHROUGH))


class ResponseOutputText(ResponseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[TokenLogprob] = Field(default_factory=list)


class ResponseMessageItem(ResponseModel):
    id: str
    type: Literal["message"] = "message"
    status: Literal["in_progress", "completed", "incomplete"]
    role: Literal["assistant"] = "assistant"
    content: list[ResponseOutputText]


class ResponseFunctionCallItem(ResponseModel):
    id: str
    type: Literal["function_call"] = "function_call"
    status: Literal["in_progress", "completed", "incomplete"]
    call_id: str
    name: str
    arguments: str


class ResponseFileSearchCallItem(ResponseModel):
    """The file_search tool's call (unmask.retrieval.file_search); `results` only when `include` asks for them."""

    id: str
    type: Literal["file_search_call"] = "file_search_call"
    status: Literal["in_progress", "searching", "completed", "incomplete", "failed"]
    queries: list[str]
    results: list[dict[str, Any]] | None = None


class ResponseUsage(ResponseModel):
    input_tokens: int
    input_tokens_details: dict[str, int] = Field(default_factory=lambda: {"cached_tokens": 0})
    output_tokens: int
    output_tokens_details: dict[str, int] = Field(default_factory=lambda: {"reasoning_tokens": 0})
    total_tokens: int


class ResponseObject(ResponseModel):
    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: Literal["in_progress", "completed", "incomplete", "failed"]
    error: dict[str, Any] | None = None
    incomplete_details: dict[str, Any] | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    model: str
    output: list[ResponseMessageItem | ResponseFunctionCallItem | ResponseFileSearchCallItem]
    parallel_tool_calls: bool = True
    previous_response_id: str | None = None
    reasoning: dict[str, Any] | None = None
    store: bool = False
    max_tool_calls: int | None = None
    temperature: float | None = None
    text: dict[str, Any] = Field(default_factory=lambda: {"format": {"type": "text"}})
    tool_choice: str | dict[str, Any] = "auto"
    tools: list[dict[str, Any]] = Field(default_factory=list)
    top_p: float | None = None
    truncation: str = "disabled"
    usage: ResponseUsage | None = None
    user: str | None = None
    metadata: dict[str, str] = Field(default_factory=dict)
