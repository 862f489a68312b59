"""Events the engine emits after each step, one per request that advanced."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class StepOutput:
    request_id: str
    new_token_ids: list[int]          # newly final tokens, append-only
    text_delta: str                   # their text (stop strings already cut)
    finished: bool
    finish_reason: str | None         # "stop" | "length" | "abort"
    num_prompt_tokens: int
    num_generated: int
    forwards: int                     # forwards this request took part in so far
    snapshot: list[int] | None = None  # committed prefix + active block with masks (diffusing view)
    new_logprobs: list[float] | None = None
    new_top_logprobs: list[list[tuple[int, float]]] | None = None  # per new token: (id, logprob), most likely first
    error: Exception | None = None    # the request failed (finished): a constrained answer that failed its check
    edits: int = 0                    # committed tokens replaced so far (edit_threshold; docs/decoding.md)
    remasks: int = 0                  # committed tokens put back to mask so far (remask_budget)
    edited: list[int] | None = None   # with snapshots: output indices this step replaced or remasked


@dataclass
class RequestOutput:
    request_id: str
    prompt_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str | None
    forwards: int
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None
    prefill_forwards: int = 0          # of `forwards`, the chunks of a prompt too long for one step's token budget

    @property
    def tokens_per_forward(self) -> float:
        return len(self.token_ids) / max(self.forwards, 1)

    @property
    def decoding_forwards(self) -> int:
        """Forwards that decoded (the first one also carries the prompt, or what of it the chunks left)."""
        return self.forwards - self.prefill_forwards
