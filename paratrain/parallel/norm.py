"""The squared gradient norm of many tensors without a Python loop of small kernels per tensor."""

from __future__ import annotations

from typing import Iterable

import torch


def sum_of_squares(tensors: Iterable[torch.Tensor], device: torch.device | str) -> torch.Tensor:
    """Σ‖t‖² over `tensors` as a 0-d fp64 tensor on `device` (zero when there is none).

    One `_foreach_norm` per dtype, each tensor's norm taken in at least fp32 (a bf16 gradient's
    squares would lose their low bits), the per-tensor norms squared and summed in fp64, so the
    total does not depend on how many tensors there are. It stays on the device: no host sync.
    """
    groups: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault(torch.promote_types(t.dtype, torch.float32), []).append(t.detach())
    total = torch.zeros((), dtype=torch.float64, device=device)
    for dtype, group in groups.items():
        total += torch.stack(torch._foreach_norm(group, 2, dtype=dtype)).double().pow(2).sum()
    return total
