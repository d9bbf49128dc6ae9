"""The squared gradient norm of many tensors without a Python loop of small kernels per tensor."""

from __future__ import annotations

from typing import Iterable

import torch


def sum_of_squares(tensors: Iterable[torch.Tensor], device: torch.device | str, *, wide: bool = False) -> torch.Tensor:
    """Σ‖t‖² over `tensors` as a 0-d fp64 tensor on `device` (zero when there is none).

    One `_foreach_norm` per dtype, each tensor's norm taken in at least fp32 (a bf16 gradient's
    squares would lose their low bits), the per-tensor norms squared and summed in fp64, so the
    total does not depend on how many tensors there are. It stays on the device: no host sync.
    `wide`: each norm taken in fp64, for long flat buffers (the CPU's fp32 norm of 1.6M values is
    off by 4e-5; a parameter's norm is a far shorter sum).
    """
    tensors = list(tensors)
    total = torch.zeros((), dtype=torch.float64, device=device)
    with torch.no_grad():
        for dtype in dict.fromkeys(t.dtype for t in tensors):  # in order of appearance: the same sum every run
            group = [t for t in tensors if t.dtype == dtype]
            norms = torch._foreach_norm(group, 2, dtype=torch.promote_types(dtype, torch.float64 if wide else torch.float32))
            total += torch.stack(norms).double().pow(2).sum()
    return total
