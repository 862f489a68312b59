"""Byte-level BPE tokenizer for unmask-tiny, saved as a Hugging Face tokenizer directory.

Special tokens sit at fixed ids 0..15 (model, trainer and server code rely on these ids).
Any byte sequence encodes losslessly (byte-level, no normaliser, no lowercasing), digits are
split one per token (helps a tiny model with numbers), and the ChatML chat template below also
renders tools, tool calls and tool responses.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterable

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

PAD, BOS, EOS, MASK = "<|pad|>", "<|bos|>", "<|eos|>", "<|mask|>"
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
FIM_PREFIX, FIM_SUFFIX, FIM_MIDDLE = "<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"
TOOL_CALL, TOOL_CALL_END = "<tool_call>", "</tool_call>"
TOOL_RESPONSE, TOOL_RESPONSE_END = "<tool_response>", "</tool_response>"
ENDOFTEXT = "<|endoftext|>"  # separates documents when pre-training on packed sequences

# Order == id. Never reorder: checkpoints store ids, not strings.
SPECIAL_TOKENS: list[str] = [
    PAD, BOS, EOS, MASK, IM_START, IM_END, FIM_PREFIX, FIM_SUFFIX, FIM_MIDDLE,
    TOOL_CALL, TOOL_CALL_END, TOOL_RESPONSE, TOOL_RESPONSE_END, ENDOFTEXT,
    "<|reserved_0|>", "<|reserved_1|>",
]
PAD_ID, BOS_ID, EOS_ID, MASK_ID = 0, 1, 2, 3
IM_START_ID, IM_END_ID = 4, 5
FIM_PREFIX_ID, FIM_SUFFIX_ID, FIM_MIDDLE_ID = 6, 7, 8
TOOL_CALL_ID, TOOL_CALL_END_ID, TOOL_RESPONSE_ID, TOOL_RESPONSE_END_ID = 9, 10, 11, 12
ENDOFTEXT_ID = 13
VOCAB_SIZE = 8192
MODEL_MAX_LENGTH = 2048

# ChatML. Every literal sits inside {{ }} and every tag strips whitespace, so the output does
# not depend on trim_blocks/lstrip_blocks. `generation` marks what the assistant must learn to
# produce (transformers' return_assistant_tokens_mask).
CHAT_TEMPLATE = r"""
{%- macro text(content) -%}
  {%- if content is string -%}{{- content -}}
  {%- elif content is iterable and content is not mapping -%}
    {%- for part in content -%}{%- if part.type == 'text' -%}{{- part.text -}}{%- endif -%}{%- endfor -%}
  {%- endif -%}
{%- endmacro -%}
{%- set ns = namespace(start=0) -%}
{%- if tools -%}
  {{- '<|im_start|>system\n' -}}
  {%- if messages and messages[0].role == 'system' -%}
    {{- text(messages[0].content) + '\n\n' -}}
    {%- set ns.start = 1 -%}
  {%- endif -%}
  {{- 'You can call the following tools. Each line is the JSON signature of one tool:\n' -}}
  {%- for tool in tools -%}
    {{- (tool.function if tool.function is defined else tool) | tojson + '\n' -}}
  {%- endfor -%}
  {{- 'To call a tool, answer with <tool_call>{"name": <tool name>, "arguments": {<arguments as JSON>}}</tool_call>, one block per call.<|im_end|>\n' -}}
{%- endif -%}
{%- for message in messages[ns.start:] -%}
  {%- if message.role == 'tool' -%}
    {%- if loop.first or loop.previtem.role != 'tool' -%}{{- '<|im_start|>user' -}}{%- endif -%}
    {{- '\n<tool_response>\n' -}}
    {%- if message.content is string -%}{{- message.content -}}{%- else -%}{{- message.content | tojson -}}{%- endif -%}
    {{- '\n</tool_response>' -}}
    {%- if loop.last or loop.nextitem.role != 'tool' -%}{{- '<|im_end|>\n' -}}{%- endif -%}
  {%- elif message.role == 'assistant' -%}
    {{- '<|im_start|>assistant\n' -}}
    {%- generation -%}
      {%- set content = text(message.content) -%}
      {{- content -}}
      {%- if message.tool_calls -%}
        {%- for call in message.tool_calls -%}
          {%- set fn = call.function if call.function is defined else call -%}
          {%- if content or not loop.first -%}{{- '\n' -}}{%- endif -%}
          {{- '<tool_call>{"name": ' + fn.name | tojson + ', "arguments": ' -}}
          {%- if fn.arguments is string -%}{{- fn.arguments -}}{%- else -%}{{- fn.arguments | tojson -}}{%- endif -%}
          {{- '}</tool_call>' -}}
        {%- endfor -%}
      {%- endif -%}
      {{- '<|im_end|>' -}}
    {%- endgeneration -%}
    {{- '\n' -}}
  {%- else -%}
    {{- '<|im_start|>' + message.role + '\n' + text(message.content) + '<|im_end|>\n' -}}
  {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\n' -}}{%- endif -%}
""".strip()


def _pre_tokenizer() -> pre_tokenizers.PreTokenizer:
    # Digits first, then GPT-2 style byte-level splitting; no prefix space so "def" at the start
    # of a file is the same token as after a newline.
    return pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])


def train_tokenizer(texts: Iterable[str], vocab_size: int = VOCAB_SIZE,
                    min_frequency: int = 2) -> Tokenizer:
    """Train byte-level BPE; `vocab_size` counts the 16 specials and the 256 byte symbols."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = _pre_tokenizer()
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=min_frequency, special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    for i, token in enumerate(SPECIAL_TOKENS):  # cheap guard: ids are a contract
        if tok.token_to_id(token) != i:
            raise RuntimeError(f"special token {token} got id {tok.token_to_id(token)}, want {i}")
    return tok


def hf_tokenizer_config(model_max_length: int = MODEL_MAX_LENGTH) -> dict[str, Any]:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "mask_token": MASK,
        "unk_token": None,  # byte-level BPE has no unknown input
        "additional_special_tokens": SPECIAL_TOKENS[4:],
        "model_max_length": model_max_length,
        "padding_side": "right",
        "add_bos_token": False,
        "add_eos_token": False,
        # Must stay False: the default "cleanup" rewrites " ." and " 's" and breaks code.
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }


def save_hf_tokenizer(tok: Tokenizer, out_dir: Path | str,
                      model_max_length: int = MODEL_MAX_LENGTH) -> Path:
    """Write tokenizer.json, tokenizer_config.json and special_tokens_map.json into out_dir."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    config = hf_tokenizer_config(model_max_length)
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False)
                                               + "\n", encoding="utf-8")
    special_map = {k: config[k] for k in ("bos_token", "eos_token", "pad_token", "mask_token",
                                          "additional_special_tokens")}
    (out / "special_tokens_map.json").write_text(json.dumps(special_map, indent=2) + "\n",
                                                 encoding="utf-8")
    return out


def _jinja_env():
    """Jinja environment matching transformers' chat-template one (sandbox, tojson, generation)."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class _Generation(jinja2.ext.Extension):
        # `{% generation %}` only marks assistant spans for transformers; here it renders as-is.
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

        def _render(self, caller):
            return caller()

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    return env


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # Jinja's own tojson HTML-escapes "<" and "&"; transformers swaps in plain json.dumps.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


_TEMPLATE = None  # compiled on first use


def render_chat(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
                add_generation_prompt: bool = False) -> str:
    """Render CHAT_TEMPLATE exactly as `apply_chat_template(..., tokenize=False)` would."""
    global _TEMPLATE
    if _TEMPLATE is None:
        _TEMPLATE = _jinja_env().from_string(CHAT_TEMPLATE)
    return _TEMPLATE.render(messages=messages, tools=tools,
                            add_generation_prompt=add_generation_prompt)

