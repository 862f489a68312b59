"""Wire types of the OpenAI-compatible API.

Fields follow the order of OpenAI's API reference; unmask's own extensions are fenced off: those chat
and completions share in `GenerationRequest`, the rest at the end of each model. Requests accept unknown fields (`extra="allow"`, listed by `ignored_fields`) so
that clients sending newer OpenAI fields keep working, but types are strict: `"5"` is not an
integer. Fields that would change the meaning of a request and that unmask does not implement
(best_of other than n, echo with logprobs, ...) are declared so that `unsupported()` can reject them
with a 400 instead of silently ignoring them. Tools and structured outputs are checked and compiled by
unmask.structured (an unenforceable schema is a 400 naming the feature).
"""
from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import Field, field_validator

# the error envelope, the bases and the response models live beside this module; importing them from here
# keeps working (this module holds the requests)
from unmask.server.protocol_base import (ERROR_TYPES, APIError, ErrorInfo, ErrorResponse,  # noqa: F401
                                         RequestModel, ResponseModel)
from unmask.server.protocol_replies import (AssistantMessage, ChatChoice, ChatChunkChoice,  # noqa: F401
                                            ChatCompletionChunk, ChatCompletionResponse, ChoiceLogprobs,
                                            CompletionChoice, CompletionChunk, CompletionLogprobs,
                                            CompletionResponse, Delta, DeltaFunction, DeltaToolCall, DiffusingFrame,
                                            EditCompletionResponse, FunctionCall, TokenLogprob, ToolCall,
                                            TopLogprob, Usage)

ReasoningEffort = Literal["instant", "low", "medium", "high", "minimal", "none"]


class StreamOptions(RequestModel):
    include_usage: bool = False


# reasoning_effort trades speed for quality through the unmasking threshold: a lower threshold
# commits more tokens per forward (faster, more errors). Explicit policy/threshold/steps win.
REASONING_EFFORT: dict[str, dict[str, Any]] = {
    "instant": {"policy": "threshold", "threshold": 0.7},
    "low": {"policy": "threshold", "threshold": 0.8},
    "medium": {"policy": "threshold", "threshold": 0.9},
    "high": {"policy": "threshold", "threshold": 0.95},
}
EFFORT_ALIASES = {"minimal": "instant", "none": "instant"}  # OpenAI's lowest levels


# uniform-noise decoding (DiffusionGemma): entropy-bound acceptance, temperature schedule, stop rule
DRY_FIELDS = ("dry_multiplier", "dry_base", "dry_allowed_length", "dry_penalty_last_n", "dry_sequence_breakers")
UNIFORM_FIELDS = ("entropy_bound", "t_min", "t_max", "stability_threshold", "confidence_threshold", "uniform_draws")
# policy knobs past threshold / steps / factor / tokens_per_step (docs/decoding.md)
POLICY_FIELDS = ("alg_temp", "credit_decay", "credit_gamma", "credit_weight")
REFERENCE_SWITCHES = ("greedy_filters", "empty_steps", "full_last_block", "ordered_stops")  # null: the model's default
EDIT_FIELDS = ("edit_threshold", "max_post_edit_steps", "remask_budget", "remask_threshold")  # revising; null: off


class GenerationRequest(RequestModel):
    """Shared by both endpoints: unmask's extension fields that chat and completions both take, and how a
    request's fields become engine `GenerationParams` fields."""

    top_k: int | None = None
    repetition_penalty: float | None = None   # vLLM's extra sampling parameter
    # llama.cpp server's DRY loop penalty (unmask.decoding.dry)
    dry_multiplier: float | None = None
    dry_base: float | None = None
    dry_allowed_length: int | None = None
    dry_penalty_last_n: int | None = None
    dry_sequence_breakers: list[str] | None = None
    diffusing: bool = False
    policy: str | None = None
    threshold: float | None = None
    steps: int | None = None
    factor: float | None = None
    tokens_per_step: int | None = None
    alg_temp: float | None = None
    credit_decay: float | None = None
    credit_gamma: float | None = None
    credit_weight: float | None = None
    block_size: int | None = None
    small_block_size: int | None = None
    multi_block_threshold: float | None = None
    draft_all_outcomes: bool | None = None
    draft_lookup: int | None = None
    draft_ngrams: bool | None = None
    greedy_filters: bool | None = None
    empty_steps: bool | None = None
    full_last_block: bool | None = None
    ordered_stops: bool | None = None
    edit_threshold: float | None = None
    max_post_edit_steps: int | None = None
    remask_budget: int | None = None
    remask_threshold: float | None = None
    ignore_eos: bool = False
    min_tokens: int | None = Field(None, ge=0)
    entropy_bound: float | None = None
    t_min: float | None = None
    t_max: float | None = None
    stability_threshold: int | None = None
    confidence_threshold: float | None = None
    uniform_draws: Literal["reference", "lean"] | None = None

    def stream_options_without_stream(self) -> tuple[str, str] | None:
        if self.stream_options is not None and not self.stream:  # OpenAI and vLLM refuse it too
            return "stream_options", "stream_options is only allowed when stream is true"
        return None

    def generation_kwargs(self) -> dict[str, Any]:
        """Fields this request sets; the server fills in max_tokens, seed and its defaults."""
        effort = self.reasoning_effort
        kw = dict(REASONING_EFFORT[EFFORT_ALIASES.get(effort, effort)]) if effort else {}
        for name in ("temperature", "top_p", "top_k", "policy", "threshold", "steps", "factor", "tokens_per_step",
                     *POLICY_FIELDS, "block_size", "small_block_size", "multi_block_threshold", "draft_all_outcomes",
                     "draft_lookup", "draft_ngrams", *REFERENCE_SWITCHES, *EDIT_FIELDS, "min_tokens", *UNIFORM_FIELDS):
            if getattr(self, name) is not None:
                kw[name] = getattr(self, name)
        kw["stop"] = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        kw["ignore_eos"] = self.ignore_eos
        for name in ("presence_penalty", "frequency_penalty", "repetition_penalty", *DRY_FIELDS):
            if getattr(self, name, None) is not None:
                kw[name] = getattr(self, name)
        if getattr(self, "logit_bias", None):
            kw["logit_bias"] = token_bias(self.logit_bias)
        return kw


# ---------------------------------------------------------------------------------------- chat
class TextPart(RequestModel):
    type: str
    text: str | None = None
    refusal: str | None = None   # an assistant turn's `refusal` part (OpenAI), read as its text

    @field_validator("type")
    @classmethod
    def _text_only(cls, v: str) -> str:
        if v not in ("text", "refusal"):
            raise ValueError(f"content parts of type {v!r} are not supported; only 'text' (and 'refusal')")
        return v

    @property
    def as_text(self) -> str:
        return (self.text if self.type == "text" else self.refusal) or ""


class ChatMessage(RequestModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None

    def to_template(self) -> dict[str, Any]:
        """The message as a chat template reads it: text parts joined, `developer` as `system`."""
        content = self.content
        if isinstance(content, list):
            content = "\n".join(p.as_text for p in content)
        msg: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role,
                               "content": content or ""}
        for key in ("name", "tool_calls", "tool_call_id"):
            if getattr(self, key) is not None:
                msg[key] = getattr(self, key)
        if self.tool_calls:
            msg["tool_calls"] = [_arguments_as_object(c) for c in self.tool_calls]
        return msg


def _arguments_as_object(call: dict[str, Any]) -> dict[str, Any]:
    """OpenAI clients send `function.arguments` as JSON text; chat templates (Gemma 4's among them) iterate
    it as a mapping, so a text that parses to an object is handed over parsed (as vLLM does). Other text
    is left as it is."""
    fn = call.get("function")
    if not isinstance(fn, dict) or not isinstance(fn.get("arguments"), str):
        return call
    try:
        args = json.loads(fn["arguments"])
    except ValueError:
        return call
    return {**call, "function": {**fn, "arguments": args}} if isinstance(args, dict) else call


class ChatCompletionRequest(GenerationRequest):
    messages: list[ChatMessage]
    model: str | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    logprobs: bool = False
    max_completion_tokens: int | None = None
    max_tokens: int | None = None
    n: int = Field(1, ge=1, le=128)
    parallel_tool_calls: bool | None = None
    presence_penalty: float | None = None
    reasoning_effort: ReasoningEffort | None = None
    response_format: dict[str, Any] | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    tool_choice: str | dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    top_p: float | None = None
    user: str | None = None
    # ---- unmask extensions
    # structured output beyond response_format (docs/structured-outputs.md)
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None

    def unsupported(self) -> tuple[str, str] | None:
        """(param, reason) of the first field set to something unmask cannot honour."""
        for legacy, now in (("functions", "tools"), ("function_call", "tool_choice")):
            if (self.model_extra or {}).get(legacy) is not None:  # answered as message.function_call: not sent
                return legacy, f"{legacy} is the deprecated form of {now}; send {now} (answers carry tool_calls)"
        if self.top_logprobs and not self.logprobs:
            return "top_logprobs", "top_logprobs requires logprobs: true"
        return self.stream_options_without_stream()


# ---------------------------------------------------------------------------------------- completions
class CompletionRequest(GenerationRequest):
    model: str | None = None
    prompt: str | list[str] | list[int] | list[list[int]]
    best_of: int | None = None
    echo: bool = False
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    logprobs: int | None = Field(None, ge=0, le=5)
    max_tokens: int | None = None
    n: int = Field(1, ge=1, le=128)
    presence_penalty: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    suffix: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    user: str | None = None
    # ---- unmask extensions
    reasoning_effort: ReasoningEffort | None = None
    # structured output (docs/structured-outputs.md)
    response_format: dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    # fill in the middle (docs/editor.md): candidate span lengths for bidirectional families
    infill_lengths: list[int] | None = None

    def prompts(self) -> list[str | list[int]]:
        """The prompt as a batch: one string or token list per entry."""
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        return list(p)

    def unsupported(self) -> tuple[str, str] | None:
        if bad := self.stream_options_without_stream():
            return bad
        if self.suffix and self.echo:
            return "echo", "echo is not supported together with suffix (fill in the middle)"
        if self.best_of is not None and self.best_of != self.n:
            return "best_of", "best_of other than n is not supported"
        if self.echo and self.logprobs is not None:
            return "echo", "echo with logprobs is not supported (prompt logprobs are not computed)"
        return None


class FIMCompletionRequest(CompletionRequest):
    """POST /v1/fim/completions: `prompt` is the text before the cursor, `suffix` the text after it;
    the answer's `choices[].text` is the middle. Same fields and response as /v1/completions."""

    def unsupported(self) -> tuple[str, str] | None:
        if self.echo:
            return "echo", "echo is not supported on /v1/fim/completions"
        return super().unsupported()


class EditRequest(ChatCompletionRequest):
    """POST /v1/apply/completions and /v1/edit/completions: one user message holding the tagged
    sections (docs/editor.md); the answer is the merged / rewritten code in choices[0].message.content."""

    def unsupported(self) -> tuple[str, str] | None:
        if self.n != 1:
            return "n", "edit endpoints return one choice; n must be 1"
        for name in ("tools", "tool_choice", "response_format", "regex", "choice", "grammar"):
            if getattr(self, name) is not None:
                return name, f"{name} is not supported on edit endpoints"
        if self.logprobs:
            return "logprobs", "logprobs are not supported on edit endpoints"
        if self.ignore_eos:
            return "ignore_eos", "ignore_eos is not supported on edit endpoints (edits end where the model ends them)"
        return None

    def user_content(self) -> str | None:
        """The text of the one user message (None if there is not exactly one)."""
        users = [m.to_template()["content"] for m in self.messages if m.role == "user"]
        return users[0] if len(users) == 1 else None


def token_bias(bias: dict[str, float]) -> dict[int, float]:
    """OpenAI's logit_bias (token ids as JSON object keys) -> {id: bias}; GenerationParams checks the ranges."""
    out = {}
    for key, value in bias.items():
        try:
            out[int(key)] = float(value)
        except (TypeError, ValueError):
            out[key] = value  # rejected with its key named by GenerationParams
    return out


# ---------------------------------------------------------------------------------------- tokenizer
class TokenizeRequest(RequestModel):
    """POST /tokenize: vLLM's fields (prompt or messages) and llama.cpp server's (content, with_pieces)."""

    model: str | None = None
    prompt: str | None = None
    content: str | None = None
    messages: list[ChatMessage] | None = None
    tools: list[dict[str, Any]] | None = None
    add_generation_prompt: bool = True
    add_special_tokens: bool | None = None   # accepted: prompts are encoded exactly as the generation endpoints do
    return_token_strs: bool = False
    with_pieces: bool = False


class TokenPiece(ResponseModel):
    id: int
    piece: str


class TokenizeResponse(ResponseModel):
    _omit_if_none = frozenset({"token_strs"})
    count: int
    max_model_len: int
    tokens: list[int] | list[TokenPiece]
    token_strs: list[str] | None = None


class DetokenizeRequest(RequestModel):
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(ResponseModel):
    prompt: str      # vLLM's name
    content: str     # llama.cpp server's name


# ---------------------------------------------------------------------------------------- models
class ModelCard(ResponseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "unmask"
    # ---- unmask extension
    max_model_len: int | None = None


class ModelList(ResponseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
