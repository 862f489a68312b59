"""Issue 31's prepared check, second shape: LLaDA2.0-mini's MoE (scripts/device_check_block.py runs it after the
1.7B dense shape, or alone with `--shapes llada2-mini`).

The shape (../shared/reference/families.md section 5.1): hidden 2048, 20 layers (layer 0 a dense SwiGLU of 5120,
layers 1-19 MoE), 16 query / 4 KV heads of 128, 256 experts of 512 with top-8 routing in 8 groups (top 4 kept)
plus one shared expert, vocabulary 157,184, untied output head: 16.3B parameters, 32.5 GB in bf16, so it fits
one H100 (78 GiB) or H200 beside the 1.7B model. Writing and reading 32.5 GB of random safetensors would take
most of the call, so the weights are drawn on the device instead, in the names and shapes a checkpoint holds
(tests/tiny_checkpoints.llada2_tensors), renamed by the family's own `to_canonical` and assigned to the model
built on the meta device: what `load_model` does, minus the file. `--tiny`: 2 layers of 16 experts.

Rows (the block part's table): the static step with CUDA graphs at each batch with 1 and 4 tokens per forward
(topk) and threshold 0.9; the eager step only at batch 1 with 4 tokens per forward (its MoE loop reads the
chosen experts back and runs each expert apart, ~5 launches per expert and layer: hundreds of milliseconds
a forward at this shape), which is also the identity check; host reads per step, both paths, at batch 1.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

import torch

LLADA2_MINI = dict(hidden_size=2048, num_hidden_layers=20, num_attention_heads=16, num_key_value_heads=4, head_dim=128,
                   intermediate_size=5120, moe_intermediate_size=512, num_experts=256, num_experts_per_tok=8,
                   num_shared_experts=1, n_group=8, topk_group=4, first_k_dense_replace=1, max_position_embeddings=32768)
TINY_MOE = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                intermediate_size=128, moe_intermediate_size=32, num_experts=16, num_experts_per_tok=4,
                num_shared_experts=1, n_group=4, topk_group=2, first_k_dense_replace=1, max_position_embeddings=4096)
MOE_MODES = ("topk1", "topk4", "threshold0.9")


class DeviceInit:
    """tests/tiny_checkpoints._Init drawing on the device in the target dtype (matrices and norms); `gen` stays a
    CPU generator, for the few small draws llada2_tensors makes itself (the routers' expert bias)."""

    def __init__(self, seed: int, device: str, dtype: torch.dtype):
        from tiny_checkpoints import INIT_STD, NORM_NOISE

        self.device, self.dtype, self.std, self.noise = device, dtype, INIT_STD, NORM_NOISE
        self.gen = torch.Generator().manual_seed(seed)
        self.dgen = torch.Generator(device=device).manual_seed(seed)

    def matrix(self, *shape: int, std: float | None = None) -> torch.Tensor:
        t = torch.randn(*shape, generator=self.dgen, device=self.device, dtype=self.dtype)
        return t.mul_(self.std if std is None else std)

    def norm(self, n: int) -> torch.Tensor:
        return torch.randn(n, generator=self.dgen, device=self.device, dtype=self.dtype).mul_(self.noise).add_(1.0)


def write_config(out: Path, tiny: bool) -> Path:
    """A LLaDA2 directory (config, tokenizer) of the shape, without weights: make_llada2 at a 1-layer, 2-expert
    size for the tokenizer files, then config.json rewritten to the shape."""
    from tiny_checkpoints import llada2_config, make_llada2

    make_llada2(out, dtype="bfloat16", hidden_size=32, num_hidden_layers=1, num_experts=4, n_group=2, topk_group=1,
                num_experts_per_tok=2)
    (out / "model.safetensors").unlink()
    cfg = llada2_config(torch.bfloat16, **(TINY_MOE if tiny else LLADA2_MINI))  # blocks of 32: the family's own
    (out / "config.json").write_text(json.dumps(dict(sorted(cfg.items())), indent=1))
    return out


def build_model(out: Path, device: str, tiny: bool, seed: int = 0):
    """(model, spec) with random bf16 weights drawn on `device` (see the module's docstring)."""
    from tiny_checkpoints import llada2_tensors
    from unmask.models.loader import _skip_init, load_spec
    from unmask.models.transformer import DiffusionTransformer

    spec = load_spec(write_config(out, tiny))
    with _skip_init(), torch.device("meta"):
        model = (spec.family.model_class or DiffusionTransformer)(spec.arch)
    cfg = json.loads((out / "config.json").read_text())
    canon = spec.family.to_canonical(llada2_tensors(cfg, DeviceInit(seed, device, torch.bfloat16)), spec.arch)
    model.load_state_dict(canon, strict=True, assign=True)  # every weight the model has, no other
    del canon
    model = model.to(device=device, dtype=torch.bfloat16).eval().requires_grad_(False)
    return model, spec


def run_moe(args, report: dict) -> None:
    """The MoE rows into report["moe"], its identity into report["moe_identity"], its host reads into
    report["moe_host_syncs"]; sections past the time budget are skipped and marked."""
    import tempfile

    from device_check_block import guarded, host_syncs, host_time, log, over_budget, save, unmask_speed

    if over_budget(args, 60):
        report["moe"] = [{"skipped": "time budget"}]
        return
    t0 = time.perf_counter()
    model, spec = build_model(Path(tempfile.mkdtemp()) / "llada2", args.device, args.tiny)
    report["moe_shape"] = {"name": "tiny" if args.tiny else "LLaDA2.0-mini",
                           "parameters": sum(p.numel() for p in model.parameters()),
                           "build_s": time.perf_counter() - t0}
    log(f"MoE model built on {args.device}: {report['moe_shape']}")
    guarded("moe", report, unmask_speed, model, spec, args, report, args.out, "moe", MOE_MODES,
            [(args.batches[0], "topk4")])
    save(report, args.out)
    guarded("moe host syncs", report, host_syncs, model, spec, args, report, "moe_host_syncs")
    guarded("moe host time", report, host_time, model, spec, args, report, "moe_host_time")
    save(report, args.out)
    del model
    if args.device.startswith("cuda"):
        torch.cuda.empty_cache()
