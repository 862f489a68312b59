"""Tool calling: per-family call formats, the fallback prompt, call grammars and output parsers.

Every supported family writes calls in the hermes style its chat template (or, lacking one, our
fallback prompt) teaches: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, one block per
call. The families differ only in whitespace inside the tags:

  unmask (built-in)                      <tool_call>{"name": "f", "arguments": {...}}</tool_call>
  sdar, dream, fast_dllm_v2 (Qwen chat)  <tool_call>\n{"name": "f", "arguments": {...}}\n</tool_call>
  llada, llada2, others                  as Qwen, taught by the fallback prompt (their templates
                                         render no tools; LLaDA2's own format is unverified)
  diffusion_gemma (Gemma 4 chat)         <|tool_call>call:f{city:<|"|>Paris<|"|>}<tool_call|>, not JSON:
                                         see `unmask.structured.gemma4`; arguments are returned as JSON

The parser accepts either spacing. It reads text decoded with special tokens kept (in unmask-tiny
`<tool_call>` is a special token that `skip_special_tokens` would delete).

tool_choice:
  none      tools are not rendered into the prompt; the output is plain content
  auto      tools rendered; the output is parsed into content and tool_calls (not constrained:
            out-of-order parallel commits stay available to ordinary answers)
  required  the output is grammar-constrained to one call (or several, with parallel_tool_calls)
            whose arguments validate against that function's `parameters`
  {"type": "function", "function": {"name": N}}  constrained to exactly one call of N
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from unmask.errors import InvalidRequestError
from unmask.structured import gemma4
from unmask.structured.spec import StructuredSpec, styled_schema


@dataclass(frozen=True)
class ToolFormat:
    name: str
    open_tag: str = "<tool_call>"
    close_tag: str = "</tool_call>"
    inner: str = "\n"        # whitespace inside the tags, around the JSON
    separator: str = "\n"    # between parallel calls
    response_open: str = "<tool_response>"
    response_close: str = "</tool_response>"
    syntax: str = "json"     # the call body: hermes JSON, or "gemma4" (call:NAME{key:value})


HERMES = ToolFormat("hermes")
UNMASK = ToolFormat("hermes-compact", inner="")
GEMMA4 = ToolFormat("gemma4", open_tag="<|tool_call>", close_tag="<tool_call|>", inner="", separator="",
                    response_open="<|tool_response>", response_close="<tool_response|>", syntax="gemma4")
FORMATS = {"unmask": UNMASK, "diffusion_gemma": GEMMA4}   # every other family: HERMES


def tool_format(family: str) -> ToolFormat:
    return FORMATS.get(family, HERMES)


# ---------------------------------------------------------------------------------------- request checks
def check_tools(tools: list[dict] | None) -> list[dict]:
    """OpenAI `tools` as a list of function definitions {name, description?, parameters?}."""
    out, seen = [], set()
    for i, t in enumerate(tools or []):
        param = f"tools[{i}]"
        if (not isinstance(t, dict) or t.get("type", "function") != "function"
                or not isinstance(t.get("function"), dict)):
            raise InvalidRequestError(f"{param} must be {{\"type\": \"function\", \"function\": {{...}}}}", param)
        fn = t["function"]
        name = fn.get("name")
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_.\-]{1,64}", name):
            raise InvalidRequestError(f"{param}.function.name must be 1-64 letters, digits, '_', '.' or '-'",
                                      f"{param}.function.name")
        if name in seen:
            raise InvalidRequestError(f"duplicate tool name {name!r}", f"{param}.function.name")
        seen.add(name)
        params = fn.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise InvalidRequestError(f"{param}.function.parameters must be a JSON Schema object",
                                      f"{param}.function.parameters")
        out.append({k: v for k, v in fn.items() if k in ("name", "description", "parameters", "strict")})
    return out


def check_tool_choice(choice: str | dict | None, functions: list[dict]) -> tuple[str, str | None]:
    """(mode, function name): mode in none | auto | required | named."""
    if not functions:
        if choice not in (None, "none", "auto"):
            raise InvalidRequestError("tool_choice needs tools", "tool_choice")
        return "none", None
    if choice is None or choice in ("auto", "none", "required"):
        return choice or "auto", None
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        if name not in {f["name"] for f in functions}:
            raise InvalidRequestError(f"tool_choice names function {name!r}, which is not in tools", "tool_choice")
        return "named", name
    raise InvalidRequestError('tool_choice must be "none", "auto", "required" or '
                              '{"type": "function", "function": {"name": ...}}', "tool_choice")


# ---------------------------------------------------------------------------------------- grammar
def _call_schema(fn: dict) -> dict:
    """JSON Schema of one call object {"name": const, "arguments": parameters}; $defs lifted to its root."""
    params = dict(fn.get("parameters") or {"type": "object", "properties": {}, "additionalProperties": False})
    lifted = {k: params.pop(k) for k in ("$defs", "definitions") if k in params}
    return styled_schema({"type": "object", "properties": {"name": {"const": fn["name"]}, "arguments": params},
                          "required": ["name", "arguments"], "additionalProperties": False, **lifted})


def special_tags(tokenizer, fmt: ToolFormat = HERMES) -> dict[str, int]:
    """The format's tags that are single special tokens of `tokenizer` (a grammar must name those by id)."""
    out = {}
    for tag in (fmt.open_tag, fmt.close_tag) + ((gemma4.QUOTE,) if fmt.syntax == "gemma4" else ()):
        i = tokenizer.token_id(tag)
        added = tokenizer.hf.added_tokens_decoder.get(i) if i is not None else None
        if added is not None and added.special:
            out[tag] = i
    return out


def _literal(text: str, special: dict[str, int]) -> str:
    """A Lark piece matching `text`; a tag that is one special token must be written as that token."""
    if text in special:
        return f"<[{special[text]}]>"
    return json.dumps(text)


def call_grammar(fmt: ToolFormat, functions: list[dict], name: str | None, parallel: bool,
                 special: dict[str, int], content: str | None = None) -> str:
    """Lark grammar (llguidance dialect) of one call of `name`, or of 1+ calls (1 without `parallel`) of
    any function; with `content` (a Lark rule body), that content is the other alternative."""
    chosen = [f for f in functions if name is None or f["name"] == name]
    sep = f"{json.dumps(fmt.separator)} " if fmt.separator else ""
    calls = f"call ({sep}call)*" if name is None and parallel else "call"
    lines = ["%llguidance {}", "start: calls" + (" | content" if content else ""), f"calls: {calls}"]
    if content:
        lines.append(f"content: {content}")
    inner = f" {json.dumps(fmt.inner)} " if fmt.inner else " "
    lines.append(f"call: {_literal(fmt.open_tag, special)}{inner}body{inner}{_literal(fmt.close_tag, special)}")
    lines.append("body: " + " | ".join(f"fn_{i}" for i in range(len(chosen))))
    if fmt.syntax == "gemma4":
        writer = gemma4.GrammarWriter(_literal(gemma4.QUOTE, special))
        for i, fn in enumerate(chosen):
            params = fn.get("parameters") or {"type": "object", "properties": {}, "additionalProperties": False}
            head = json.dumps(f"{gemma4.CALL_PREFIX}{fn['name']}", ensure_ascii=False)
            lines.append(f"fn_{i}: {head} {writer.object(params)}")
        lines += writer.rules + writer.terminals()
    else:
        for i, fn in enumerate(chosen):
            lines.append(f"fn_{i}: %json " + json.dumps(_call_schema(fn), ensure_ascii=False))
    return "\n".join(lines) + "\n"


def call_spec(fmt: ToolFormat, functions: list[dict], name: str | None, parallel: bool,
              special: dict[str, int]) -> StructuredSpec:
    return StructuredSpec("lark", call_grammar(fmt, functions, name, parallel, special), "tools")


def parameter_specs(functions: list[dict]) -> list[StructuredSpec]:
    """Each function's parameters alone, so that a schema error names its tool."""
    return [StructuredSpec.json_schema(f.get("parameters") or {"type": "object"},
                                       f"tools[{i}].function.parameters") for i, f in enumerate(functions)]


# ---------------------------------------------------------------------------------------- prompt fallback
FALLBACK_INTRO = "You can call the following tools. Each line is the JSON definition of one tool:\n"
FALLBACK_RULE = ('To call a tool, answer with {open}{{"name": <tool name>, "arguments": <arguments as a JSON object>}}'
                 "{close}, one block per call, and nothing else in that message.")
FALLBACK_RULE_GEMMA4 = ("To call a tool, answer with {open}call:<tool name>{{key:value,...}}{close}, strings written "
                        "between two " + gemma4.QUOTE + ", one block per call, and nothing else in that message.")


def fallback_messages(messages: list[dict[str, Any]], functions: list[dict], fmt: ToolFormat) -> list[dict[str, Any]]:
    """For chat templates that render no tools: tools in the system message, calls and results as text.

    The system message lists each function as one JSON line and states the call format. Assistant
    messages with `tool_calls` get the calls appended in that format; `tool` messages become user
    messages holding `<tool_response>...</tool_response>` blocks.
    """
    text = FALLBACK_INTRO + "".join(json.dumps(f, ensure_ascii=False) + "\n" for f in functions) + \
        (FALLBACK_RULE_GEMMA4 if fmt.syntax == "gemma4" else FALLBACK_RULE).format(
            open=fmt.open_tag + fmt.inner, close=fmt.inner + fmt.close_tag)
    out = [dict(m) for m in messages]
    if out and out[0]["role"] == "system":
        out[0]["content"] = f"{out[0].get('content') or ''}\n\n{text}".lstrip()
    else:
        out.insert(0, {"role": "system", "content": text})
    return history_as_text(out, fmt)


def history_as_text(messages: list[dict[str, Any]], fmt: ToolFormat) -> list[dict[str, Any]]:
    """Assistant `tool_calls` appended to their message as call blocks; each run of `tool` messages
    becomes one user message of `<tool_response>` blocks (templates that know no tool role)."""
    out: list[dict[str, Any]] = []
    after_tool = False
    for m in messages:
        m = dict(m)
        if m["role"] == "tool":
            block = f"{fmt.response_open}\n{m.get('content') or ''}\n{fmt.response_close}"
            if after_tool:
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block})
            after_tool = True
            continue
        if m["role"] == "assistant" and m.get("tool_calls"):
            blocks = [format_call(fmt, c) for c in m.pop("tool_calls")]
            m["content"] = fmt.separator.join(([m["content"]] if m.get("content") else []) + blocks)
        out.append(m)
        after_tool = False
    return out


def format_call(fmt: ToolFormat, call: dict) -> str:
    fn = call.get("function", call)
    args = fn.get("arguments", {})
    if fmt.syntax == "gemma4":
        return gemma4.format_call(fn.get("name"), args, fmt.open_tag, fmt.close_tag)
    args = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
    return f'{fmt.open_tag}{fmt.inner}{{"name": {json.dumps(fn.get("name"), ensure_ascii=False)}, ' \
           f'"arguments": {args}}}{fmt.inner}{fmt.close_tag}'


# ---------------------------------------------------------------------------------------- parsing
@dataclass
class ToolCallDelta:
    index: int
    id: str | None = None          # set on a call's first delta, with name and arguments ""
    name: str | None = None
    arguments: str = ""


@dataclass
class ParsedCall:
    id: str
    name: str
    arguments: str = ""            # the arguments JSON exactly as the model wrote it
    complete: bool = False         # its closing tag was written (False: cut off by the end of the output)


@dataclass
class _Block:
    """The call block being read: its call once the name is known, and how much of its arguments went out."""

    call: ParsedCall | None = None
    dropped: bool = False          # a call past the limit (a second one while parallel_tool_calls is false)
    sent: int = 0


_NAME = re.compile(r'"name"\s*:\s*"((?:[^"\\]|\\.)*)"')
_ARGS = re.compile(r'"(?:arguments|parameters)"\s*:\s*')


def _json_value_end(text: str) -> int | None:
    """Index just past the JSON value at the start of `text`, or None while it is still open."""
    depth, in_str, esc = 0, False, False
    for i, ch in enumerate(text):
        if in_str:
            if esc:
                esc = False
            elif ch == "\\":
                esc = True
            elif ch == '"':
                in_str = False
                if depth == 0:
                    return i + 1
        elif ch == '"':
            in_str = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            if depth == 0:          # a scalar ended by the enclosing object's brace
                return i
            depth -= 1
            if depth == 0:
                return i + 1
        elif depth == 0 and ch in ", \t\r\n" and i > 0:
            return i
    return None


class ToolParser:
    """Incremental: text in, content and tool-call deltas out. Whole outputs go through the same code,
    so streamed and non-streamed responses agree.

    Per call (the order clients accumulate correctly): a first delta with index, id, name and
    arguments "", then argument fragments as their text is committed. Arguments are the model's own
    JSON text, never re-serialised. A block without a readable name is returned as content.
    """

    def __init__(self, fmt: ToolFormat, parallel: bool = True, max_calls: int | None = None, forced: bool = False):
        self.fmt, self.parallel = fmt, parallel
        self.forced = forced  # tool_choice required or named: the output can only be calls (the grammar's)
        self.max_calls = 1 if not parallel else max_calls   # calls past it are dropped, like a second one
        self.calls: list[ParsedCall] = []
        self._buf = ""
        self._block: _Block | None = None   # inside a call block
        self._started = False               # content emitted yet (leading whitespace is dropped)
        self._ws = ""                       # whitespace held until non-space content follows

    def feed(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        return _split(self.feed_pieces(text))

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        return _split(self.finish_pieces())

    def feed_pieces(self, text: str) -> list[str | ToolCallDelta]:
        """Content text and call deltas in the order the output wrote them. A close tag outside any call (a
        model that closes its call twice) closes nothing and is dropped, not returned as content."""
        self._buf += text
        pieces: list[str | ToolCallDelta] = []
        open_tag, close_tag = self.fmt.open_tag, self.fmt.close_tag
        while True:
            if self._block is None:
                i = self._buf.find(open_tag)
                if i < 0:
                    held = max(_partial_suffix(self._buf, open_tag), _partial_suffix(self._buf, close_tag))
                    cut = len(self._buf) - held
                    pieces.append(self._content(self._buf[:cut].replace(close_tag, "")))
                    self._buf = self._buf[cut:]
                    return [p for p in pieces if p != ""]
                pieces.append(self._content(self._buf[:i].replace(close_tag, "")))
                self._buf = self._buf[i + len(open_tag):]
                self._block = _Block()
            j = self._buf.find(close_tag)
            body = self._buf if j < 0 else self._buf[:j]
            pieces += self._progress(body, closed=j >= 0)
            if j < 0:
                return [p for p in pieces if p != ""]
            if self._block.call is None and not self._block.dropped:
                pieces.append(self._content(open_tag + body + close_tag))
            elif self._block.call is not None:
                self._block.call.complete = True
            self._buf = self._buf[j + len(close_tag):]
            self._block = None

    def finish_pieces(self) -> list[str | ToolCallDelta]:
        """End of output: an unclosed call keeps what it has (it stays incomplete, and gets no default
        arguments); other leftover text is content, except a forced call (or its open tag) cut off before its
        name could be read (max_tokens too small), which is no content: the client gets no call and
        finish_reason length."""
        pieces: list[str | ToolCallDelta] = []
        if self._block is not None:
            pieces += self._progress(self._buf, closed=False)
            if self._block.call is None and not self._block.dropped and not self.forced:
                pieces.append(self._content(self.fmt.open_tag + self._buf))
        elif not (self.forced and self.fmt.open_tag.startswith(self._buf.strip())):  # forced: a cut-off open tag
            pieces.append(self._content(self._buf.replace(self.fmt.close_tag, "")))
        self._buf, self._block = "", None
        return [p for p in pieces if p != ""]

    def _content(self, text: str) -> str:
        pending = self._ws + text
        kept = pending.rstrip()
        if not kept:
            self._ws = pending
            return ""
        out = kept if self._started else kept.lstrip()
        self._ws, self._started = pending[len(kept):], True
        return out

    def _name(self, body: str) -> str | None:
        if self.fmt.syntax == "gemma4":
            return gemma4.call_name(body)
        m = _NAME.search(body)
        if m is None:
            return None
        try:
            return json.loads(f'"{m.group(1)}"')
        except ValueError:  # an invalid escape: keep the raw text
            return m.group(1)

    def _progress(self, body: str, closed: bool) -> list[ToolCallDelta]:
        """Deltas for a call block's text so far; `closed`: its closing tag was read."""
        b, deltas = self._block, []
        if b.call is None and not b.dropped:
            name = self._name(body)
            if name is None:
                return []
            if self.max_calls is not None and len(self.calls) >= self.max_calls:
                b.dropped = True
                return []
            b.call = ParsedCall(id=f"call_{uuid.uuid4().hex[:24]}", name=name)
            self._ws = ""   # whitespace before a call is not content
            self.calls.append(b.call)
            deltas.append(ToolCallDelta(len(self.calls) - 1, id=b.call.id, name=b.call.name, arguments=""))
        if b.call is None:
            return deltas
        index = self.calls.index(b.call)
        if self.fmt.syntax == "gemma4":
            # the body is not JSON: its arguments go out once, converted, when the block closes (a
            # prefix of the conversion could later change, e.g. a bare word becoming a number)
            # converted only once closed: a cut-off body would convert to valid-looking JSON (`b:` -> "b": null)
            if closed and not b.call.arguments:
                b.call.arguments = gemma4.call_arguments(body) or "{}"
                deltas.append(ToolCallDelta(index, arguments=b.call.arguments))
            return deltas
        a = _ARGS.search(body)
        if a is not None:
            raw = body[a.end():]
            end = _json_value_end(raw)
            final = raw[:end] if end is not None else raw.rstrip()
            if len(final) > b.sent:
                deltas.append(ToolCallDelta(index, arguments=final[b.sent:]))
                b.call.arguments += final[b.sent:]
                b.sent = len(final)
        if closed and not b.call.arguments:  # a closed call without an arguments key: an empty argument object
            b.call.arguments = "{}"
            deltas.append(ToolCallDelta(index, arguments="{}"))
        return deltas


def _split(pieces: list[str | ToolCallDelta]) -> tuple[str, list[ToolCallDelta]]:
    return "".join(p for p in pieces if isinstance(p, str)), [p for p in pieces if not isinstance(p, str)]


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag` (held back: it may become the tag)."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-k:]):
            return k
    return 0


def parse_tool_calls(text: str, fmt: ToolFormat, parallel: bool = True, max_calls: int | None = None,
                     forced: bool = False) -> tuple[str | None, list[ParsedCall]]:
    """Whole output -> (content or None, calls), through the streaming parser."""
    parser = ToolParser(fmt, parallel, max_calls, forced)
    content, _ = parser.feed(text)
    tail, _ = parser.finish()
    return (content + tail) or None, parser.calls


# ---------------------------------------------------------------------------------------- chat requests
@dataclass
class ChatPlan:
    """How one chat request becomes a prompt, a constraint and an output parser."""

    messages: list[dict[str, Any]]
    template_tools: list[dict] | None   # for the template's `tools` argument (None: not rendered there)
    structured: StructuredSpec | None   # the output constraint, if any
    parse: ToolFormat | None            # parse tool calls out of the output (None: plain content)
    parallel: bool = True
    param_specs: list[StructuredSpec] | None = None  # each function's parameters, checked up front
    forced: bool = False                # tool_choice required or named: the output is constrained to calls


def plan_chat(messages: list[dict[str, Any]], tools: list[dict] | None, tool_choice, parallel_tool_calls: bool | None,
              content: StructuredSpec | None, family: str, template_has_tools: bool,
              special: dict[str, int]) -> ChatPlan:
    """Tools + tool_choice + response_format of a chat request -> prompt messages, constraint, parser."""
    functions = check_tools(tools)
    mode, name = check_tool_choice(tool_choice, functions)
    fmt = tool_format(family)
    parallel = parallel_tool_calls is not False
    if mode == "none":
        msgs = messages if template_has_tools else history_as_text(messages, fmt)
        return ChatPlan(msgs, None, content, None, parallel)
    if template_has_tools:
        msgs, template_tools = messages, [{"type": "function", "function": f} for f in functions]
    else:
        msgs, template_tools = fallback_messages(messages, functions, fmt), None
    if mode == "auto":
        spec = union_spec(fmt, functions, parallel, special, content) if content is not None else None
        return ChatPlan(msgs, template_tools, spec, fmt, parallel, parameter_specs(functions) if spec else None)
    spec = call_spec(fmt, functions, name, parallel and mode == "required", special)
    return ChatPlan(msgs, template_tools, spec, fmt, parallel, parameter_specs(functions), forced=True)


def union_spec(fmt: ToolFormat, functions: list[dict], parallel: bool, special: dict[str, int],
               content: StructuredSpec) -> StructuredSpec:
    """tool_choice auto with a response_format: either tool calls or content matching the format."""
    import llguidance

    if content.kind == "json":
        rule = "%json " + json.dumps(styled_schema(content.value), ensure_ascii=False)
    elif content.kind == "regex":
        rule = f"/{llguidance.regex_to_lark(content.value)}/"
    elif content.kind == "choice":
        rule = " | ".join(json.dumps(c) for c in content.value)
    else:
        raise InvalidRequestError('a Lark grammar cannot be combined with tools; use tool_choice "none"',
                                  content.param)
    return StructuredSpec("lark", call_grammar(fmt, functions, None, parallel, special, rule), content.param)
