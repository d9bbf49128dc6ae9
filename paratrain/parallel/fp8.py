"""FP8 matmuls for the linears of a model's blocks, with dynamic scaling (`parallelize(..., fp8="tensorwise")`).

    parallelize(model, mesh, precision="bf16", fp8="tensorwise")   # or "rowwise"; `paratrain train --fp8 RECIPE`

Each converted linear computes its three matmuls with `torch._scaled_mm` on 8-bit operands:

    output          Y  = X · Wᵀ      forward
    input gradient  dX = dY · W      backward
    weight gradient dW = dYᵀ · X     backward

Every operand is cast just before its matmul, scaled so that its largest magnitude (amax, in fp32) lands
on the format's largest finite value, and saturated there (a value past it is clamped, never inf):

- ``tensorwise``: one scale per tensor; X and W in e4m3 (more mantissa), dY in e5m2 (more range, as
  gradients need); the forward matmul accumulates fast (`use_fast_accum`), the backward ones do not.
- ``rowwise``: e4m3 throughout, one scale per row of each operand along the matmul's reduction, a
  power of two (so a scale changes no mantissa bit); each matmul casts its operands along its own
  reduction axis, so the backward casts X and W again from the saved high-precision tensors.

The casts are pure functions of the tensors: a recomputed block (`activation_checkpointing`) casts exactly
as its forward did, and the function compiles without graph breaks. What converts: every `nn.Linear`
inside the model's blocks (`paratrain.parallel.blocks.unit_modules(model, "blocks")`: the reference
model's layers, a transformers model's decoder layers, the layers of an `nn.Sequential`) whose in and out
features are multiples of 16 (the FP8 kernels' tiles); embeddings and the output head, outside the
blocks, stay in the compute dtype. On CUDA a matmul too small to gain from FP8 (the casts cost more than
the faster matmul saves) stays too: `min_features`. A layer converts by its class (its parameters, their
names and checkpoints are those of the `nn.Linear` it was). A matmul whose token count is not a multiple
of 16 runs in the compute dtype (the kernels' tiles again).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from paratrain import compat
from paratrain.comm import Comm
from paratrain.errors import ParatrainError
from paratrain.mesh import Axis
from paratrain.parallel.blocks import unit_modules
from paratrain.parallel.data.units import GatherCodec
from paratrain.parallel.rules import FP8_CUDA_MIN_FEATURES

RECIPES = ("tensorwise", "rowwise")
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
_TILE = 16  # the FP8 kernels' dimensions are multiples of this
_EPS = 1e-12  # an all-zero tensor scales by fmax / eps: its cast is zeros, as it should be
CUDA_MIN_FEATURES = FP8_CUDA_MIN_FEATURES  # on CUDA smaller linears stay in the compute dtype (rules.py says why)


class Fp8Error(ParatrainError, ValueError):
    """FP8 asked for where it cannot run (a recipe, precision or device); the message names the fix."""


def check_fp8(recipe: str, device: torch.device) -> None:
    """Fp8Error (one line) for a recipe or device that FP8 training cannot use (the compute precision it needs is a
    layout rule: `paratrain.parallel.rules.fp8_violations`)."""
    if recipe not in RECIPES:
        raise Fp8Error(f"fp8={recipe!r} is not a recipe; use one of {', '.join(RECIPES)}")
    if not compat.has_scaled_mm():
        raise Fp8Error(f"this torch ({torch.__version__}) has no torch._scaled_mm; FP8 needs torch 2.4 or newer")
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        if (major, minor) < (8, 9):
            raise Fp8Error(f"fp8 needs a GPU of compute capability 8.9 or newer (Ada, Hopper); "
                           f"{torch.cuda.get_device_name(device)} is {major}.{minor}")
        if recipe == "rowwise" and major < 9:
            raise Fp8Error(f"fp8='rowwise' needs compute capability 9.0 or newer (Hopper); "
                           f"{torch.cuda.get_device_name(device)} is {major}.{minor}: use 'tensorwise'")


def scale_of(x: torch.Tensor, dtype: torch.dtype, dim: int | None = None, power_of_two: bool = False,
             agree=None) -> torch.Tensor:
    """The fp32 scale that maps `x`'s amax (over `dim`, kept; None: the whole tensor) onto `dtype`'s largest value.

    `agree(amax)`: makes the amax that of the whole tensor `x` is a shard of (a max-reduction over the tensor-
    parallel group), so that every shard casts with the scale one process would use.
    """
    amax = x.detach().abs().amax() if dim is None else x.detach().abs().amax(dim=dim, keepdim=True)
    if agree is not None:
        amax = agree(amax.float())
    scale = scale_from_amax(amax, dtype)
    return torch.exp2(torch.floor(torch.log2(scale))) if power_of_two else scale


def scale_from_amax(amax: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The fp32 scale(s) that map `amax` onto `dtype`'s largest value (an all-zero tensor: fmax / eps).

    Divided in float64 and rounded once to fp32, as torchao does: torch computes `number / fp32 tensor` as a
    reciprocal and a product, two roundings, which lands an ulp off the quotient for some amaxes (448 / 3.703125:
    120.978897 instead of 120.978905), and a compiled graph may divide otherwise than eager does."""
    return (torch.finfo(dtype).max / amax.double().clamp(min=_EPS)).float()


def to_fp8(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`x` · `scale` in `dtype`, saturated at its largest finite value."""
    limit = torch.finfo(dtype).max
    # one fp32 copy, scaled and saturated in place: 4 bytes per element at the cast's peak instead of 8 in eager
    # (a compiled graph fuses the three into one pass either way)
    return x.to(torch.float32, copy=True).mul_(scale).clamp_(-limit, limit).to(dtype)


def _column_major(x: torch.Tensor) -> torch.Tensor:
    """The same matrix stored column by column: the layout `_scaled_mm` wants for its second operand."""
    return x.t().contiguous().t()


def _mm(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor, out_dtype: torch.dtype,
        fast: bool = False) -> torch.Tensor:
    """a · b from FP8 operands (a row-major, b column-major) and their scales; the result in `out_dtype`."""
    return compat.scaled_mm(a.contiguous(), _column_major(b), scale_a.reciprocal(), scale_b.reciprocal(), out_dtype,
                            use_fast_accum=fast)


def _rowwise(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """a [m, k] · b [k, n], each cast to e4m3 along k: a per row, b per column, power-of-two scales."""
    sa, sb = scale_of(a, E4M3, 1, True), scale_of(b, E4M3, 0, True)
    return _mm(to_fp8(a, sa, E4M3), to_fp8(b, sb, E4M3), sa, sb, out_dtype)


class _Fp8Matmul(torch.autograd.Function):
    """x [M, K] · wᵀ (w [N, K]) with FP8 operands in forward and backward (the module docstring's recipes).

    The weight (or its cast) is kept for the backward only when the input needs a gradient, and the input
    only when the weight does: a model's first linear, whose input is data, keeps no weight (under ZeRO-3:
    its unit is not gathered again for the backward)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, recipe: str, agree, cast) -> torch.Tensor:
        ctx.recipe, ctx.dtype, ctx.agree = recipe, x.dtype, agree
        need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if recipe == "rowwise":
            ctx.save_for_backward(x if need_w else None, weight if need_x else None)
            return _rowwise(x, weight.t(), x.dtype)
        sx = scale_of(x, E4M3, agree=agree)
        wq, sw = cast if cast is not None else weight_cast(weight, agree)
        xq = to_fp8(x, sx, E4M3)
        # 1 byte per element kept for the backward, not 2
        ctx.save_for_backward(xq if need_w else None, wq if need_x else None, sx, sw)
        return _mm(xq, wq.t(), sx, sw, x.dtype, fast=True)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()
        need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if ctx.recipe == "rowwise":
            x, weight = ctx.saved_tensors
            grad_x = _rowwise(grad, weight, ctx.dtype) if need_x else None
            grad_w = _rowwise(grad.t(), x, ctx.dtype) if need_w else None
            return grad_x, grad_w, None, None, None
        xq, wq, sx, sw = ctx.saved_tensors
        sg = scale_of(grad, E5M2, agree=ctx.agree)
        gq = to_fp8(grad, sg, E5M2)
        grad_x = _mm(gq, wq, sg, sw, ctx.dtype) if need_x else None  # [M, N] · [N, K]
        grad_w = _mm(gq.t().contiguous(), xq, sg, sx, ctx.dtype) if need_w else None  # [N, M] · [M, K]
        return grad_x, grad_w, None, None, None


def weight_cast(weight: torch.Tensor, agree=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 weight, its scale): a tensorwise weight's cast."""
    with torch.no_grad():
        scale = scale_of(weight, E4M3, agree=agree)
        return to_fp8(weight, scale, E4M3), scale


class Fp8Casts:
    """The tensorwise casts of the converted weights, each made once per optimizer step and reused by every
    micro-batch of the step (and by a recompute), as long as the weight is the same tensor, unchanged.

    `parallelize` makes one for ZeRO-0..2 (whose weights stay whole between steps; ZeRO-3 gathers the casts
    themselves, `gathers_fp8`) and starts a new step after each optimizer step. Inside a compiled region the
    weight is cast in the graph instead.
    """

    def __init__(self):
        self._casts: dict = {}

    def new_step(self, *args) -> None:
        self._casts.clear()

    def weight(self, module: nn.Module, weight: torch.Tensor, agree=None):
        if torch.compiler.is_compiling():
            return None
        key = (id(module), weight.data_ptr(), weight._version)  # an in-place write (a load) bumps the version
        cast = self._casts.get(key)
        if cast is None:
            cast = self._casts[key] = weight_cast(weight, agree)
        return cast


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, recipe: str,
               agree=None, cast=None, cast_only: bool = False) -> torch.Tensor:
    """F.linear(x, weight, bias) with its matmuls in FP8 (`recipe`); in the compute dtype where the token count is
    not a multiple of 16. `agree`: the tensor-parallel amax agreement of `scale_of` (tensorwise only: a row's
    scale along a sharded reduction is the shard's own, whose partial product the reduction then sums).
    `cast`: the weight's tensorwise cast made already (`Fp8Casts`); `cast_only`: and `weight` is a stand-in of
    the weight's shape and dtype that only receives its gradient (ZeRO-3 gathered the cast, not the weight)."""
    flat = x.reshape(-1, x.shape[-1])
    if flat.shape[0] % _TILE:
        if not cast_only:
            return F.linear(x, weight, bias)
        # the weight exists only as its cast: the compute dtype's matmuls with its values, its gradient passed on
        y = _FromCast.apply(flat, weight, *cast).reshape(*x.shape[:-1], weight.shape[0])
        return y + bias if bias is not None else y
    y = _Fp8Matmul.apply(flat, weight, recipe, agree, cast).reshape(*x.shape[:-1], weight.shape[0])
    return y + bias if bias is not None else y


class _FromCast(torch.autograd.Function):
    """x [M, K] · wᵀ in x's dtype, w [N, K] the values of its tensorwise cast `wq` / `scale`; the weight's gradient
    goes to `stand_in` (its shape and dtype, no storage). The cast is kept for backward, not a dequantized copy:
    under ZeRO-3 it is a view of the unit's gathered buffer, which the saved-tensor hooks gather again."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, stand_in: torch.Tensor, wq: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        ctx.save_for_backward(x if need_w else None, wq if need_x else None, scale)
        return x @ _dequantized(wq, scale, x.dtype).t()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, wq, scale = ctx.saved_tensors
        grad_x = grad @ _dequantized(wq, scale, grad.dtype) if ctx.needs_input_grad[0] else None
        grad_w = grad.t() @ x if ctx.needs_input_grad[1] else None
        return grad_x, grad_w, None, None


def _dequantized(wq: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (wq.float() / scale).to(dtype)


class Float8Linear(nn.Linear):
    """An `nn.Linear` computing in FP8 (`fp8_recipe`); made from one by `convert_to_fp8`, same parameters."""

    fp8_recipe: str = "tensorwise"
    fp8_casts: Fp8Casts | None = None  # the step's weight casts, when the caller starts a new step after each update
    fp8_agree = None  # the amax agreement over the ranks that hold parts of one micro-batch's tokens (cp)
    # ZeRO-3 with tensorwise: (e4m3 weight, its scale) as the engine gathered them for this unit's forward and
    # its recompute (`gathers_fp8`); `weight` is then a stand-in that only receives the weight's gradient.
    fp8_gathered: tuple[torch.Tensor, torch.Tensor] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        agree, gathered = self.fp8_agree, self.fp8_gathered
        if gathered is not None:
            return fp8_linear(x, self.weight, self.bias, self.fp8_recipe, agree=agree, cast=gathered, cast_only=True)
        cast = self.fp8_casts.weight(self, self.weight) if self.fp8_casts and self.fp8_recipe == "tensorwise" else None
        return fp8_linear(x, self.weight, self.bias, self.fp8_recipe, agree=agree, cast=cast)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, fp8={self.fp8_recipe}"


def gathers_fp8(module: nn.Module, attr: str) -> bool:
    """Whether ZeRO-3 gathers parameter `attr` of `module` as its tensorwise e4m3 cast (1 byte per element instead
    of 2), with a scale agreed over the shards after each optimizer step: a plain converted linear's weight, which
    its forward reads only through that cast. (Rowwise casts along each matmul's own reduction, and a
    tensor-parallel linear agrees its scales over tp: both gather the compute dtype and cast after.)"""
    return type(module) is Float8Linear and module.fp8_recipe == "tensorwise" and attr == "weight"


class Fp8Gather(GatherCodec):
    """ZeRO-3's gather of a converted linear's weight as its tensorwise e4m3 cast (`gathers_fp8`): 1 byte per element
    on the wire, with the scale of the whole weight, agreed after each optimizer step from the shards (each rank's
    shard amax, then one max-reduction per axis); the linear computes from the gathered cast
    (`Float8Linear.fp8_gathered`), and its slot holds a stand-in of the weight's shape that receives the
    gradient."""

    align = 16  # bytes: the FP8 kernels want aligned operands

    def __init__(self):
        self._scales: dict[int, torch.Tensor] = {}  # per weight (engine index), its scale for this step
        self._stand_ins: dict[tuple, torch.Tensor] = {}

    def dtype(self, compute_dtype: torch.dtype) -> torch.dtype:
        return E4M3

    def reads(self, module: nn.Module, attr: str) -> bool:
        return gathers_fp8(module, attr)

    @torch.no_grad()
    def refresh(self, shards: list[torch.Tensor], indices: list[int], axes: list[Axis], comm: Comm,
                compute_dtype: torch.dtype) -> None:
        """Per weight at `indices`, the tensorwise e4m3 scale of the whole weight its shard over its axis is part of:
        each rank's shard amax, of its values in `compute_dtype` (which the cast reads), then one max-reduction
        per axis."""
        scales = {}
        for axis in dict.fromkeys(axes[i] for i in sorted(indices)):
            held_here = [i for i in sorted(indices) if axes[i] == axis]
            amax = torch.zeros(len(held_here), dtype=torch.float32, device=shards[held_here[0]].device)
            held = [k for k, i in enumerate(held_here) if shards[i].numel()]  # a rank past a short weight's rows: 0
            if held:  # one batch of kernels for every shard's max |x|
                amax[held] = torch.stack(torch._foreach_norm([shards[held_here[k]].detach() for k in held],
                                                             ord=float("inf")))
            amax = amax.to(comm.mesh.device).to(compute_dtype).float()  # (shards on the host: from there)
            comm.all_reduce(amax, axis, op=torch.distributed.ReduceOp.MAX)
            scales.update(zip(held_here, scale_from_amax(amax, E4M3).unbind()))
        self._scales = scales

    def encode(self, index: int, values: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """The compute dtype's values cast, as a whole weight in the compute dtype would be; returns its scale."""
        scale = self._scales[index]
        out.copy_(to_fp8(values, scale, E4M3))
        return scale

    def decode(self, gathered: torch.Tensor, compute_dtype: torch.dtype) -> torch.Tensor:
        """A stand-in of the weight's shape in the compute dtype (no memory): it receives the weight's gradient."""
        key = (compute_dtype, gathered.device)
        if key not in self._stand_ins:
            self._stand_ins[key] = torch.zeros((), dtype=compute_dtype, device=gathered.device)
        return self._stand_ins[key].expand(gathered.shape)

    def install(self, module: nn.Module, gathered: torch.Tensor, meta) -> None:
        module.fp8_gathered = (gathered, meta)

    def restore(self, module: nn.Module) -> None:
        module.fp8_gathered = None


def convertible(module: nn.Module, min_features: int) -> bool:
    """An `nn.Linear` (exactly: not a subclass with its own forward), or a tensor-parallel linear, whose whole
    layer's features suit the FP8 kernels: the same layers convert under every layout."""
    # a tensor-parallel linear says it can (`_ParallelLinear.fp8_recipe`); other subclasses have forwards of their own
    if type(module) is not nn.Linear and not hasattr(type(module), "fp8_recipe"):
        return False
    return (module.in_features % _TILE == 0 and module.out_features % _TILE == 0
            and min(module.in_features, module.out_features) >= min_features)


def _check_shard(name: str, module: nn.Module) -> None:
    """A converted layer's tensor-parallel shard must suit the kernels too, or its layout would compute otherwise
    than one process does."""
    rows, cols = module.weight.shape
    if rows % _TILE or cols % _TILE:
        raise Fp8Error(f"fp8 under tensor parallelism: {name}'s shard is {rows} x {cols}, not multiples of {_TILE} "
                       f"(the FP8 kernels' tiles) as the whole layer is; use a tp that keeps every shard a multiple "
                       f"of {_TILE}")


def convert_to_fp8(model: nn.Module, recipe: str, min_features: int = 0, casts: Fp8Casts | None = None,
                   agree=None) -> list[str]:
    """Make every convertible linear inside the blocks of `model` compute in FP8; the converted names.

    A plain linear becomes a `Float8Linear`; a tensor-parallel one computes its local matmul in FP8
    (`_ParallelLinear.fp8_recipe`), its tensorwise scales agreed over the tp group. `casts`: where their
    weights' casts are kept for the step (`Fp8Casts`; None: cast at every forward). `agree(amax)`: the
    max-reduction over the ranks that split each sequence (context parallelism), so that a tensorwise cast
    of a rank's tokens uses the scale of the whole micro-batch, as one process does.
    """
    converted = []
    for block_name, block in unit_modules(model, "blocks"):
        for name, module in block.named_modules():
            if convertible(module, min_features):
                if type(module) is nn.Linear:
                    module.__class__ = Float8Linear
                else:
                    _check_shard(f"{block_name}.{name}", module)
                module.fp8_recipe, module.fp8_casts, module.fp8_agree = recipe, casts, agree
                converted.append(f"{block_name}.{name}" if name else block_name)
    return converted
