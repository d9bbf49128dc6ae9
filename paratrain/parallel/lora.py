"""LoRA and QLoRA: low-rank adapters over a frozen base (`parallelize(..., lora=LoRA(16))`, `train --lora 16`).

    model, optimizer = parallelize(model, mesh, optimizer=..., lora=LoRA(rank=16, targets=("wq", "wv")))
    model, optimizer = parallelize(model, mesh, optimizer=..., precision="bf16", lora=LoRA(16, base_dtype="nf4"))

`convert_to_lora` turns each targeted `nn.Linear` into a `LoRALinear` in place, before any strategy applies
(`parallelize` calls it first), as PEFT's `LoraModel` does (Hu et al. 2021):

    y = x · Wᵀ + b  +  (alpha / rank) · B · A · dropout(x)       A: [rank, in], B: [out, rank]

- Every parameter of the model is frozen (`requires_grad=False`: no gradient, no master copy, no optimizer
  state, kept in the compute dtype) except the adapters `lora_A.weight` and `lora_B.weight` of each target, named
  as PEFT names them. `A` starts Kaiming-uniform (a = √5, PEFT's default: uniform in ±1/√in), `B` at zero, so
  the converted model computes what the base did. The dropout acts on the adapters' input only.
- Targets: module-name patterns (`fnmatch`, PEFT's suffix rule: a pattern matches a module whose qualified name
  matches it or ends with "." and a match of it, so "wq" is every block's `attn.wq`, "layers.0.*" the first
  block's linears); only `nn.Linear` modules are targets. None: every `nn.Linear` inside the model's blocks
  (`paratrain.parallel.blocks.unit_modules(model, "blocks")`; not the embeddings or the output head).
- base_dtype: None keeps the frozen base weights in the compute dtype; "bf16" stores them in bf16 (cast to the
  compute dtype for each matmul); "nf4" (QLoRA, Dettmers et al. 2023) stores each as NF4
  (`paratrain.parallel.nf4`: blocks of 64, double-quantized scales, torchao's format) and decodes it for its own
  matmul only, in forward and again in backward, so no decoded weight outlives its matmul. An NF4 weight is three
  frozen parameters: `weight_nf4` (its rows, `NF4.rows`: a block's codes and scale each), `weight_nf4_factors`
  and `weight_nf4_mean`, which every strategy holds as it holds other frozen parameters (ZeRO-3 shards the rows
  on whole blocks and gathers them in their 4-bit form). "fp8" stores each as float8 e4m3 bytes with one scale per
  output row (its absmax / 448, in the compute dtype): the frozen parameters `weight_fp8` (uint8, [out, in]) and
  `weight_fp8_scale` ([out, 1]), decoded for each matmul as NF4 is; one byte per element, twice NF4's, with
  e4m3's three mantissa bits for every element instead of NF4's sixteen levels per block.

A model built on the meta device gets its values from the initializer `parallelize` uses (`LoRAValues` is its view:
the adapters' values come from their own seeded generators, and an NF4 base's from its weight's initial value,
encoded on the device when its parameters are materialized, or sharded, one weight at a time).
Which strategies honour LoRA yet: `paratrain.parallel.rules.unsupported_with_lora`.
"""

from __future__ import annotations

import fnmatch
import math
import zlib
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from paratrain.errors import ParatrainError
from paratrain.parallel.blocks import unit_modules
from paratrain.parallel.nf4 import NF4, check_encodable
from paratrain.parallel.rules import LORA_BASE_DTYPES, NF4_BLOCK_SIZE, NF4_SCALER_BLOCK_SIZE

ADAPTERS = ("lora_A", "lora_B")


class LoRAError(ParatrainError, ValueError):
    """LoRA asked for what it cannot do (a rank, a pattern, a strategy); the message names the fix."""


@dataclass(frozen=True)
class LoRA:
    """Low-rank adapters on the targeted linears (see the module's docstring).

    rank: the adapters' inner dimension r (> 0). alpha: the scaling's numerator (None: 2 · rank), the adapters'
    output multiplied by alpha / rank. dropout: on the adapters' input, in training. targets: module-name
    patterns (None: every linear inside the blocks). base_dtype: None (the compute dtype), "bf16", "nf4" or "fp8".
    seed: the adapters' initialization.
    """

    rank: int
    alpha: float | None = None
    dropout: float = 0.0
    targets: tuple[str, ...] | None = None
    base_dtype: str | None = None
    seed: int = 0

    def __post_init__(self):
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank <= 0:
            raise LoRAError(f"the LoRA rank must be a positive integer, got {self.rank!r}")
        if self.alpha is None:
            object.__setattr__(self, "alpha", 2 * self.rank)
        if not self.alpha > 0:
            raise LoRAError(f"the LoRA alpha must be positive, got {self.alpha}")
        if not 0.0 <= self.dropout < 1.0:
            raise LoRAError(f"the LoRA dropout must be in [0, 1), got {self.dropout}")
        if isinstance(self.targets, str):
            object.__setattr__(self, "targets", tuple(t for t in self.targets.split(",") if t.strip()))
        if self.targets is not None:
            object.__setattr__(self, "targets", tuple(t.strip() for t in self.targets))
            if not self.targets:
                raise LoRAError("the LoRA targets are empty; name module patterns, or None for every block linear")
        if self.base_dtype not in (None, *LORA_BASE_DTYPES):
            raise LoRAError(f"base_dtype={self.base_dtype!r}: use None (the compute dtype), 'bf16', 'nf4' or "
                            f"'fp8'")

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank


def matches(name: str, pattern: str) -> bool:
    """Whether a module's qualified name matches a target pattern: whole, or as the end after a dot (PEFT's rule)."""
    return fnmatch.fnmatchcase(name, pattern) or fnmatch.fnmatchcase(name, "*." + pattern)


def target_names(model: nn.Module, targets: tuple[str, ...] | None) -> list[str]:
    """The qualified names of the linears `targets` picks (None: every linear inside the blocks), in model order;
    LoRAError for a pattern that picks nothing, or when nothing is picked at all."""
    linears = [name for name, m in model.named_modules() if isinstance(m, nn.Linear) and name]
    if targets is None:
        inside = [f"{block}.{name}" if name else block for block, module in unit_modules(model, "blocks")
                  for name, m in module.named_modules() if isinstance(m, nn.Linear)]
        if not inside:
            raise LoRAError(f"{type(model).__name__} has no linear inside a block (a ModuleList, ModuleDict or "
                            f"Sequential of layers); name the LoRA targets")
        return [name for name in linears if name in set(inside)]
    for pattern in targets:
        if not any(matches(name, pattern) for name in linears):
            some = ", ".join(linears[:6]) + (", ..." if len(linears) > 6 else "")
            raise LoRAError(f"the LoRA target {pattern!r} matches no linear of {type(model).__name__} "
                            f"(its linears: {some})")
    return [name for name in linears if any(matches(name, p) for p in targets)]


def adapter_init(name: str, shape, seed: int = 0) -> torch.Tensor:
    """An adapter's initial fp32 value: `lora_A` Kaiming-uniform (a = √5: uniform in ±1/√in, PEFT's default) from a
    generator seeded by `seed` and the name (the same on every rank and any layout), `lora_B` zeros."""
    if name.endswith("lora_B.weight"):
        return torch.zeros(shape)
    generator = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    weight = torch.empty(shape)
    nn.init.kaiming_uniform_(weight, a=math.sqrt(5), generator=generator)
    return weight


def is_adapter(name: str) -> bool:
    parts = name.split(".")
    return len(parts) >= 2 and parts[-2] in ADAPTERS


NF4_PARTS = ("weight_nf4", "weight_nf4_factors", "weight_nf4_mean")  # an NF4 base's parameters (`NF4.rows`)
FP8_PARTS = ("weight_fp8", "weight_fp8_scale")  # an FP8 base's parameters: e4m3 bytes, one scale per output row
FP8_MAX = 448.0  # the largest finite float8 e4m3fn


def encode_fp8(weight: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 bytes as uint8 [out, in], the scale of each output row [out, 1] in `dtype`) of a weight: each row divided
    by its scale (its absmax / 448, rounded to `dtype`; 1 for a row of zeros) and rounded to the nearest e4m3."""
    scale = (weight.detach().float().abs().amax(dim=1, keepdim=True) / FP8_MAX).to(dtype)
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = (weight.detach().float() / scale.float()).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return codes.view(torch.uint8), scale


def decode_fp8(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The weight `encode_fp8` encoded, in `dtype`: each e4m3 value times its row's scale (element by element, so a
    slice of rows or columns decodes to the slice of the whole)."""
    return codes.view(torch.float8_e4m3fn).to(dtype) * scale.to(dtype)


class LoRAValues:
    """What LoRA changes of the model's initial values, a view of `paratrain.parallel.materialize.Initializer`: the
    adapters' own seeded values, and the NF4 bases of `model`'s LoRA linears encoded (on `device`) from their
    weights' initial values; every other parameter's value is the one before LoRA (`init`)."""

    def __init__(self, seed: int = 0, model: nn.Module | None = None, device: torch.device | None = None):
        self.seed, self.device = seed, device
        self.bases = {name: m.nf4 for name, m in lora_modules(model)} if model is not None else {}
        self.fp8_bases = {name: m.fp8 for name, m in lora_modules(model)} if model is not None else {}
        # the last weight encoded (NF4, or FP8's bytes and scales): its parameters are asked for in a row
        self.encoded: dict[str, NF4 | tuple[torch.Tensor, torch.Tensor]] = {}

    def __call__(self, init: Callable, name: str, shape) -> torch.Tensor:
        module, _, part = name.rpartition(".")
        if is_adapter(name):
            return adapter_init(name, shape, self.seed)
        if part in NF4_PARTS and self.bases.get(module) is not None:
            return self._nf4_part(init, module, part, shape)
        if part in FP8_PARTS and self.fp8_bases.get(module) is not None:
            if module not in self.encoded:
                whole, dtype = self.fp8_bases[module][:2]
                self.encoded.clear()
                self.encoded[module] = encode_fp8(init(f"{module}.weight", whole).to(device=self.device), dtype)
            return self.encoded[module][FP8_PARTS.index(part)]
        return init(name, shape)

    def _nf4_part(self, init: Callable, module: str, part: str, shape) -> torch.Tensor:
        if module not in self.encoded:
            whole, dtype, block_size, scaler_block_size = self.bases[module][:4]
            weight = init(f"{module}.weight", whole).to(device=self.device, dtype=dtype)
            self.encoded.clear()
            self.encoded[module] = NF4.encode(weight, block_size, scaler_block_size)
        packed = self.encoded[module]
        value = {"weight_nf4": packed.rows(), "weight_nf4_factors": packed.factors, "weight_nf4_mean": packed.mean}[part]
        return value.reshape(shape)  # (a row-parallel split asks for the rows as [out, in / 64, 33])


class _NF4Matmul(torch.autograd.Function):
    """x · Wᵀ with W held in NF4 (its rows, factors and mean; `nf4`: the rest of `NF4`): decoded for the forward's
    matmul and again for the backward's; W takes no gradient, and nothing decoded is saved between them. The 4-bit
    form is saved as tensors (so ZeRO-3's saved-tensor hooks keep a gathered one as a reference, gathered again
    for the backward)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, rows: torch.Tensor, factors: torch.Tensor, mean: torch.Tensor, nf4: tuple):
        ctx.save_for_backward(rows, factors, mean)
        ctx.nf4 = nf4
        return F.linear(x, NF4.from_rows(rows, factors, mean, *nf4).decode(x.dtype))

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        weight = NF4.from_rows(*ctx.saved_tensors, *ctx.nf4).decode(grad.dtype)
        return grad @ weight, None, None, None, None


class _Fp8Matmul(torch.autograd.Function):
    """x · Wᵀ with W held as e4m3 bytes and row scales (`encode_fp8`): decoded for the forward's matmul and again for
    the backward's, as `_NF4Matmul` does; W takes no gradient, and nothing decoded is saved between them."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor):
        ctx.save_for_backward(codes, scale)
        return F.linear(x, decode_fp8(codes, scale, x.dtype))

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad @ decode_fp8(*ctx.saved_tensors, grad.dtype), None, None


class LoRAComputation:
    """What a linear with a frozen base and adapters computes, whatever holds its parameters: `LoRALinear` (the
    whole weight), and under tensor parallelism the twins of the column- and row-parallel layers
    (`paratrain.parallel.tensor.adapters`, each holding its slice of the base and of one adapter)."""

    lora_A: nn.Module
    lora_B: nn.Module
    lora_dropout: nn.Module
    scaling: float
    nf4: tuple | None = None  # an NF4 base's (shape, dtype, block size, scaler block size[, layout]); its tensors: NF4_PARTS
    fp8: tuple | None = None  # an FP8 base's (shape, dtype); its tensors: FP8_PARTS

    def base_matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x · Wᵀ (+ bias) with the frozen base, in x's dtype (an NF4 or FP8 base decoded for this matmul alone)."""
        if self.nf4 is not None or self.fp8 is not None:
            base = (_NF4Matmul.apply(x, self.weight_nf4, self.weight_nf4_factors, self.weight_nf4_mean, self.nf4)
                    if self.nf4 is not None else _Fp8Matmul.apply(x, self.weight_fp8, self.weight_fp8_scale))
            return base if bias is None else base + bias.to(base.dtype)
        return F.linear(x, self.weight.to(x.dtype), None if bias is None else bias.to(x.dtype))

    def adapter_input(self, x: torch.Tensor) -> torch.Tensor:
        """The adapters' input: x (in the adapters' dtype) after the dropout."""
        return self.lora_dropout(x.to(self.lora_A.weight.dtype))

    def lora_matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """The base's output plus scaling · B · A · dropout(x), in the base output's dtype."""
        base = self.base_matmul(x, bias)
        return base + (self.lora_B(self.lora_A(self.adapter_input(x))) * self.scaling).to(base.dtype)


class LoRALinear(LoRAComputation, nn.Linear):
    """An `nn.Linear` with a frozen base and trainable low-rank adapters (`convert_to_lora` makes it in place).

    The base weight is the parameter `weight` (frozen), or with an NF4 base the frozen parameters `NF4_PARTS`
    (a checkpoint holds the adapters alone, the base comes from its source)."""

    lora_A: nn.Linear
    lora_B: nn.Linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lora_matmul(x, self.bias)

    def _packed(self) -> NF4:
        """The NF4 base over this module's parameters as they are now."""
        return NF4.from_rows(self.weight_nf4, self.weight_nf4_factors, self.weight_nf4_mean, *self.nf4)

    def base_weight(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The frozen base weight as the forward uses it (an NF4 or FP8 base decoded), in `dtype` if given."""
        if self.nf4 is not None:
            weight = self._packed().decode()
        elif self.fp8 is not None:
            weight = decode_fp8(self.weight_fp8, self.weight_fp8_scale, self.fp8[1])
        else:
            weight = self.weight.detach()
        return weight if dtype is None else weight.to(dtype)

    def delta_weight(self) -> torch.Tensor:
        """scaling · B · A in fp32: what merging adds to the base weight (PEFT's `get_delta_weight`)."""
        return (self.lora_B.weight.detach().float() @ self.lora_A.weight.detach().float()) * self.scaling

    def extra_repr(self) -> str:
        rank = self.lora_A.out_features
        return f"{super().extra_repr()}, rank={rank}, scaling={self.scaling:g}, base={stored(self)}"


def stored(module: LoRAComputation) -> str:
    """How a LoRA linear holds its frozen base: "nf4", "fp8" or its weight's dtype."""
    return "nf4" if module.nf4 is not None else "fp8" if module.fp8 is not None else str(module.weight.dtype)[6:]


@torch.no_grad()
def convert_to_lora(model: nn.Module, lora: LoRA, compute_dtype: torch.dtype = torch.float32,
                    device: torch.device | None = None) -> list[str]:
    """Freeze `model` and give each target linear adapters (in place); the converted names, in model order.

    compute_dtype: the frozen parameters are stored in it (no master copy follows them); the adapters stay fp32
    (the data-parallel engine casts them with the other trainable parameters). device: where an NF4 base is
    encoded (one on the meta device stays there: `LoRAValues` encodes it where it is materialized).
    """
    names = target_names(model, lora.targets)
    base_dtype = torch.bfloat16 if lora.base_dtype == "bf16" else compute_dtype  # (NF4's and FP8's scales: compute)
    for param in model.parameters():
        param.requires_grad_(False)
        if param.is_floating_point() and param.dtype != compute_dtype:
            param.data = param.data.to(compute_dtype)
    for name in names:
        module = model.get_submodule(name)
        weight = module.weight
        on_meta = weight.is_meta
        module.__class__ = LoRALinear
        module.scaling = lora.scaling
        module.lora_dropout = nn.Dropout(lora.dropout) if lora.dropout > 0 else nn.Identity()
        for adapter, shape in (("lora_A", (lora.rank, module.in_features)), ("lora_B", (module.out_features, lora.rank))):
            linear = nn.Linear(shape[1], shape[0], bias=False, device="meta" if on_meta else weight.device)
            if not on_meta:
                linear.weight.copy_(adapter_init(f"{name}.{adapter}.weight", shape, lora.seed))
            setattr(module, adapter, linear)
        if lora.base_dtype == "nf4":
            _encode_base(module, base_dtype, device or weight.device)
        elif lora.base_dtype == "fp8":
            _encode_fp8_base(module, base_dtype, device or weight.device)
        elif weight.dtype != base_dtype:
            weight.data = weight.data.to(base_dtype)
    return names


def _encode_base(module: LoRALinear, dtype: torch.dtype, device) -> None:
    """Replace the module's base weight with its NF4 encoding (the frozen parameters `NF4_PARTS`, on `device`);
    on the meta device, with meta parameters of their shapes (`LoRAValues` gives their values)."""
    weight = module.weight
    check_encodable(weight.shape, dtype)
    if weight.is_meta:
        blocks = weight.numel() // NF4_BLOCK_SIZE
        parts = (torch.empty(blocks, NF4_BLOCK_SIZE // 2 + 1, dtype=torch.uint8, device="meta"),
                 torch.empty(-(-blocks // NF4_SCALER_BLOCK_SIZE), dtype=dtype, device="meta"),
                 torch.empty((), dtype=dtype, device="meta"))
        packed = None
    else:
        packed = NF4.encode(weight.detach().to(device=device, dtype=dtype))
        parts = (packed.rows(), packed.factors, packed.mean)
    del module.weight
    for name, tensor in zip(NF4_PARTS, parts):
        module.register_parameter(name, nn.Parameter(tensor, requires_grad=False))
    module.nf4 = (weight.shape, dtype, NF4_BLOCK_SIZE, NF4_SCALER_BLOCK_SIZE)


def _encode_fp8_base(module: LoRALinear, dtype: torch.dtype, device) -> None:
    """Replace the module's base weight with its e4m3 bytes and row scales (the frozen parameters `FP8_PARTS`, on
    `device`); on the meta device, with meta parameters of their shapes (`LoRAValues` gives their values)."""
    weight = module.weight
    if weight.is_meta:
        parts = (torch.empty(weight.shape, dtype=torch.uint8, device="meta"),
                 torch.empty(weight.shape[0], 1, dtype=dtype, device="meta"))
    else:
        parts = encode_fp8(weight.detach().to(device), dtype)
    del module.weight
    for name, tensor in zip(FP8_PARTS, parts):
        module.register_parameter(name, nn.Parameter(tensor, requires_grad=False))
    module.fp8 = (weight.shape, dtype)


def lora_modules(model: nn.Module) -> list[tuple[str, LoRALinear]]:
    """(qualified name, module) of each LoRA linear of `model`."""
    return [(name, m) for name, m in model.named_modules() if isinstance(m, LoRALinear)]


@torch.no_grad()
def base_fingerprint(model) -> str:
    """A SHA-256 of the frozen base of a `ParallelModel` (every frozen parameter, whole, by name, in the model's
    order: the same under every data-parallel layout), so that a checkpoint of adapters can refuse to be resumed over
    another base (collective under ZeRO-3, which gathers each frozen parameter in turn)."""
    import hashlib

    from paratrain.parallel.whole import frozen_parameters

    digest = hashlib.sha256()
    for name, tensor in frozen_parameters(model):
        digest.update(name.encode())
        digest.update(tensor.detach().reshape(-1).contiguous().cpu().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()
