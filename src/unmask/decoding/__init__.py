"""Decoding: token proposals (sampling), commit schedules and unmasking policies; pure tensor functions."""

from .policies import POLICIES, BlockState, CreditState, Decision, PolicyConfig, decide
from .sampling import Proposal, SamplingParams, propose
from .schedules import dream_count, even_split

__all__ = [
    "SamplingParams",
    "Proposal",
    "propose",
    "PolicyConfig",
    "BlockState",
    "CreditState",
    "Decision",
    "decide",
    "POLICIES",
    "even_split",
    "dream_count",
]
