"""Whether bf16 autocast pays on a device, so the training default follows the hardware (unmask.precision)."""
from __future__ import annotations

import torch

from unmask.precision import bf16_is_fast

__all__ = ["bf16_is_fast", "use_bf16"]


def use_bf16(setting: bool | None, device: torch.device | str) -> bool:
    """An explicit setting wins; None (auto) means bf16 autocast where the device computes it natively."""
    return bf16_is_fast(device) if setting is None else setting
