"""Structured outputs and tool calling, enforced inside the denoising loop.

spec.py        what a request constrains its output to (no heavy imports; carried by GenerationParams)
backend.py     llguidance: token table, grammar compilation (unsupported features -> 400), matchers
constraint.py  the per-request matcher and the draft-verify step the engine's Sequence calls
tools.py       tool-call formats per family: prompt fallback, call grammar, output parsers
See docs/structured-outputs.md.
"""
from unmask.structured.spec import StructuredSpec, from_request, from_response_format

__all__ = ["StructuredSpec", "from_request", "from_response_format"]
