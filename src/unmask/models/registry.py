"""Registry of model families: `architectures` entry -> implementation and traits."""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Callable, Literal

from torch import Tensor

from unmask.errors import UnsupportedModelError
from unmask.models.transformer import ArchConfig

StateDict = dict[str, Tensor]


@dataclass(frozen=True)
class Renames:
    """Bidirectional parameter-name table; `{i}` / `{e}` stand for layer / expert numbers."""

    pairs: tuple[tuple[str, str], ...]  # (checkpoint name, canonical name)

    @staticmethod
    def _regex(template: str) -> re.Pattern:
        pat = re.escape(template).replace(r"\{i\}", r"(?P<i>\d+)").replace(r"\{e\}", r"(?P<e>\d+)")
        return re.compile(pat + "$")

    def _map(self, name: str, forward: bool) -> str | None:
        for src, dst in self.pairs:
            if not forward:
                src, dst = dst, src
            m = self._regex(src).match(name)
            if m:
                return dst.format(**m.groupdict())
        return None

    def to_canonical(self, name: str) -> str | None:
        return self._map(name, True)

    def from_canonical(self, name: str) -> str | None:
        return self._map(name, False)


QWEN_NAMES = Renames(())  # canonical layout *is* the Qwen layout


@dataclass(frozen=True)
class Family:
    name: str
    architectures: tuple[str, ...]
    attention: Literal["bidirectional", "block_causal", "encoder_decoder"]
    shift: bool                       # logits at i predict token i+1 (Dream, Fast-dLLM v2)
    default_mask_id: int
    default_block_size: int
    parse_config: Callable[[dict], ArchConfig]
    renames: Renames = QWEN_NAMES
    extra_stop_ids: tuple[int, ...] = ()
    block_size_keys: tuple[str, ...] = ("block_size",)
    ar_first_token: bool = False      # first token of each block taken greedily from the commit pass
    # config.json key that sets `shift` per checkpoint (unmask: an AR-initialised model keeps its
    # next-token head, as Fast-dLLM v2 does); a shifted block-causal model of such a family also
    # takes each block's first token from the commit pass, which is what its objective trains
    shift_key: str | None = None
    # config.json key that marks a shifted block-causal checkpoint whose committed blocks are written with
    # token-causal attention (a causal context: unmask.train.objectives); absent or false: block-causal
    context_key: str | None = None
    # checkpoint-format hooks for parameters that are not 1:1 renames (fused QKV)
    split_params: Callable[[StateDict, ArchConfig], StateDict] | None = None
    fuse_params: Callable[[StateDict, ArchConfig], StateDict] | None = None
    ignore_params: tuple[str, ...] = field(default=())  # regexes of stored names we do not need
    # families whose network or decoding procedure differs from the masked-diffusion decoder
    model_class: type | None = None          # default: DiffusionTransformer(parse_config(config))
    sequence_class: type | None = None       # default: engine.sequence.Sequence

    def shifted(self, config: dict) -> bool:
        if self.shift_key is not None and self.shift_key in config:
            return bool(config[self.shift_key])
        return self.shift

    def causal_context(self, config: dict) -> bool:
        return self.context_key is not None and bool(config.get(self.context_key))

    def first_token_from_commit(self, config: dict) -> bool:
        return self.ar_first_token or (self.shift_key is not None and self.shifted(config)
                                       and self.attention == "block_causal")

    def mask_id(self, config: dict) -> int:
        return int(config.get("mask_token_id", self.default_mask_id))

    def block_size(self, config: dict) -> int:
        for k in self.block_size_keys:
            if config.get(k):
                return int(config[k])
        return self.default_block_size

    def to_canonical(self, state: StateDict, arch: ArchConfig) -> StateDict:
        if self.split_params:
            state = self.split_params(state, arch)
        out: StateDict = {}
        for name, t in state.items():
            if any(re.match(p, name) for p in self.ignore_params):
                continue
            canon = self.renames.to_canonical(name) if self.renames.pairs else name
            out[canon or name] = t
        return out

    def from_canonical(self, state: StateDict, arch: ArchConfig) -> StateDict:
        out = {}
        for name, t in state.items():
            out[(self.renames.from_canonical(name) if self.renames.pairs else None) or name] = t
        return self.fuse_params(out, arch) if self.fuse_params else out


FAMILIES: dict[str, Family] = {}


def register(family: Family) -> Family:
    for arch in family.architectures:
        FAMILIES[arch] = family
    return family


def family_for(config: dict) -> Family:
    _import_families()
    archs = config.get("architectures") or []
    archs = [a for a in (archs if isinstance(archs, list) else [archs]) if isinstance(a, str)]
    for a in archs:
        if a in FAMILIES:
            return FAMILIES[a]
    named = ", ".join(archs) if archs else f"model_type {config.get('model_type')!r} (no 'architectures')"
    raise UnsupportedModelError(f"unsupported architecture {named}; supported: {', '.join(sorted(FAMILIES))}")


def _import_families() -> None:
    # imported for their register() side effect
    from unmask.models import diffusion_gemma, dream, fast_dllm, llada, llada2, sdar, unmask_lm  # noqa: F401


def supported_architectures() -> list[str]:
    _import_families()
    return sorted(FAMILIES)
