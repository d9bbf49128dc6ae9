"""LoRA and QLoRA under tensor parallelism: the column- and row-parallel twins of a `LoRALinear`.

The plan's `Colwise` and `Rowwise` styles split a LoRA linear (`paratrain.parallel.lora`) with its adapters split
to match the base, so that the adapters add no collective to the forward:

- column-parallel base (W split by output rows): `lora_B` split by its output rows, `lora_A` whole on every rank.
  Rank r computes its output features y_r = x · W_rᵀ + s · B_r · A · x from the input the region entered.
- row-parallel base (W split by input columns): `lora_A` split by its input columns, `lora_B` whole. The adapter's
  output s · B · (A_r · x_r) is a partial sum like the base's and joins it before the all-reduce (under sequence
  parallelism the reduce-scatter) that sums the ranks': Σ_r (x_r W_rᵀ + s B A_r x_r) = x Wᵀ + s B A x.

The whole adapter of each (A of a column layer, B of a row layer) gets a partial gradient on each rank: A's output
gradient is s · Σ_r B_rᵀ dy_r, B's input is Σ_r A_r x_r. Its gradient is summed over tp after the backward with
the plan's other partial gradients (`TensorParallelInfo.sequence_partial`): one all-reduce of rank · in (or out)
elements per adapted linear and step, with or without sequence parallelism; the inputs' gradients sum over tp in
the collectives that already carry the base's.

The dropout on the adapters' input draws one process's mask: a column layer's input is the same on every tp rank
(and so is each rank's generator); a row layer draws the mask of the whole input's width and keeps its columns.

An NF4 base is quantized whole, exactly as one process quantizes it (blocks of 64 over the flattened [out, in]
weight, the block scales double-quantized over the whole weight), then its codes and scales (`NF4.rows`, one
row per block) are split along tp: a column layer keeps the blocks of its output rows ([blocks, 33] split on dim
0: whole blocks when out / tp · in is a multiple of 64); a row layer keeps, of every output row, the blocks of its
input columns (its rows laid out [out, in / 64, 33] and split on dim 1: whole blocks when in / tp is a multiple of
64). The factors of the double quantization and the mean stay whole on every rank (one factor per 16384
elements); each rank decodes its blocks with their own factors (`NF4.layout`), so its slice of the decoded weight
is bit for bit the slice of one process's.

An FP8 base (e4m3 bytes and one scale per output row, `paratrain.parallel.lora.encode_fp8`) is encoded whole too and
split as the weight it encodes: its bytes along the weight's tp dim, its row scales with the rows (a column layer's)
or whole (a row layer's, whose every rank holds every row); its decode is element by element, so each rank's slice
is bit for bit the slice of one process's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from paratrain.comm import Comm
from paratrain.mesh import Axis
from paratrain.parallel.lora import FP8_PARTS, NF4_PARTS, LoRAComputation, LoRALinear, stored
from paratrain.parallel.rules import NF4_BLOCK_SIZE
from paratrain.parallel.tensor.collectives import TensorParallelError
from paratrain.parallel.tensor.layers import ColumnParallelLinear, RowParallelLinear, TensorParallelLayer


class AdapterShard(TensorParallelLayer):
    """An adapter (`lora_A` or `lora_B`, bias-free) whose weight is split over tp along `dim`: this rank's slice."""

    def __init__(self, full: nn.Linear, dim: int, comm: Comm, axis: Axis):
        super().__init__()
        self._bind(comm, axis, False)
        self.shard_dims = {"weight": dim}
        self.in_features, self.out_features = full.in_features, full.out_features
        self.weight = nn.Parameter(self.local_slice("weight", full.weight.detach()).clone(),
                                   requires_grad=full.weight.requires_grad)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features} (dim {self.shard_dims['weight']} /{self.tp})"


class _LoRAParallel(LoRAComputation):
    """What both twins share: built from a `LoRALinear` (`from_full`), their base frozen, their matmul LoRA's."""

    split_adapter: str  # the adapter split with the base ("lora_B": column, "lora_A": row); the other stays whole
    adapter_dim: int  # the dim of its weight that is split
    nf4_dim: int  # the dim of the base's NF4 rows that is split (in `nf4_rows_shape`'s layout)

    @classmethod
    def from_full(cls, linear: LoRALinear, comm: Comm, axis: Axis = Axis.TP, **options):
        """This rank's twin of `linear`: its slice of the base and of the split adapter, the other adapter whole."""
        held = linear.nf4 or linear.fp8
        dtype = held[1] if held is not None else linear.weight.dtype
        layer = cls(linear.in_features, linear.out_features, linear.bias is not None, comm, axis,
                    device=linear.lora_A.weight.device, dtype=dtype, **options)
        layer.scaling, layer.lora_dropout = linear.scaling, linear.lora_dropout
        if linear.bias is not None:  # (frozen in the compute dtype, the base in its own)
            layer.bias = nn.Parameter(layer.bias.detach().to(linear.bias.dtype))
        for adapter in ("lora_A", "lora_B"):
            full = getattr(linear, adapter)
            setattr(layer, adapter, AdapterShard(full, layer.adapter_dim, comm, axis)
                    if adapter == layer.split_adapter else full)
        if linear.nf4 is not None:
            layer._hold_nf4(linear)
        elif linear.fp8 is not None:
            layer._hold_fp8(linear)
        layer._load_full(linear)
        return layer  # (its base frozen as the model's: `apply_tensor_parallel`)

    def _hold_nf4(self, linear: LoRALinear) -> None:
        """The base as this rank's NF4 rows (the whole weight's factors and mean), in place of `weight`."""
        del self.weight
        self.shard_dims = {("weight_nf4" if name == "weight" else name): (self.nf4_dim if name == "weight" else dim)
                           for name, dim in self.shard_dims.items()}
        whole = self.nf4_rows_shape(linear)
        local = list(whole)
        local[self.nf4_dim] //= self.tp
        parts = (torch.empty(local, dtype=torch.uint8, device=linear.weight_nf4.device),
                 torch.empty_like(linear.weight_nf4_factors), torch.empty_like(linear.weight_nf4_mean))
        for name, tensor in zip(NF4_PARTS, parts):
            self.register_parameter(name, nn.Parameter(tensor, requires_grad=False))
        shape, dtype, block_size, scaler_block_size = linear.nf4[:4]
        self.nf4 = (self.local_shape(shape), dtype, block_size, scaler_block_size, self.nf4_layout(shape, block_size))

    def _hold_fp8(self, linear: LoRALinear) -> None:
        """The base as this rank's e4m3 bytes (split as the weight) and row scales (split with the rows, if they are),
        in place of `weight`."""
        del self.weight
        dim = self.shard_dims.pop("weight")
        self.shard_dims["weight_fp8"] = dim
        if dim == 0:
            self.shard_dims["weight_fp8_scale"] = 0
        shape, dtype = linear.fp8[:2]
        local = self.local_shape(shape)
        codes = torch.empty(local, dtype=torch.uint8, device=linear.weight_fp8.device)
        scale = torch.empty(local[0], 1, dtype=dtype, device=linear.weight_fp8.device)
        for name, tensor in zip(FP8_PARTS, (codes, scale)):
            self.register_parameter(name, nn.Parameter(tensor, requires_grad=False))
        self.fp8 = (local, dtype)

    @torch.no_grad()
    def _load_full(self, module: nn.Module) -> None:
        for name, param in self.named_parameters(recurse=False):
            full = getattr(module, name)
            if name == "weight_nf4":
                full = full.reshape(self.nf4_rows_shape(module))
            param.copy_(self.local_slice(name, full))

    def nf4_rows_shape(self, linear: LoRALinear) -> tuple[int, ...]:
        """The shape of the whole weight's NF4 rows that `nf4_dim` splits: as stored, [blocks, 33]."""
        return tuple(linear.weight_nf4.reshape(-1, linear.weight_nf4.shape[-1]).shape)

    def nf4_layout(self, shape, block_size: int) -> tuple[int, int, int]:
        """This rank's blocks in the whole weight's (`NF4.layout`): one run of a 1/tp share, after the ranks'
        before."""
        blocks = shape[0] * shape[1] // block_size // self.tp
        return self.tp_rank * blocks, blocks, 0

    def _matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return self.lora_matmul(x, bias)

    def sequence_partial_params(self) -> list[str]:
        whole = "lora_A" if self.split_adapter == "lora_B" else "lora_B"
        return [*super().sequence_partial_params(), f"{whole}.weight"]

    def extra_repr(self) -> str:
        rank = self.lora_A.out_features
        return f"{super().extra_repr()}, rank={rank}, scaling={self.scaling:g}, base={stored(self)}"


class LoRAColumnParallelLinear(_LoRAParallel, ColumnParallelLinear):
    """A `ColumnParallelLinear` with LoRA: B split by output rows, A whole (see the module's docstring)."""

    split_adapter, adapter_dim, nf4_dim = "lora_B", 0, 0

    def local_shape(self, shape) -> torch.Size:
        return torch.Size((shape[0] // self.tp, shape[1]))


class LoRARowParallelLinear(_LoRAParallel, RowParallelLinear):
    """A `RowParallelLinear` with LoRA: A split by input columns, B whole (see the module's docstring)."""

    split_adapter, adapter_dim, nf4_dim = "lora_A", 1, 1

    def local_shape(self, shape) -> torch.Size:
        return torch.Size((shape[0], shape[1] // self.tp))

    def nf4_rows_shape(self, linear: LoRALinear) -> tuple[int, ...]:
        if self.tp == 1:  # (one rank: the rows as they are, of any width)
            return super().nf4_rows_shape(linear)
        shape, block_size = linear.nf4[0], linear.nf4[2]
        return shape[0], shape[1] // block_size, linear.weight_nf4.shape[-1]

    def nf4_layout(self, shape, block_size: int) -> tuple[int, int, int]:
        if self.tp == 1:
            return super().nf4_layout(shape, block_size)
        per_row = shape[1] // block_size  # blocks of a whole output row; this rank keeps a run of them in each
        run = per_row // self.tp
        return self.tp_rank * run, run, per_row

    def adapter_input(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's columns of one process's dropout of the whole input (the mask drawn at the whole width)."""
        x = x.to(self.lora_A.weight.dtype)
        if not (isinstance(self.lora_dropout, nn.Dropout) and self.training):
            return self.lora_dropout(x)
        mask = self.lora_dropout(x.new_ones(*x.shape[:-1], self.in_features))
        return x * mask.chunk(self.tp, -1)[self.tp_rank]


def twin(layer: type, module: nn.Module) -> type:
    """The class a style makes of `module`: the LoRA twin of `layer` for a LoRA linear, else `layer` itself."""
    if not isinstance(module, LoRALinear):
        return layer
    return {ColumnParallelLinear: LoRAColumnParallelLinear, RowParallelLinear: LoRARowParallelLinear}[layer]


def check_split(name: str, module: nn.Module, tp: int, row_parallel: bool) -> None:
    """TensorParallelError (one line) for a LoRA linear whose NF4 base tp cannot split on whole blocks of 64."""
    if isinstance(module, LoRALinear) and module.nf4 is not None:
        check_nf4_split(name, module.nf4[0], tp, row_parallel)


def check_nf4_split(name: str, shape, tp: int, row_parallel: bool) -> None:
    """TensorParallelError (one line) unless an NF4 weight of `shape` [out, in] splits over tp on whole blocks of
    64: by input columns (`row_parallel`) in / tp a multiple of 64, by output rows out / tp · in one."""
    out_features, in_features = shape
    if row_parallel and tp > 1 and (in_features // tp) % NF4_BLOCK_SIZE:
        raise TensorParallelError(f"{name}: its NF4 base splits by input columns over tp={tp} only on whole blocks "
                                  f"of {NF4_BLOCK_SIZE}, and in_features / tp = {in_features // tp} is not a "
                                  f"multiple of {NF4_BLOCK_SIZE}; choose a tp that leaves whole blocks, or leave "
                                  f"{name} out of --lora-targets")
    if not row_parallel and (out_features // tp * in_features) % NF4_BLOCK_SIZE:
        raise TensorParallelError(f"{name}: its NF4 base splits by output rows over tp={tp} only on whole blocks of "
                                  f"{NF4_BLOCK_SIZE}, and its {out_features // tp} rows of {in_features} per rank "
                                  f"are not; choose another tp, or leave {name} out of --lora-targets")
