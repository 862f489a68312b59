"""POST /v1/responses (OpenAI's Responses API), stateless, on top of the chat path (no web framework here).

A request becomes a chat request: `instructions` the system message, `input` items the messages
(`function_call` items an assistant turn's tool calls, `function_call_output` items tool messages),
function tools and `tool_choice` the chat shapes, `text.format` the `response_format`. It then runs
through OpenAIServing's job runner (admission, cancellation, constraints, tool parsing as on
/v1/chat/completions), and its output comes back as Responses items: a `message` with `output_text`,
and one `function_call` item per call. Streams send the typed events (`event:` and `data:` lines,
`sequence_number` counting from 0) that the official SDKs accumulate: response.created,
response.in_progress, output_item.added / content_part.added / output_text.delta / ... /
output_item.done per item, function_call_arguments.delta / .done, then response.completed (or
response.incomplete when max_output_tokens cut it); an error mid-stream is an `error` event, then
response.failed. Nothing is stored: previous_response_id, conversation and background are 400s.
A `file_search` tool is run by the server before generation (unmask.retrieval.file_search): its excerpts join
the instructions, its `file_search_call` item comes first and the message cites the files it was given.
"""
from __future__ import annotations

import json
import re
import time
import uuid
from dataclasses import fields
from typing import Any

from pydantic import BaseModel, ValidationError

from unmask.engine.outputs import StepOutput
from unmask.engine.params import GenerationParams
from unmask.server.protocol import APIError, ChatCompletionRequest, DiffusingFrame, TokenLogprob, Usage
from unmask.retrieval import file_search
from unmask.server.protocol_responses import (ResponseFileSearchCallItem, ResponseFunctionCallItem,
                                              ResponseMessageItem, ResponseObject, ResponseOutputText,
                                              ResponsesRequest, ResponseUsage)
from unmask.server.formats import ChatFormat, ChoiceState
from unmask.server.metrics import arrival
from unmask.server.serving import Disconnected, OpenAIServing, log_ignored_fields
from unmask.structured.tools import ToolParser, parse_tool_calls
from unmask.tokenizer import IncrementalDecoder

TEXT_PARTS = ("input_text", "output_text", "text")
LOGPROBS_INCLUDE = "message.output_text.logprobs"


def _bad(param: str, message: str) -> APIError:
    return APIError(400, message, param=param)


# ---------------------------------------------------------------------------------------- request -> chat
def _text(content: Any, param: str) -> str:
    """A message's content (text or a list of text parts) as one string; other part types are refused."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _bad(param, f"{param} must be a string or a list of content parts")
    texts = []
    for i, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in TEXT_PARTS and isinstance(part.get("text"), str):
            texts.append(part["text"])
        elif kind == "refusal" and isinstance(part.get("refusal"), str):
            texts.append(part["refusal"])
        else:
            raise _bad(f"{param}[{i}].type", f"content parts of type {kind!r} are not supported; only text "
                                             f"({', '.join(TEXT_PARTS)})")
    return "\n".join(texts)


def input_messages(items: str | list[dict[str, Any]], instructions: str | None) -> list[dict[str, Any]]:
    """Responses `input` (+ `instructions`) -> chat messages. Consecutive function_call items join one assistant
    turn (after the assistant text before them, if any); each function_call_output is a tool message."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": instructions}] if instructions else []
    if isinstance(items, str):
        return messages + [{"role": "user", "content": items}]
    calls_seen: set[str] = set()
    for i, item in enumerate(items):
        param = f"input[{i}]"
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise _bad(f"{param}.role", f"{param}.role must be user, assistant, system or developer, got {role!r}")
            messages.append({"role": role, "content": _text(item.get("content", ""), f"{param}.content")})
        elif kind == "function_call":
            for key in ("call_id", "name", "arguments"):
                if not isinstance(item.get(key), str):
                    raise _bad(f"{param}.{key}", f"{param}.{key} must be a string")
            calls_seen.add(item["call_id"])
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise _bad(f"{param}.call_id", f"{param}.call_id must be a string")
            if item["call_id"] not in calls_seen:   # OpenAI refuses an output whose call is not in the input
                raise _bad(f"{param}.call_id", f"no function_call item before {param} has call_id "
                                               f"{item['call_id']!r}")
            output = item.get("output", "")
            messages.append({"role": "tool", "tool_call_id": item["call_id"],
                             "content": output if isinstance(output, str) else _text(output, f"{param}.output")})
        elif kind == "reasoning":
            continue  # a reasoning model's summary of an earlier turn: nothing for this model to read
        else:
            raise _bad(f"{param}.type", f"input items of type {kind!r} are not supported; this server takes message, "
                                        "function_call, function_call_output and reasoning items")
    return messages


def chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    if tools is None:
        return None
    out = []
    for i, tool in enumerate(tools):
        if tool.get("type") != "function":
            raise _bad(f"tools[{i}].type", f"tools of type {tool.get('type')!r} are not supported; only 'function'")
        if not isinstance(tool.get("name"), str):
            raise _bad(f"tools[{i}].name", f"tools[{i}].name must be a string")
        fn = {k: tool[k] for k in ("name", "description", "parameters", "strict") if tool.get(k) is not None}
        out.append({"type": "function", "function": fn})
    return out


def chat_tool_choice(choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    if choice is None or isinstance(choice, str):
        return choice
    if choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise _bad("tool_choice", f"tool_choice {json.dumps(choice)} is not supported; use auto, none, required or "
                              '{"type": "function", "name": ...}')


def response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    fmt = (text or {}).get("format")
    if fmt is None or fmt.get("type") == "text":
        return None
    if fmt.get("type") == "json_object":
        return {"type": "json_object"}
    if fmt.get("type") == "json_schema":
        inner = {k: fmt[k] for k in ("name", "description", "schema", "strict") if k in fmt}
        return {"type": "json_schema", "json_schema": inner}
    raise _bad("text.format.type", f"text.format of type {fmt.get('type')!r} is not supported; use text, "
                                   "json_object or json_schema")


def to_chat_request(req: ResponsesRequest) -> ChatCompletionRequest:
    for name in ("max_output_tokens", "max_tool_calls"):
        value = getattr(req, name)
        if value is not None and value < 1:
            raise _bad(name, f"{name} must be at least 1, got {value}")
    logprobs = LOGPROBS_INCLUDE in (req.include or [])
    body: dict[str, Any] = {
        "model": req.model, "messages": input_messages(req.input, req.instructions),
        "tools": chat_tools(req.tools), "tool_choice": chat_tool_choice(req.tool_choice),
        "parallel_tool_calls": False if req.max_tool_calls == 1 else req.parallel_tool_calls,
        "max_tokens": req.max_output_tokens, "temperature": req.temperature, "top_p": req.top_p,
        "response_format": response_format(req.text), "stream": req.stream, "logprobs": logprobs,
        "top_logprobs": req.top_logprobs if logprobs else None,
        "reasoning_effort": (req.reasoning or {}).get("effort"), **req.passthrough(),
    }
    try:
        return ChatCompletionRequest.model_validate({k: v for k, v in body.items() if v is not None})
    except ValidationError as e:
        err = e.errors()[0]
        param = responses_param(str(err["loc"][0]) if err["loc"] else "input")
        raise _bad(param, f"{param}: {err['msg']}") from None


def responses_param(param: str | None) -> str | None:
    """A chat request's parameter path as the Responses request names it (flat tools, text.format)."""
    if param is None:
        return None
    param = re.sub(r"^tools\[(\d+)\]\.function\.", r"tools[\1].", param)
    param = re.sub(r"^response_format(\.json_schema)?", "text.format", param)
    return {"max_tokens": "max_output_tokens", "messages": "input", "reasoning_effort": "reasoning.effort",
            "tool_choice.function.name": "tool_choice.name"}.get(param, param)


# ---------------------------------------------------------------------------------------- serving
class ResponsesServing:
    def __init__(self, serving: OpenAIServing):
        self.s = serving

    async def create(self, req: ResponsesRequest, is_disconnected: Disconnected | None = None, retrieval=None):
        t0 = arrival()
        bad = req.unsupported()
        if bad:
            raise APIError(400, bad[1], param=bad[0], code="unsupported")
        tools, search = file_search.split_tools(req.tools)   # file_search runs here, before the model writes
        asked = req if search is None else req.model_copy(update={"tools": tools})
        chat, plan, prompts, jobs = self._jobs(asked)
        log_ignored_fields(req)
        if search is not None:
            await file_search.run(search, retrieval, input_messages(req.input, req.instructions))
            reserve = req.max_output_tokens or min(self.s.cfg.default_max_tokens, self.s.spec.max_context // 2)
            budget = self.s.spec.max_context - len(prompts[0]) - reserve - 16
            context = file_search.fit(search, lambda text: len(self.s.tok.encode(text)), budget)
            if context:
                instructions = f"{req.instructions}\n\n{context}" if req.instructions else context
                chat, plan, prompts, jobs = self._jobs(asked.model_copy(update={"instructions": instructions}))
        fmt = ResponsesFormat(self.s, req, chat, plan, search)
        return await self.s._run(fmt, jobs, chat, prompts, is_disconnected, t0)

    def _jobs(self, req: ResponsesRequest):
        chat = to_chat_request(req)
        self.s._validate(chat)
        try:
            return chat, *self.s.chat_jobs(chat, param="input")
        except APIError as e:
            e.param = responses_param(e.param)
            raise


class ResponsesFormat(ChatFormat):
    """Builds Responses objects and stream events from the one engine request a Responses request makes."""

    id_prefix = "resp"

    def __init__(self, serving: OpenAIServing, req: ResponsesRequest, chat: ChatCompletionRequest, plan,
                 search: file_search.FileSearch | None = None):
        super().__init__(serving, chat, plan)
        self.req = req
        self.search = search   # the file_search call made before generation (its item comes first)
        self.search_results = file_search.INCLUDE_RESULTS in (req.include or [])
        self.cited = False     # file_citation annotations go on the first message
        # the sampling the request ran with, echoed where it named none (as OpenAI echoes its defaults)
        engine_defaults = {f.name: f.default for f in fields(GenerationParams) if f.name in ("temperature", "top_p")}
        used = {**engine_defaults, **serving.chat_defaults, **chat.generation_kwargs()}
        self.temperature, self.top_p = used["temperature"], used["top_p"]
        self.id = _item_id("resp")  # OpenAI's ids: resp_..., msg_..., fc_...
        self.created_at = int(time.time())
        self.seq = 0
        self.items: list[ResponseMessageItem | ResponseFunctionCallItem | ResponseFileSearchCallItem] = []
        self.open: list[int] = []          # output indices of items still in progress (streaming)
        self.message: int | None = None    # the message item that text deltas go to
        self.calls: dict[int, int] = {}    # parser call index -> output index
        self.call_of: dict[int, int] = {}  # output index -> parser call index
        self.pending_logprobs: list[TokenLogprob] = []
        self.max_calls = req.max_tool_calls  # calls past it are dropped (as unparallel second calls are)
        self.parser = (ToolParser(self.tools, self.parallel, self.max_calls, self.forced) if self.tools is not None
                       else None)
        self.decoder = IncrementalDecoder(self.tok, skip_special_tokens=False) if self.tools is not None else None

    # ------------------------------------------------------------------ response objects
    def _response(self, status: str, output: list, usage: Usage | None = None, reason: str | None = None,
                  error: dict | None = None) -> ResponseObject:
        r = self.req
        return ResponseObject(
            id=self.id, created_at=self.created_at, status=status, error=error,
            incomplete_details={"reason": reason} if reason else None, instructions=r.instructions,
            max_output_tokens=r.max_output_tokens, model=self.model, output=output,
            parallel_tool_calls=self.parallel, reasoning=r.reasoning, temperature=self.temperature,
            max_tool_calls=r.max_tool_calls,
            text=r.text or {"format": {"type": "text"}}, tool_choice=r.tool_choice or "auto", tools=r.tools or [],
            top_p=self.top_p, user=r.user, metadata=r.metadata or {},
            usage=ResponseUsage(input_tokens=usage.prompt_tokens, output_tokens=usage.completion_tokens,
                                total_tokens=usage.total_tokens) if usage is not None else None)

    @staticmethod
    def _status(finish_reason: str | None) -> tuple[str, str | None]:
        return ("incomplete", "max_output_tokens") if finish_reason == "length" else ("completed", None)

    def _token_logprobs(self, ids: list[int], lps: list[float], tops: list | None) -> list[TokenLogprob]:
        got = self._logprobs(ids, lps, tops)
        return got.content if got is not None else []

    def response(self, states: dict[int, ChoiceState], usage: Usage) -> ResponseObject:
        st = states[0]
        status, reason = self._status(st.finish_reason)
        logprobs = self._token_logprobs(st.token_ids, st.logprobs, st.top_logprobs)
        if self.tools is None:
            pieces: list = [st.text] if st.text else []
        else:  # the items in the order the output wrote them, as the stream sends them
            parser = ToolParser(self.tools, self.parallel, self.max_calls, self.forced)
            pieces = parser.feed_pieces(self.tok.decode(st.token_ids, skip_special_tokens=False))
            pieces += parser.finish_pieces()
        output: list = []
        message: ResponseMessageItem | None = None
        for piece in pieces:
            if isinstance(piece, str):
                if message is None:
                    message = ResponseMessageItem(id=_item_id("msg"), status="completed",
                                                  content=[ResponseOutputText(text="")])
                    output.append(message)
                message.content[0].text += piece
            elif piece.id is not None:
                complete = parser.calls[piece.index].complete
                output.append(ResponseFunctionCallItem(id=_item_id("fc"), call_id=piece.id, name=piece.name,
                                                       arguments=parser.calls[piece.index].arguments,
                                                       status="completed" if complete else "incomplete"))
                message = None
        if not output:  # nothing was written: one empty message
            output.append(ResponseMessageItem(id=_item_id("msg"), status="completed", content=[ResponseOutputText(text="")]))
        if self.search is not None:
            cited = next((i for i in output if isinstance(i, ResponseMessageItem)), None)
            if cited is not None:
                cited.content[0].annotations = self.search.annotations(cited.content[0].text)
            output.insert(0, ResponseFileSearchCallItem(**self.search.item(self.search_results)))
        first = next((i for i in output if isinstance(i, ResponseMessageItem)), None)
        if first is not None:
            first.content[0].logprobs = logprobs
        if reason and isinstance(output[-1], ResponseMessageItem):  # cut off: the item being written is incomplete
            output[-1].status = "incomplete"
        return self._response(status, output, usage, reason)

    # ------------------------------------------------------------------ stream framing
    def frame(self, obj: dict | str) -> str:
        return f"event: {obj['type']}\ndata: {json.dumps(obj, ensure_ascii=False)}\n\n"

    def _event(self, kind: str, **fields: Any) -> dict:
        data = {k: v.model_dump() if isinstance(v, BaseModel) else v for k, v in fields.items()}
        event = {"type": kind, "sequence_number": self.seq, **data}
        self.seq += 1
        return event

    def opening(self, indices: list[int]) -> list[dict]:
        snapshot = self._response("in_progress", [])
        events = [self._event("response.created", response=snapshot),
                  self._event("response.in_progress", response=snapshot)]
        if self.search is not None:   # the search is already done: its item's events come first, in order
            item = ResponseFileSearchCallItem(**self.search.item(False, "in_progress"))
            self.items.append(item)
            events.append(self._event("response.output_item.added", output_index=0, item=item))
            for stage in ("in_progress", "searching", "completed"):
                events.append(self._event(f"response.file_search_call.{stage}", output_index=0, item_id=item.id))
            self.items[0] = ResponseFileSearchCallItem(**self.search.item(self.search_results))
            events.append(self._event("response.output_item.done", output_index=0, item=self.items[0]))
        return events

    def chunks(self, index: int, st: ChoiceState, out: StepOutput) -> list[dict]:
        events: list[dict] = []
        logprobs = self._token_logprobs(out.new_token_ids, out.new_logprobs or [], out.new_top_logprobs)
        if self.parser is None:
            if out.text_delta or logprobs:
                events += self._text(out.text_delta, logprobs)
        else:
            pieces = self.parser.feed_pieces(self.decoder.push(out.new_token_ids))
            if out.finished:
                pieces += self.parser.finish_pieces()
            # logprobs ride on message text; a step that wrote only call markup keeps them for the next text
            self.pending_logprobs += logprobs
            for piece in pieces:
                if isinstance(piece, str):
                    events += self._text(piece, self.pending_logprobs)
                    self.pending_logprobs = []
                else:
                    events += self._call(piece)
        if out.finished:
            if not self.items:  # nothing was written: still one (empty) message, as the whole response has
                events += self._text("", self.pending_logprobs)
            events += self._close_all("incomplete" if out.finish_reason == "length" else "completed")
        return events

    def _text(self, delta: str, logprobs: list[TokenLogprob]) -> list[dict]:
        events = []
        if self.message is None:
            events += self._close_all("completed")
            self.message = len(self.items)
            item = ResponseMessageItem(id=_item_id("msg"), status="in_progress", content=[])
            self.items.append(item)
            self.open.append(self.message)
            events.append(self._event("response.output_item.added", output_index=self.message, item=item))
            part = ResponseOutputText(text="")
            item.content.append(part)
            events.append(self._event("response.content_part.added", item_id=item.id, output_index=self.message,
                                      content_index=0, part=part))
        item = self.items[self.message]
        part = item.content[0]
        part.text += delta
        part.logprobs += logprobs
        events.append(self._event("response.output_text.delta", item_id=item.id, output_index=self.message,
                                  content_index=0, delta=delta, logprobs=[lp.model_dump() for lp in logprobs]))
        return events

    def _call(self, d) -> list[dict]:
        events = []
        if d.id is not None:  # a new call: whatever came before it is complete
            events += self._close_all("completed")
            index = len(self.items)
            item = ResponseFunctionCallItem(id=_item_id("fc"), status="in_progress", call_id=d.id, name=d.name,
                                            arguments="")
            self.items.append(item)
            self.open.append(index)
            self.calls[d.index] = index
            self.call_of[index] = d.index
            events.append(self._event("response.output_item.added", output_index=index, item=item))
        index = self.calls[d.index]
        if d.arguments:
            item = self.items[index]
            item.arguments += d.arguments
            events.append(self._event("response.function_call_arguments.delta", item_id=item.id, output_index=index,
                                      delta=d.arguments))
        return events

    def _close_all(self, status: str) -> list[dict]:
        events = []
        for index in self.open:
            item = self.items[index]
            if isinstance(item, ResponseMessageItem):
                part = item.content[0]
                if self.search is not None and not self.cited:
                    self.cited = True
                    part.annotations = self.search.annotations(part.text)
                    for n, note in enumerate(part.annotations):
                        events.append(self._event("response.output_text.annotation.added", item_id=item.id,
                                                  output_index=index, content_index=0, annotation_index=n,
                                                  annotation=note))
                events.append(self._event("response.output_text.done", item_id=item.id, output_index=index,
                                          content_index=0, text=part.text,
                                          logprobs=[lp.model_dump() for lp in part.logprobs]))
                events.append(self._event("response.content_part.done", item_id=item.id, output_index=index,
                                          content_index=0, part=part))
            else:
                events.append(self._event("response.function_call_arguments.done", item_id=item.id,
                                          output_index=index, name=item.name, arguments=item.arguments))
            if isinstance(item, ResponseMessageItem):
                item.status = status
            else:  # a call is complete once its closing tag was written, whatever ended the output
                item.status = "completed" if self.parser.calls[self.call_of[index]].complete else "incomplete"
            events.append(self._event("response.output_item.done", output_index=index, item=item))
        self.open = []
        self.message = None
        return events

    def closing(self, states: dict[int, ChoiceState], usage: Usage, include_usage: bool) -> list[dict]:
        status, reason = self._status(states[0].finish_reason)
        kind = "response.incomplete" if reason else "response.completed"
        return [self._event(kind, response=self._response(status, list(self.items), usage, reason))]

    def failure(self, err: APIError) -> list[dict]:
        info = err.response().error
        code = info.code or info.type
        return [self._event("error", code=code, message=info.message, param=info.param),
                self._event("response.failed", response=self._response(
                    "failed", list(self.items), error={"code": code, "message": info.message}))]

    def trailer(self) -> list:
        return []  # Responses streams end with their last event; there is no [DONE]

    def diffusing(self, frame: DiffusingFrame) -> dict:
        return self._event("response.diffusing", **frame.model_dump())


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"
