"""A chat conversation checked and rendered for the model, with every failure a 400 naming the message.

Request validation (protocol.py) takes `tool_calls` as free-form objects; `check_tool_calls` holds them to
OpenAI's shape (`id`, `type: "function"`, `function.name`, `function.arguments` as a string) so that a call
the chat template cannot read is refused by name instead of raising inside the template. `render` turns any
other rendering failure (a `TypeError` from a filter, the template's own `raise_exception`, ...) into a 400
and, where the rendered messages are the request's own, names the first message whose inclusion makes the
template fail.
"""
from __future__ import annotations

from typing import Any

from unmask.errors import ModelLoadError
from unmask.server.protocol import APIError, ChatMessage
from unmask.tokenizer import Tokenizer

ERROR_TEXT_LIMIT = 300   # characters of a template's exception text quoted back to the client


def _missing(at: str) -> APIError:
    return APIError(400, f"Missing required parameter: '{at}'.", param=at, code="missing_required_parameter")


def _not_a(at: str, kind: str, value: Any) -> APIError:
    return APIError(400, f"Invalid type for '{at}': expected {kind}, but got {type(value).__name__}.", param=at,
                    code="invalid_type")


def check_tool_calls(messages: list[ChatMessage], param: str = "messages") -> None:
    """400 on the first `tool_calls` entry that is not a complete OpenAI function call."""
    for i, message in enumerate(messages):
        if message.tool_calls is None:
            continue
        if message.role != "assistant":
            raise APIError(400, f"{param}[{i}].tool_calls is only allowed on assistant messages (role is "
                                f"{message.role!r})", param=f"{param}[{i}].tool_calls")
        for j, call in enumerate(message.tool_calls):
            at = f"{param}[{i}].tool_calls[{j}]"
            for key in ("id", "type", "function"):
                if call.get(key) is None:
                    raise _missing(f"{at}.{key}")
            if not isinstance(call["id"], str):
                raise _not_a(f"{at}.id", "a string", call["id"])
            if call["type"] != "function":
                raise APIError(400, f"Invalid value for '{at}.type': supported values are: 'function'.",
                               param=f"{at}.type", code="invalid_value")
            fn = call["function"]
            if not isinstance(fn, dict):
                raise _not_a(f"{at}.function", "an object", fn)
            for key in ("name", "arguments"):
                if fn.get(key) is None:
                    raise _missing(f"{at}.function.{key}")
                if not isinstance(fn[key], str):
                    raise _not_a(f"{at}.function.{key}", "a string", fn[key])


def render(tok: Tokenizer, messages: list[dict[str, Any]], tools: list[dict] | None, add_generation_prompt: bool,
           param: str = "messages", source: list[ChatMessage] | None = None) -> str:
    """The chat template applied to `messages`. A failure is a 400 naming `param[i]` when `messages` are the
    request's `source` messages one for one (no tool-history rewriting shifted them) and the failure can be
    pinned to one message; else it names `param`."""
    def apply(msgs: list[dict[str, Any]]) -> str:
        return tok.apply_chat_template(msgs, tools=tools, add_generation_prompt=add_generation_prompt)

    try:
        return apply(messages)
    except ModelLoadError as e:   # the model has no template at all
        raise APIError(400, f"cannot apply the chat template: {e}", param=param) from None
    except Exception as e:  # noqa: BLE001 - the template loaded and rendered at start-up: this conversation broke it
        error = _describe(e)
    at = _first_failing(apply, messages, error) if source is not None and _aligned(source, messages) else None
    if at is None:
        raise APIError(400, f"cannot apply the chat template to {param}: {error}", param=param,
                       code="invalid_chat_history")
    raise APIError(400, f"the chat template cannot render {param}[{at}]: {error}", param=f"{param}[{at}]",
                   code="invalid_chat_history")


def _aligned(source: list[ChatMessage], messages: list[dict[str, Any]]) -> bool:
    roles = ["system" if m.role == "developer" else m.role for m in source]
    return roles == [m.get("role") for m in messages]


def _describe(e: Exception) -> str:
    text = f"{type(e).__name__}: {e}"
    return text if len(text) <= ERROR_TEXT_LIMIT else text[:ERROR_TEXT_LIMIT] + "..."


def _first_failing(apply, messages: list[dict[str, Any]], error: str) -> int | None:
    """Index of the message whose inclusion makes the template fail with `error`: the shortest failing
    prefix, found by bisection (about log2 of the conversation's length in renders, on the error path only).
    None when even the empty conversation fails that way (the fault is elsewhere, e.g. in `tools`)."""
    def fails(n: int) -> bool:
        try:
            apply(messages[:n])
        except Exception as e:  # noqa: BLE001
            return _describe(e) == error
        return False

    lo, hi = 0, len(messages)   # the whole conversation fails with `error`
    while lo < hi:
        mid = (lo + hi) // 2
        if fails(mid):
            hi = mid
        else:
            lo = mid + 1
    return hi - 1 if hi > 0 else None
