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
    tensors = list(tensors)
    total = torch.zeros((), dtype=torch.float64, device=device)
    with torch.no_grad():
        for dtype in dict.fromkeys(t.dtype for t in tensors):  # in order of appearance: the same sum every run
            group = [t for t in tensors if t.dtype == dtype]
            norms = torch._foreach_norm(group, 2, dtype=torch.promote_types(dtype, torch.float32))
            total += torch.stack(norms).double().pow(2).sum()
    return total


_ROW = 2048


def sum_of_squares_flat(flats: Iterable[torch.Tensor], device: torch.device | str) -> torch.Tensor:
    """Σ‖t‖² over long flat (1-d) buffers, as `sum_of_squares`, in rows of 2048 values.

    One fp32 norm over a whole buffer drifts: the CPU's accumulates in fp32 (3.1M values: off by
    1e-4), and an fp64 norm costs 20× (9 ms against 0.4 ms, one thread). Each row's norm in fp32,
    their squares summed in fp64: 4e-9 at the cost of the fp32 pass, one kernel per buffer.
    """
    total = torch.zeros((), dtype=torch.float64, device=device)
    with torch.no_grad():
        for flat in flats:
            whole = flat.numel() // _ROW * _ROW
            dtype = torch.promote_types(flat.dtype, torch.float32)
            for part in (flat[:whole].view(-1, _ROW), flat[whole:].view(1, -1)):
                if part.numel():
                    total += torch.linalg.vector_norm(part, dim=1, dtype=dtype).double().pow(2).sum()
    return total
