"""A Hugging Face directory's safetensors read under a transformers model's own parameter names.

    init = weight_initializer(model, "Qwen3-0.6B/")   # init(name, full_shape) -> fp32, one tensor read at a time

The tensors of `paratrain.models.hf.HFCausalLM` are found by name in one file or in the shards an index
lists; each shape is checked against the meta-built model from the files' headers before anything is read,
and each tensor is read with plain file reads into memory of its own (no memory map: a rank then holds what
it keeps, never the file's pages). A ZeRO-3 shard asks for its rows alone (`DirectoryWeights.rows`): only
their bytes are read. Fused expert tensors (``mlp.experts.gate_up_proj`` [E, 2F, D],
``down_proj`` [E, D, F]) are read from the Hub's per-expert layout (``experts.{j}.gate_proj`` /
``up_proj`` / ``down_proj``, Mixtral's ``w1`` / ``w3`` / ``w2``) as transformers converts them, or as they
are when stored fused.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from paratrain.interop.hf import HFError, stored_tensors
from paratrain.models.hf import HFCausalLM, HFModelConfig, HFModelError, seeded_initializer

# transformers' fused expert tensors and the per-expert tensors the Hub stores them as, in order (gate before up).
_FUSED_EXPERTS = {"gate_up_proj": (("gate_proj", "up_proj"), ("w1", "w3")), "down_proj": (("down_proj",), ("w2",))}
_EXPERTS = re.compile(r"(.+\.experts)\.(gate_up_proj|down_proj)")


class HFWeightFiles:
    """A directory's safetensors (one file or an index of shards) read under the model's parameter names, one tensor
    at a time, each checked against the meta-built model's shape before anything is read."""

    def __init__(self, directory: str | Path, shapes: dict[str, tuple[int, ...]]):
        self.directory = Path(directory)
        try:
            self._stored = stored_tensors(self.directory)  # name -> (file, shape), from the headers
        except HFError as exc:
            raise HFModelError(str(exc)) from None
        self._headers: dict[str, tuple[int, dict]] = {}  # file -> (data start, header)
        self._sources = {name: self._source(name, tuple(shape)) for name, shape in shapes.items()}

    def _source(self, name: str, shape: tuple[int, ...]) -> tuple[list[str], int]:
        """The stored tensors of parameter `name` (several for a fused expert tensor stored per expert: each expert's
        row is the concatenation of `parts` of them, in order)."""
        if name in self._stored:
            self._check(name, self._stored[name][1], shape)
            return [name], 1
        match = _EXPERTS.fullmatch(name)
        if match:
            prefix, fused = match.groups()
            for parts in _FUSED_EXPERTS[fused]:
                keys = [f"{prefix}.{j}.{part}.weight" for j in range(shape[0]) for part in parts]
                if keys[0] in self._stored:
                    missing = [k for k in keys if k not in self._stored]
                    if missing:
                        raise HFModelError(f"{self.directory}: tensor {missing[0]!r} is missing")
                    rows = sum(self._stored[k][1][0] for k in keys[:len(parts)])
                    self._check(keys[0], (shape[0], rows, *self._stored[keys[0]][1][1:]), shape)
                    return keys, len(parts)
        raise HFModelError(f"{self.directory}: tensor {name!r} is missing (the config implies it, shape {list(shape)})")

    def _check(self, key: str, stored, expected) -> None:
        if tuple(stored) != tuple(expected):
            raise HFModelError(f"{self.directory}: tensor {key!r} has shape {list(stored)} but config.json implies "
                               f"{list(expected)}")

    def read(self, name: str, lo: int = 0, hi: int | None = None) -> torch.Tensor:
        """Parameter `name` in fp32, its rows [lo, hi) along dim 0 (None: to the end; a fused expert tensor stacked
        from the per-expert tensors of those experts): only their bytes are read."""
        keys, parts = self._sources[name]
        if len(keys) == 1:
            return self._read(keys[0], lo, hi).float()
        experts = range(len(keys) // parts)[lo:hi]
        rows = [torch.cat([self._read(k) for k in keys[j * parts:(j + 1) * parts]]) for j in experts]
        return torch.stack(rows).float()

    def _read(self, key: str, lo: int = 0, hi: int | None = None) -> torch.Tensor:
        """Rows [lo, hi) of one stored tensor, read with plain file reads into memory of its own (no memory map: the
        process then holds what it keeps, never the file's pages)."""
        file = self._stored[key][0]
        if file not in self._headers:
            self._headers[file] = _safetensors_header(self.directory / file)
        start, header = self._headers[file]
        entry = header[key]
        dtype = _SAFETENSORS_DTYPES.get(entry["dtype"])
        if dtype is None:
            raise HFModelError(f"{self.directory / file}: tensor {key!r} has dtype {entry['dtype']}, which paratrain "
                               "does not read")
        shape = list(entry["shape"]) or [1]  # a 0-d tensor: one row
        lo, hi, _ = slice(lo, hi).indices(shape[0])
        begin, end = entry["data_offsets"]
        row_bytes = (end - begin) // shape[0] if shape[0] else 0
        out = torch.empty([max(hi - lo, 0), *shape[1:]] if entry["shape"] else [], dtype=dtype, device="cpu")
        if out.numel():
            with open(self.directory / file, "rb") as f:
                f.seek(start + begin + lo * row_bytes)
                f.readinto(out.view(-1).view(torch.uint8).numpy())
        return out


_SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                       "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
                       "U8": torch.uint8, "BOOL": torch.bool}


def _safetensors_header(path: Path) -> tuple[int, dict]:
    """(where the data begins, the header: tensor name → dtype, shape, data_offsets) of a safetensors file."""
    with open(path, "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        return 8 + size, json.loads(f.read(size))


class DirectoryWeights:
    """init(name, full_shape) -> the directory's fp32 tensor; `rows(name, full_shape, lo, hi)` -> its rows [lo, hi)
    along dim 0 alone (what a ZeRO-3 shard keeps: `paratrain.parallel.data.zero3`)."""

    def __init__(self, files: HFWeightFiles):
        self.files = files

    def __call__(self, name: str, shape) -> torch.Tensor:
        return self.files.read(name)

    def rows(self, name: str, shape, lo: int, hi: int) -> torch.Tensor:
        return self.files.read(name, lo, hi)


def weight_initializer(model: HFCausalLM, init_from: str | None, seed: int = 0):
    """init(name, full_shape) -> fp32 value: the directory's weights (--init-from: `DirectoryWeights`, which also reads
    rows alone), else transformers' own seeded initialization (`paratrain.models.hf.seeded_initializer`)."""
    if not init_from:
        return seeded_initializer(model, seed)
    return DirectoryWeights(HFWeightFiles(init_from, {n: tuple(p.shape) for n, p in model.named_parameters()}))


def check_weights(config: HFModelConfig, init_from: str) -> None:
    """Every parameter's tensor is in `init_from` with the shape the config implies (headers only): one line if not."""
    model = HFCausalLM.build(config)
    HFWeightFiles(init_from, {n: tuple(p.shape) for n, p in model.named_parameters()})
