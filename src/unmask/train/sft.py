"""Supervised fine-tuning rows from JSONL: chats (via the tokenizer's chat template) and FIM.

Each record becomes one row of `seq_len` tokens. The prompt stays clean and out of the loss;
the assistant turns, and the EOS padding that fills the row after the last one, are noised and
scored, as in the LLaDA and SDAR SFT recipes, so the model learns to end its answer with EOS.

    {"messages": [{"role": ..., "content": ...}, ...], "tools"?: [...]}
    {"fim": {"prefix": ..., "suffix": ..., "middle": ...}}
        -> <|fim_prefix|>prefix<|fim_suffix|>suffix<|fim_middle|>middle<|eos|>, loss on middle + EOS
"""
from __future__ import annotations

import json
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch

from unmask.train.data import DataError, TokenRows

FIM_TOKENS = ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>")


@dataclass
class SFTReport:
    records: int = 0
    skipped: list[tuple[int, str]] = field(default_factory=list)  # (line number, reason)
    too_long: int = 0


def read_jsonl(path: str | Path, on_error: Literal["skip", "raise"] = "raise") -> tuple[list[tuple[int, dict]], SFTReport]:
    """(line number, record) pairs of valid lines; malformed lines raise or are skipped with a warning."""
    if on_error not in ("raise", "skip"):
        raise DataError(f"on_error must be one of raise, skip, got {on_error!r}")
    path = Path(path)
    if path.is_dir():
        raise DataError(f"SFT data {str(path)!r} is a directory, not a JSONL file")
    if not path.is_file():
        raise DataError(f"SFT data {str(path)!r} not found")
    report, out = SFTReport(), []
    # surrogateescape keeps undecodable bytes as lone surrogates, so such a line is found and reported
    # as malformed instead of being trained on with U+FFFD in place of the text it held
    with open(path, encoding="utf-8", errors="surrogateescape") as fh:
        for n, line in enumerate(fh, 1):
            if not line.strip():
                continue
            problem = None
            try:
                line.encode("utf-8")
                rec = json.loads(line)
                problem = validate_record(rec)
            except UnicodeEncodeError as e:
                problem = f"not valid UTF-8 (byte 0x{ord(line[e.start]) - 0xDC00:02x} at column {e.start + 1})"
            except json.JSONDecodeError as e:
                problem = f"invalid JSON ({e.msg} at column {e.colno})"
            if problem is None:
                out.append((n, rec))
            elif on_error == "raise":
                raise DataError(f"{path}:{n}: {problem}")
            else:
                report.skipped.append((n, problem))
    _warn_skipped(path, report)
    report.records = len(out)
    return out, report


def _warn_skipped(path: Path, report: SFTReport) -> None:
    if report.skipped:
        lines = ", ".join(str(n) for n, _ in report.skipped[:10]) + (" ..." if len(report.skipped) > 10 else "")
        n, why = report.skipped[0]
        warnings.warn(f"{path}: skipped {len(report.skipped)} malformed line(s): {lines} "
                      f"(line {n}: {why})", stacklevel=3)


def validate_record(rec: Any) -> str | None:
    """Why a record cannot be used, or None."""
    if not isinstance(rec, dict):
        return "not a JSON object"
    if "fim" in rec:
        fim = rec["fim"]
        if not isinstance(fim, dict) or not all(isinstance(fim.get(k), str) for k in ("prefix", "suffix", "middle")):
            return "'fim' must be an object with string fields prefix, suffix, middle"
        return None
    msgs = rec.get("messages")
    if not isinstance(msgs, list) or not msgs:
        return "needs a non-empty 'messages' list or a 'fim' object"
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            return f"messages[{i}] is not an object with a string 'role'"
        if m.get("content") is None and not m.get("tool_calls"):
            return f"messages[{i}] has no content"
    if not any(m["role"] == "assistant" for m in msgs):
        return "no assistant message to learn from"
    if "tools" in rec and not isinstance(rec["tools"], list):
        return "'tools' must be a list"
    return None


class SFTEncoder:
    """Record -> (token ids, loss mask) with any Hugging Face tokenizer that has a chat template.

    Assistant spans are found by rendering the conversation up to each assistant turn with the
    generation prompt (a prefix of the full rendering in ChatML, Llama-3 and LLaDA templates)
    and are cut after their first stop token, so template text that follows a turn (a newline,
    LLaDA's always-appended header) stays out of the loss.
    """

    def __init__(self, tokenizer, eos_id: int, stop_ids: tuple[int, ...]):
        self.tok = tokenizer  # unmask.tokenizer.Tokenizer
        self.eos_id = eos_id
        self.stop_ids = set(stop_ids) | {eos_id}

    def encode(self, rec: dict) -> tuple[list[int], list[bool]]:
        if "fim" in rec:
            return self._fim(rec["fim"])
        return self._chat(rec["messages"], rec.get("tools"))

    def _fim(self, fim: dict) -> tuple[list[int], list[bool]]:
        ids = [self.tok.token_id(t) for t in FIM_TOKENS]
        if any(i is None for i in ids):
            raise DataError(f"the tokenizer has no FIM tokens {', '.join(FIM_TOKENS)}")
        pre, suf, mid = (self.tok.encode(fim[k]) for k in ("prefix", "suffix", "middle"))
        prompt = [ids[0], *pre, ids[1], *suf, ids[2]]
        answer = [*mid, self.eos_id]
        return prompt + answer, [False] * len(prompt) + [True] * len(answer)

    def _render(self, msgs: list[dict], tools, gen: bool) -> str:
        return self.tok.apply_chat_template(msgs, tools=tools, add_generation_prompt=gen)

    def _chat(self, msgs: list[dict], tools) -> tuple[list[int], list[bool]]:
        text = self._render(msgs, tools, gen=False)
        spans, cursor = [], 0
        for i, m in enumerate(msgs):
            if m["role"] != "assistant":
                continue
            prefix = self._render(msgs[:i], tools, gen=True) if i else ""
            upto = self._render(msgs[: i + 1], tools, gen=False)
            start, end = len(prefix), len(upto)
            if not (upto.startswith(prefix) and text.startswith(upto)) or start < cursor:
                # the template rewrites earlier turns or always appends a header: find the content
                content = m.get("content") if isinstance(m.get("content"), str) else ""
                found = text.find(content, cursor) if content else -1
                if found < 0:
                    raise DataError("cannot locate the assistant turn in the rendered chat template")
                start, end = found, len(text)
            spans.append((start, end))
            cursor = start
        enc = self.tok.hf(text, add_special_tokens=False, return_offsets_mapping=True)
        ids, offsets = enc["input_ids"], enc["offset_mapping"]
        mask = [False] * len(ids)
        last = 0
        for s, e in spans:
            k = next((j for j, (a, _) in enumerate(offsets) if a >= s), len(ids))
            while k < len(ids) and offsets[k][0] < e:
                mask[k] = True
                k += 1
                if ids[k - 1] in self.stop_ids:
                    break
            last = k
        # the row ends with the last assistant turn; EOS padding follows
        return ids[:last], mask[:last]


def build_sft_rows(records: list[tuple[int, dict]], encoder: SFTEncoder, seq_len: int, path: str | Path,
                   on_error: Literal["skip", "raise"] = "raise", report: SFTReport | None = None,
                   pack: bool = False) -> TokenRows:
    """Rows of records + EOS padding to seq_len; loss on answers (each ends with its stop token) and padding.

    `pack=False`: one record per row (the LLaDA recipe). `pack=True`: consecutive records share a row
    until it is full. Short records then stop costing a whole row of padding (a median 104-token
    record in a 512-token row wastes 80% of the compute); block-causal models still learn to end
    each answer because its stop token is in the loss.
    """
    report = report or SFTReport()
    ids_rows, mask_rows = [], []
    cur_ids: list[int] = []
    cur_mask: list[bool] = []
    used = 0

    def flush() -> None:
        pad = seq_len - len(cur_ids)
        ids_rows.append(cur_ids + [encoder.eos_id] * pad)
        mask_rows.append(cur_mask + [True] * pad)

    for n, rec in records:
        try:
            ids, mask = encoder.encode(rec)
        except DataError as e:
            if on_error == "raise":
                raise DataError(f"{path}:{n}: {e}") from None
            report.skipped.append((n, str(e)))
            continue
        except Exception as e:  # a chat template raising on this record
            if on_error == "raise":
                raise DataError(f"{path}:{n}: chat template failed: {e}") from None
            report.skipped.append((n, f"chat template failed: {e}"))
            continue
        if len(ids) > seq_len or not any(mask):
            report.too_long += len(ids) > seq_len
            continue
        if cur_ids and (not pack or len(cur_ids) + len(ids) > seq_len):
            flush()
            cur_ids, cur_mask = [], []
        cur_ids, cur_mask = cur_ids + ids, cur_mask + mask
        used += 1
    if cur_ids:
        flush()
    if report.too_long:
        warnings.warn(f"{path}: skipped {report.too_long} record(s) longer than seq_len {seq_len}", stacklevel=2)
    if not ids_rows:
        raise DataError(f"{path}: no usable SFT records (of {len(records)}; {report.too_long} too long, "
                        f"{len(report.skipped)} malformed)")
    report.records = used
    return TokenRows(torch.tensor(ids_rows, dtype=torch.int32), torch.tensor(mask_rows, dtype=torch.bool))


def load_sft(path: str | Path, encoder: SFTEncoder, seq_len: int,
             on_error: Literal["skip", "raise"] = "raise", pack: bool = False) -> tuple[TokenRows, SFTReport]:
    records, report = read_jsonl(path, on_error)
    n_skipped = len(report.skipped)
    rows = build_sft_rows(records, encoder, seq_len, path, on_error, report, pack)
    if len(report.skipped) > n_skipped:
        _warn_skipped(Path(path), SFTReport(skipped=report.skipped[n_skipped:]))
    return rows, report
