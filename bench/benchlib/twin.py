"""Decoders for the autoregressive twin (scripts/train_ar_twin.py): transformers, and llama.cpp if present.

Each decoder has the engine's task interface: `run(prompt_ids, max_tokens, stop_newline, min_tokens=0) -> Result`,
greedy, stopping at the twin's EOS ids or, for single-line tasks, after the first token past the first
`min_tokens` whose text contains a newline (the engine stops on the stop string "\n" with `min_tokens` the same
way: a next-line answer opens with a newline, its lead, and ends at the next one). Both sides then generate the
same answer, so tokens/s compares the same work.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch


@dataclass
class Result:
    text: str
    tokens: int
    forwards: int
    seconds: float


def twin_info(path: Path) -> dict:
    meta = path / "ar_twin.json"
    info = json.loads(meta.read_text()) if meta.is_file() else {}
    # the training run writes OUT/budget.json beside OUT/model; `make twin` copies it into the committed model
    for budget in (path / "budget.json", path.parent / "budget.json"):
        if budget.is_file():
            info["budget_detail"] = json.loads(budget.read_text())
            break
    cfg = json.loads((path / "config.json").read_text())
    info["architecture"] = (cfg.get("architectures") or ["?"])[0]
    return info


class HFTwin:
    """`model.generate` with its KV cache (DynamicCache), greedy."""

    name = "ar_twin_generate"

    def __init__(self, path: Path, dtype: str = "float32"):
        from transformers import AutoModelForCausalLM, AutoTokenizer
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
        self.path = path
        self.tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        self.model = AutoModelForCausalLM.from_pretrained(str(path), local_files_only=True,
                                                          dtype=getattr(torch, dtype)).eval()
        self.params = sum(p.numel() for p in self.model.parameters())
        gen = json.loads((path / "generation_config.json").read_text()) if (path / "generation_config.json").is_file() else {}
        eos = gen.get("eos_token_id", self.model.config.eos_token_id)
        self.eos = [eos] if isinstance(eos, int) else list(eos or [])
        self.pad = gen.get("pad_token_id", self.eos[0] if self.eos else 0)
        # tokens whose text contains a newline: a single-line answer ends with the first of them
        nl = [i for i in range(len(self.tok)) if "\n" in self.tok.decode([i])]
        self.newline_ids = torch.tensor(nl, dtype=torch.long)

    def _stop(self, prompt_len: int, min_tokens: int):
        from transformers import StoppingCriteria, StoppingCriteriaList

        ids = self.newline_ids

        class Newline(StoppingCriteria):
            def __call__(self, input_ids, scores, **kwargs):
                if input_ids.shape[1] - prompt_len <= min_tokens:  # the lead's token does not end the answer
                    return torch.zeros(input_ids.shape[0], dtype=torch.bool)
                return torch.isin(input_ids[:, -1], ids)

        return StoppingCriteriaList([Newline()])

    def _finish(self, new: list[int], seconds: float, forwards: int) -> Result:
        for i, t in enumerate(new):
            if t in self.eos:
                new = new[:i]
                break
        text = self.tok.decode(new, skip_special_tokens=True)
        return Result(text, len(new), forwards, seconds)

    def _generate_kwargs(self) -> dict:
        return {}

    def _cut(self, new: list[int], min_tokens: int) -> list[int]:
        return new   # one token a step: generation stopped at the newline

    @torch.no_grad()
    def run(self, prompt_ids: list[int], max_tokens: int, stop_newline: bool, min_tokens: int = 0) -> Result:
        ids = torch.tensor([prompt_ids], dtype=torch.long)
        t0 = time.perf_counter()
        out = self.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                                  do_sample=False, use_cache=True, eos_token_id=self.eos, pad_token_id=self.pad,
                                  stopping_criteria=self._stop(len(prompt_ids), min_tokens) if stop_newline else None,
                                  **self._generate_kwargs())
        seconds = time.perf_counter() - t0
        new = out[0, len(prompt_ids):].tolist()
        new = self._cut(new, min_tokens) if stop_newline else new
        return self._finish(new, seconds, len(new))


class HFTwinLookup(HFTwin):
    """The same `generate` with transformers' prompt lookup decoding (`prompt_lookup_num_tokens`: n-gram drafts
    copied from the prompt and output, verified by the model in one forward), what a transformers user turns on
    for speed; shares the weights of the plain twin. Several tokens may be accepted at once, so the newline stop
    looks at every new token past `min_tokens` and the answer is cut after the first newline, as the plain
    twin's one-token steps stop there."""

    name = "ar_twin_lookup"

    @classmethod
    def sharing(cls, other: HFTwin, lookup: int) -> "HFTwinLookup":
        obj = cls.__new__(cls)
        obj.__dict__.update(other.__dict__)
        obj.lookup = lookup
        return obj

    def _stop(self, prompt_len: int, min_tokens: int):
        from transformers import StoppingCriteria, StoppingCriteriaList

        ids = self.newline_ids

        class NewlineAnywhere(StoppingCriteria):
            def __call__(self, input_ids, scores, **kwargs):
                return torch.isin(input_ids[:, prompt_len + min_tokens:], ids).any(1)

        return StoppingCriteriaList([NewlineAnywhere()])

    def _generate_kwargs(self) -> dict:
        return {"prompt_lookup_num_tokens": self.lookup}

    def _cut(self, new: list[int], min_tokens: int) -> list[int]:
        nl = set(self.newline_ids.tolist())
        cut = next((i for i in range(min_tokens, len(new)) if new[i] in nl), None)
        return new if cut is None else new[:cut + 1]   # forwards stay unknown to generate's caller: tokens count


class HFTwinLoop(HFTwin):
    """The same model in a plain greedy loop over its KV cache: the model's cost without generate()'s
    per-call machinery (logits processors, criteria, config resolution), and with the linears unmask's `LLM`
    runs on the CPU (oneDNN on packed weights, unmask.models.cpu_linear), on its own copy of the weights: the
    like-for-like control for unmask's tokens per forward (same kernels, one token per forward)."""

    name = "ar_twin_loop"

    @classmethod
    def sharing(cls, other: HFTwin) -> "HFTwinLoop":
        import copy
        import inspect

        from unmask.models.cpu_linear import pack_linears

        obj = cls.__new__(cls)
        obj.__dict__.update(other.__dict__)
        obj.model = copy.deepcopy(other.model)  # packing swaps classes in place: generate()'s model stays plain
        obj.packed_linears = pack_linears(obj.model)
        # transformers renamed `past_key_values` to `cache` (5.x deprecation)
        names = inspect.signature(type(obj.model).forward).parameters
        obj._cache_kw = "cache" if "cache" in names else "past_key_values"
        return obj

    @torch.no_grad()
    def run(self, prompt_ids: list[int], max_tokens: int, stop_newline: bool, min_tokens: int = 0) -> Result:
        from transformers import DynamicCache

        nl = set(self.newline_ids.tolist()) if stop_newline else set()
        eos = set(self.eos)
        kw = self._cache_kw
        t0 = time.perf_counter()
        cache = DynamicCache()
        x = torch.tensor([prompt_ids], dtype=torch.long)
        new: list[int] = []
        for _ in range(max_tokens):
            out = self.model(input_ids=x, use_cache=True, logits_to_keep=1, **{kw: cache})
            t = int(out.logits[0, -1].argmax())
            new.append(t)
            if t in eos or (t in nl and len(new) > min_tokens):
                break
            x = torch.tensor([[t]], dtype=torch.long)
        seconds = time.perf_counter() - t0
        return self._finish(new, seconds, len(new))


class LlamaCppTwin:
    """The twin converted to GGUF, run by llama-cpp-python (greedy)."""

    name = "ar_twin_llama_cpp"

    def __init__(self, gguf: Path, hf: HFTwin, threads: int):
        from llama_cpp import Llama  # ImportError when llama-cpp-python is not installed

        self.llm = Llama(model_path=str(gguf), n_ctx=4096, n_threads=threads, n_batch=512, verbose=False,
                         logits_all=False)
        self.hf = hf  # decoding the text and the stop sets use the same tokenizer

    def logit_gap(self, prompt_ids: list[int]) -> float:
        """Max |llama.cpp - transformers (float32)| over the next-token logits of `prompt_ids`: is the GGUF file
        the same network? (on the 5.25M twin: 0.003 for a float32 file, 0.009 for float16.)"""
        import numpy as np

        self.llm.reset()
        self.llm.eval(prompt_ids)
        # without logits_all, llama-cpp-python keeps no scores: read the last row from the context itself
        last = self.llm._ctx.get_logits_ith(-1)
        mine = torch.from_numpy(np.ctypeslib.as_array(last, shape=(self.llm.n_vocab(),)).copy()).float()
        model = self.hf.model
        if next(model.parameters()).dtype != torch.float32:  # half-precision rounding alone moves logits ~0.1
            import copy

            model = copy.deepcopy(model).float()
        with torch.no_grad():
            ref = model(input_ids=torch.tensor([prompt_ids])).logits[0, -1].float()
        return float((mine[: ref.numel()] - ref).abs().max())

    def run(self, prompt_ids: list[int], max_tokens: int, stop_newline: bool, min_tokens: int = 0) -> Result:
        nl = set(self.hf.newline_ids.tolist()) if stop_newline else set()
        eos = set(self.hf.eos)
        t0 = time.perf_counter()
        self.llm.reset()
        new: list[int] = []
        for t in self.llm.generate(prompt_ids, top_k=1, temp=0.0, reset=True):
            new.append(int(t))
            if t in eos or (t in nl and len(new) > min_tokens) or len(new) >= max_tokens:
                break
        seconds = time.perf_counter() - t0
        return self.hf._finish(new, seconds, len(new))


def llama_cpp_version() -> str:
    import llama_cpp

    return getattr(llama_cpp, "__version__", "?")


def llama_cpp_status(twin_dir: Path | None, gguf: Path | None) -> tuple[Path | None, str]:
    """(gguf path or None, why not) for the llama.cpp decoder. Without --twin-gguf, the twin is written as
    TWIN/twin-f32.gguf on first use (gguf_export.py)."""
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return None, ("llama-cpp-python is not installed: PyPI has only its source distribution; "
                      "`make llama-cpp` builds it (about 15 minutes on 2 cores, see docs/benchmarks.md)")
    if gguf is None and twin_dir is not None:
        gguf = twin_dir / "twin-f32.gguf"
        if not gguf.is_file():
            try:
                from benchlib.gguf_export import export
            except ImportError as e:  # the `gguf` package
                return None, f"cannot write the twin's GGUF file: {e} (`make llama-cpp` installs it)"
            export(twin_dir, gguf, "f32")
    if gguf is None or not gguf.is_file():
        return None, f"no GGUF file of the twin at {gguf}"
    return gguf, ""


def llama_cpp_decoder(twin_dir: Path | None, gguf: Path | None, hf: HFTwin, threads: int,
                      probe_ids: list[int]) -> tuple["LlamaCppTwin | None", dict]:
    """The llama.cpp decoder of the twin, checked to be the same network (its next-token logits on `probe_ids`
    within 0.1 of transformers' in float32), and what to record: {"llama_cpp": "ran", gguf, logit gap, version} or
    {"llama_cpp": "skipped", "llama_cpp_reason": why}."""
    path, why = llama_cpp_status(twin_dir, gguf)
    if path is not None:
        try:
            lc = LlamaCppTwin(path, hf, threads)
            gap = lc.logit_gap(probe_ids)
            # not the same network: its tokens/s would compare different models (a float16 file's rounding
            # alone moves these logits by up to ~0.05 on 400-token prompts; another network by whole units)
            if gap > 0.1:
                raise RuntimeError(f"its next-token logits differ from transformers' by {gap:.3g}")
            return lc, {"llama_cpp": "ran", "llama_cpp_gguf": str(path), "llama_cpp_logit_gap": gap,
                        "llama_cpp_version": llama_cpp_version()}
        except Exception as e:  # a GGUF the installed llama.cpp cannot load, or a different network
            why = f"llama.cpp failed on {path}: {e}"
    return None, {"llama_cpp": "skipped", "llama_cpp_reason": why}
