"""Non-tensor training state as strict JSON: shared state (step, config, schedule) and per-rank state (RNG, sampler).

The values a trainer keeps beside the model are mostly plain (ints, floats,
strings, nested dicts and lists) with a few small binary pieces: RNG states
are uint8 tensors, a best loss may be ``inf``. `encode_state` turns such a
value into strict JSON (what `json.dumps(..., allow_nan=False)` accepts) and
`decode_state` turns it back:

* a tensor becomes ``{"__tensor__": {"dtype", "shape", "data": base64}}`` and
  comes back as a CPU tensor of the same dtype, shape and bytes;
* ``bytes`` become ``{"__bytes__": base64}``;
* a non-finite float becomes ``{"__float__": "nan" | "inf" | "-inf"}``;
* a tuple becomes a list (JSON has one sequence type; convert back if needed).

Dict keys must be strings (JSON would silently turn ``1`` into ``"1"``). The
three marker keys are reserved. Tensors here are meant to be small: large
ones belong in shards, which are stored as safetensors.
"""

from __future__ import annotations

import base64
import math
from typing import Any

import torch

from paratrain.checkpoint.format import CheckpointError, dtype_name, torch_dtype

_TENSOR, _BYTES, _FLOAT = "__tensor__", "__bytes__", "__float__"
_RESERVED = (_TENSOR, _BYTES, _FLOAT)


def encode_state(value: Any, where: str = "state") -> Any:
    """A strict-JSON form of `value`; CheckpointError naming the path (e.g. ``state['rng'][2]``) of anything else."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else {_FLOAT: str(value)}
    if isinstance(value, torch.Tensor):
        return {_TENSOR: _encode_tensor(value, where)}
    if isinstance(value, (bytes, bytearray, memoryview)):
        return {_BYTES: base64.b64encode(bytes(value)).decode("ascii")}
    if isinstance(value, (list, tuple)):
        return [encode_state(v, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, dict):
        out = {}
        for key, v in value.items():
            if not isinstance(key, str):
                raise CheckpointError(f"{where} has the key {key!r} of type {type(key).__name__}; "
                                      f"state dict keys must be strings (JSON)")
            if key in _RESERVED:
                raise CheckpointError(f"{where} uses the reserved key {key!r}; rename it")
            out[key] = encode_state(v, f"{where}[{key!r}]")
        return out
    raise CheckpointError(f"{where} is a {type(value).__name__}, which checkpoint state cannot hold; "
                          f"use numbers, strings, lists, dicts, bytes or tensors")


def decode_state(value: Any) -> Any:
    """The value `encode_state` encoded (tuples come back as lists, tensors on the CPU)."""
    if isinstance(value, list):
        return [decode_state(v) for v in value]
    if not isinstance(value, dict):
        return value
    if len(value) == 1:
        (key, inner), = value.items()
        if key == _TENSOR:
            return _decode_tensor(inner)
        if key == _BYTES:
            return base64.b64decode(inner)
        if key == _FLOAT:
            return float(inner)
    return {k: decode_state(v) for k, v in value.items()}


def _encode_tensor(t: torch.Tensor, where: str) -> dict:
    try:
        name = dtype_name(t.dtype)
    except CheckpointError as exc:
        raise CheckpointError(f"{where}: {exc}") from None
    flat = t.detach().to("cpu").contiguous().reshape(-1)
    data = flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""
    return {"dtype": name, "shape": list(t.shape), "data": base64.b64encode(data).decode("ascii")}


def _decode_tensor(doc: dict) -> torch.Tensor:
    try:
        dtype, shape, data = torch_dtype(doc["dtype"]), doc["shape"], base64.b64decode(doc["data"])
    except (KeyError, TypeError, ValueError) as exc:
        raise CheckpointError(f"a stored state tensor is malformed ({exc!r})") from None
    if not data:
        return torch.empty(shape, dtype=dtype, device="cpu")
    # bytearray: frombuffer needs a writable buffer to hand out a tensor without a warning.
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(dtype).reshape(shape).clone()
