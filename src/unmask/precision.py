"""Whether a device computes bf16 natively, so defaults (training autocast, serving dtype) follow the hardware.

On a CPU without native bf16 arithmetic (AVX512-BF16 or AMX) PyTorch converts every bf16 GEMM operand
in software: measured on a 2-core AMD EPYC (Zen 3, AVX2 only), the AR twin's training did not reach
step 10 of 1400 in 8 minutes with bf16 autocast, against ~1,950 tokens/s in float32 (docs/training.md).
Where it is native, bf16 weights halve the bytes a small-batch decode step reads, and that step is
bound by memory bandwidth (docs/benchmarks.md). CUDA devices report their own support.
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
