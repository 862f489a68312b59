"""Whether bf16 autocast pays on a device, so the training default follows the hardware.

On a CPU without native bf16 arithmetic (AVX512-BF16 or AMX) PyTorch converts every bf16 GEMM operand
in software: measured on this project's 2-core AMD EPYC (Zen 3, AVX2 only), the AR twin's training did
not reach step 10 of 1400 in 8 minutes with bf16 autocast, against ~1,950 tokens/s in float32
(docs/training.md). CUDA devices report their own support.
"""
from __future__ import annotations

import torch


def bf16_is_fast(device: torch.device | str) -> bool:
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    if device.type == "cpu":
        # private but stable helpers (torch >= 2.3); without them, assume no native bf16
        probes = (getattr(torch.cpu, "_is_avx512_bf16_supported", None), getattr(torch.cpu, "_is_amx_tile_supported", None))
        return any(p is not None and p() for p in probes)
    return False


def use_bf16(setting: bool | None, device: torch.device | str) -> bool:
    """An explicit setting wins; None (auto) means bf16 autocast where the device computes it natively."""
    return bf16_is_fast(device) if setting is None else setting
