"""One command for one GPU: paratrain's step time, MFU and memory against plain PyTorch and FSDP2, and the planner's.

    python benchmarks/bench_gpu.py                        # H100 / H200: the 1B model, then llama2-7b where it fits
    python benchmarks/bench_gpu.py --budget-s 300         # stop starting rows after 300 s (the rest noted as skipped)
    python benchmarks/bench_gpu.py --device cpu --size tiny --steps 2 --warmup 1 --no-compile   # the dry run
    python benchmarks/bench_gpu.py --repredict gpu-bench-X.json --profile P.json   # a past run against today's planner

Rows, most important first (a row that is not started within --budget-s is written as skipped):
  1. the 1B model of gpu_check.py (SIZES["1b"], batch 4 x seq 2048, bf16): plain PyTorch compiled (every
     block torch.compile'd) and paratrain ZeRO-0 compiled; plain PyTorch eager, paratrain ZeRO-0 eager,
     FSDP2 (fully_shard per block + root, MixedPrecisionPolicy bf16 params / fp32 reduce), paratrain ZeRO-3;
     paratrain ZeRO-0 compiled with FP8 linears (tensorwise, rowwise); paratrain ZeRO-0 and ZeRO-3 eager
     with Muon (`MuonRecipe`: its step's Newton-Schulz against AdamW's in the rows of the same layout); then paratrain ZeRO-0 and ZeRO-3 x
     eager/compiled x selective/full recomputation.
  1b. a Qwen3-shaped transformers model of ~1B parameters (`paratrain.models.hf`, transformers' own modules),
     every decoder layer compiled: plain PyTorch on the same module against paratrain ZeRO-0 (target <= 1.0x).
  2. llama2-7b (bf16, seq 2048, micro-batch 1): a few paratrain ZeRO-3 rows with recomputation (one with FP8
     tensorwise linears), each only
     where torch.cuda.mem_get_info shows room for the planner's estimate (fp32 masters + Adam: ~16 bytes per
     parameter, 112 GB, so an H200's 141 GB, not an H100's 80).
  3. llama3.1-8b (bf16, seq 8192, --llama3): bf16 and FP8 (tensorwise, rowwise), compiled, in the layout the planner
     picks for 141 GB at world 1 (ZeRO stage, recomputation, optimizer offload where nothing fits without,
     micro-batch), each after plain PyTorch's compiled step (FP8 through torchao), which runs where it fits (fp32
     weights and AdamW: 128 GB before activations, so not on one H200). paratrain's loss is the fused one (the
     default), plain PyTorch's keeps the whole logits. Then a QLoRA step (rank 16 on every block linear, the base
     in NF4), eager: paratrain ZeRO-3 at world 1 in the planner's layout beside plain PyTorch over torchao's
     NF4Tensor (`to_nf4`, `linear_nf4`) with two adapters per linear, as torchtune's QLoRA builds it; the small
     model's two QLoRA rows too (ZeRO-3 eager).
paratrain rows that ask for what this build's parallelize() does not take (compile=True, a recomputation
mode by name) are written as "not available in this build"; recomputation "full" falls back to
activation_checkpointing=1 (every block), which is full recomputation.

Per row: step time min / median / max over --steps timed steps after --warmup (synchronized around each),
tokens/s, MFU (ModelConfig.flops_per_token, PaLM's 6N + attention, under LoRA the planner's LoRA FLOPs, over
paratrain.hardware's dense bf16 peak), peak torch.cuda.max_memory_allocated (reset after warm-up, so it covers model state and the timed
steps; absolute, so it includes what earlier rows left: "allocated before"), the bytes the row left allocated
once its model and optimizer are dropped (gc.collect, torch.cuda.empty_cache: 0 unless something holds on), and the planner's prediction (paratrain.plan
estimate on the preset matching the device: step time and peak memory) with measured / predicted. Plain
PyTorch rows are predicted as the planner's ZeRO-0 layout, FSDP2 as its ZeRO-3.

Writes benchmarks/results/gpu-bench-<date>.md and .json with the device, driver, torch and CUDA versions.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import gc
import inspect
import json
import math
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

import paratrain
from gpu_check import SIZES, adamw, batches, measure, model_on_meta, plain_step
from paratrain import DataParallel
from paratrain.hardware import device_peak_flops
from paratrain.models import ModelConfig, get_model_config
from paratrain.parallel.rules import DEFAULT_LOSS_CHUNK

NOT_AVAILABLE = "not available in this build"
MARGIN = 1.10  # a row of the large model starts only where free memory exceeds the planner's peak by 10%
LARGE_ROW_MIN_S = 120  # building llama2-7b and a few steps: a row is not started with less budget left


@dataclasses.dataclass(frozen=True)
class Row:
    model: str  # "small" (--size) or "large" (--large)
    kind: str  # "pytorch", "fsdp2" or "paratrain"
    compile: bool
    zero: int | None = None  # paratrain's ZeRO stage
    recompute: str = "none"  # "none", "selective" or "full"
    fp8: str | None = None  # paratrain's FP8 recipe for the blocks' linears (plain PyTorch: torchao's)
    offload: str | None = None  # paratrain's optimizer offload
    micro_batch: int | None = None  # sequences per step where the row sets it (the planner's pick), else the model's
    optimizer: str = "adamw"  # paratrain's: "muon" is the trainer's recipe (Muon for the blocks' matrices)
    lora: int | None = None  # the adapters' rank on every block linear, the rest frozen (LoRA)
    base_dtype: str | None = None  # with lora: how the adapted linears' frozen weights are stored ("nf4": QLoRA)

    @property
    def name(self) -> str:
        what = {"pytorch": "plain PyTorch", "fsdp2": "FSDP2"}.get(self.kind, f"paratrain ZeRO-{self.zero}")
        return f"{what} {'compiled' if self.compile else 'eager'}" + \
            (f" +{self.recompute} recompute" if self.recompute != "none" else "") + \
            (f" +offload {self.offload}" if self.offload else "") + \
            (f" +fp8 {self.fp8}" if self.fp8 else "") + (f" x{self.micro_batch}" if self.micro_batch else "") + \
            (f" +{self.optimizer}" if self.optimizer != "adamw" else "") + \
            (f" +{'Q' if self.base_dtype == 'nf4' else ''}LoRA r{self.lora}" if self.lora else "")


H200_BYTES = 141e9


def llama3_rows(cfg: ModelConfig, seq: int) -> list[Row]:
    """Llama 3.1 8B on one GPU: for bf16 and each FP8 recipe, compiled, the layout the planner picks for 141 GB (ZeRO
    stage, recomputation, offload, micro-batch: `paratrain.plan.search` at world 1 on the H200 preset), each after
    plain PyTorch's compiled step (autocast bf16; FP8 through torchao's Float8Linear), which runs where it fits."""
    from paratrain.plan import HARDWARE_PRESETS, Workload
    from paratrain.plan.search import SearchSpace, search

    hardware = dataclasses.replace(HARDWARE_PRESETS["h200"], memory_bytes=H200_BYTES)
    out = []
    for fp8 in (None, "tensorwise", "rowwise"):
        workload = Workload.for_model(cfg, seq_len=seq, precision="bf16", reduce_dtype="fp32", fp8=fp8,
                                      loss_chunk=DEFAULT_LOSS_CHUNK)
        best = None
        for offload in (None, "optimizer"):  # offload only where nothing fits on the device alone
            best = best or search(workload, 1, hardware, SearchSpace(compile=True, micro_batch=(1, 2),
                                                                     offload=offload)).best
        out.append(Row("llama3", "pytorch", True, fp8=fp8, micro_batch=best.layout.micro_batch if best else 1))
        if best is None:
            out.append(Row("llama3", "paratrain", True, 3, "full", fp8=fp8, micro_batch=1))  # the planner says no fit
            continue
        lay = best.layout
        out.append(Row("llama3", "paratrain", True, lay.zero, lay.recompute.value, fp8=fp8, offload=lay.offload,
                       micro_batch=lay.micro_batch))
    return out + qlora_rows("llama3", cfg, seq, hardware)


QLORA_RANK = 16


def qlora_rows(model: str, cfg: ModelConfig, seq: int, hardware) -> list[Row]:
    """A QLoRA step, eager, of `cfg` on one GPU: plain PyTorch over torchao's NF4 (the micro-batch the planner picks),
    then paratrain ZeRO-3 at world 1 in the planner's layout (recomputation, micro-batch; full recomputation at
    micro-batch 1 where it finds none)."""
    from paratrain.plan import Workload
    from paratrain.plan.search import SearchSpace, search

    workload = Workload.for_model(cfg, seq_len=seq, precision="bf16", reduce_dtype="fp32", lora=QLORA_RANK,
                                  base_dtype="nf4", loss_chunk=DEFAULT_LOSS_CHUNK)
    best = search(workload, 1, hardware, SearchSpace(zero=(3,), micro_batch=(1, 2))).best
    lay = best.layout if best else None
    qlora = {"lora": QLORA_RANK, "base_dtype": "nf4", "micro_batch": lay.micro_batch if lay else 1}
    return [Row(model, "pytorch", False, **qlora),
            Row(model, "paratrain", False, 3, lay.recompute.value if lay else "full", **qlora)]


def rows(large: bool, llama3: tuple[ModelConfig, int] | None = None) -> list[Row]:
    out = [Row("small", "pytorch", True), Row("small", "paratrain", True, 0),
           Row("small", "pytorch", False), Row("small", "paratrain", False, 0),
           Row("small", "fsdp2", False), Row("small", "paratrain", False, 3), Row("small", "paratrain", True, 3),
           Row("small", "paratrain", True, 0, fp8="tensorwise"), Row("small", "paratrain", True, 0, fp8="rowwise"),
           Row("small", "paratrain", True, 3, fp8="tensorwise"),  # ZeRO-3 gathers the FP8 casts
           # Muon's step against AdamW's (the rows above of the same layout): Newton-Schulz on every block matrix
           Row("small", "paratrain", False, 0, optimizer="muon"), Row("small", "paratrain", False, 3, optimizer="muon"),
           # QLoRA: the frozen base in NF4 gathered in its 4-bit form, the adapters the only masters
           Row("small", "pytorch", False, lora=QLORA_RANK, base_dtype="nf4"),
           Row("small", "paratrain", False, 3, lora=QLORA_RANK, base_dtype="nf4")]
    out += [Row("small", "paratrain", c, z, r) for z in (0, 3) for c in (False, True) for r in ("selective", "full")]
    if large:
        out += [Row("large", "paratrain", True, 3, "selective"),
                *(Row("large", "paratrain", True, 3, "selective", fp8=recipe) for recipe in ("tensorwise", "rowwise")),
                Row("large", "paratrain", False, 3, "full")]
    if llama3 is not None:
        out += llama3_rows(*llama3)
    return out


# -- what this build's parallelize() takes ---------------------------------------------------------------------

def parallelize_kwargs(row: Row) -> tuple[dict | None, str | None]:
    """The keyword arguments for `row`'s compile and recomputation, or (None, why this build cannot)."""
    params = inspect.signature(paratrain.parallelize).parameters
    kwargs = {}
    if row.fp8:
        if "fp8" not in params:
            return None, f"{NOT_AVAILABLE}: parallelize() has no fp8 argument"
        kwargs["fp8"] = row.fp8
    if row.offload:
        kwargs["offload"] = row.offload  # a DataParallel option, not parallelize()'s (build_paratrain)
    if row.lora:
        if "lora" not in params:
            return None, f"{NOT_AVAILABLE}: parallelize() has no lora argument"
        kwargs["lora"] = paratrain.LoRA(row.lora, base_dtype=row.base_dtype)
    if row.compile:
        if "compile" not in params:
            return None, f"{NOT_AVAILABLE}: parallelize() has no compile argument"
        kwargs["compile"] = True
    if row.recompute != "none":
        # An annotation naming str means recomputation modes by name; else only every k-th block (1: full).
        by_name = "str" in str(params["activation_checkpointing"].annotation)
        if by_name:
            kwargs["activation_checkpointing"] = row.recompute
        elif row.recompute == "full":
            kwargs["activation_checkpointing"] = 1
        else:
            return None, f"{NOT_AVAILABLE}: activation_checkpointing takes only every k-th block, not {row.recompute!r}"
    return kwargs, None


# -- the planner's prediction ----------------------------------------------------------------------------------

def hardware_preset(device_name: str) -> str | None:
    for pattern, preset in (("H200", "h200"), ("H100", "h100-80gb"), ("A100-SXM4-40GB", "a100-40gb"),
                            ("A100", "a100-80gb")):
        if pattern in device_name:
            return preset
    return None


def predict(cfg: ModelConfig, row: Row, batch: int, seq: int, preset: str | None, profile=None,
            loss_chunk: int = 0) -> dict:
    """The planner's step time (on `profile`, a calibrated Hardware, else the device's preset; None without
    either) and peak memory for `row`, whose loss ran fused in chunks of `loss_chunk` tokens (0: whole logits)."""
    from paratrain.plan import HARDWARE_PRESETS, Layout, Workload, estimate

    zero = row.zero if row.kind == "paratrain" else (3 if row.kind == "fsdp2" else 0)
    workload = Workload.for_model(cfg, seq_len=seq, global_batch=batch, precision="bf16", reduce_dtype="fp32",
                                  loss_chunk=loss_chunk, fp8=row.fp8,  # parallelize's defaults, and FSDP2's policy
                                  optimizer=row.optimizer, lora=row.lora, base_dtype=row.base_dtype)
    layout_args = {"zero": zero, "micro_batch": batch, "recompute": row.recompute, "offload": row.offload}
    notes = []
    if "compile" in {f.name for f in dataclasses.fields(Layout)}:
        layout_args["compile"] = row.compile
    elif row.compile:
        notes.append("the planner has no compile flag: predicted as eager")
    if row.kind != "paratrain":
        notes.append(f"predicted as paratrain's ZeRO-{zero} layout")
    # Memory does not depend on the hardware: any preset gives it; the time needs the device's own.
    hardware = profile or HARDWARE_PRESETS[preset or "h100-80gb"]
    est = estimate(workload, Layout(**layout_args), hardware)
    return {"step_s": est.time.total if preset or profile else None, "peak_bytes": est.memory.total,
            "hardware": hardware.name if profile else preset, "notes": notes}


# -- building each row -----------------------------------------------------------------------------------------

def compile_blocks(model) -> None:
    for block in model.layers.values():
        block.compile()


class PlainQLoRALinear(torch.nn.Module):
    """A linear's frozen weight as torchao's NF4Tensor (bf16, blocks of 64, double-quantized scales) computed by
    `linear_nf4`, and two trainable fp32 adapters beside it (B at zero, scaling 2): torchtune's QLoRA linear."""

    def __init__(self, linear: torch.nn.Linear, rank: int, to_nf4, linear_nf4):
        super().__init__()
        weight = linear.weight.detach().to(torch.bfloat16)
        blocks = weight.numel() // 64  # scales double-quantized by 256 (fewer where a small weight has fewer blocks)
        self.weight = torch.nn.Parameter(to_nf4(weight, 64, math.gcd(blocks, 256)), requires_grad=False)
        self.linear_nf4 = linear_nf4
        self.lora_a = torch.nn.Linear(linear.in_features, rank, bias=False, device=weight.device)
        self.lora_b = torch.nn.Linear(rank, linear.out_features, bias=False, device=weight.device)
        torch.nn.init.zeros_(self.lora_b.weight)

    def forward(self, x):
        return self.linear_nf4(x, self.weight) + self.lora_b(self.lora_a(x)) * 2.0


def plain_qlora(model, rank: int) -> list[torch.nn.Parameter]:
    """The model frozen in bf16, each block linear a `PlainQLoRALinear` (in place); the adapters."""
    try:
        from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import linear_nf4, to_nf4
    except ImportError:
        from torchao.dtypes.nf4tensor import linear_nf4, to_nf4  # (torchao before 0.14)
    model.requires_grad_(False).to(torch.bfloat16)
    for block in model.layers.values():
        for name, module in list(block.named_modules()):
            if isinstance(module, torch.nn.Linear):
                parent, _, child = name.rpartition(".")
                setattr(block.get_submodule(parent) if parent else block, child,
                        PlainQLoRALinear(module, rank, to_nf4, linear_nf4))
    return [p for p in model.parameters() if p.requires_grad]


def build_plain(cfg: ModelConfig, row: Row, x, y, device):
    """Plain PyTorch (gpu_check's step: fp32 weights, autocast bf16, fused AdamW on CUDA) or FSDP2 (bf16 params);
    with `row.lora`, QLoRA over torchao's NF4 (`plain_qlora`), AdamW over the adapters alone."""
    model = model_on_meta(cfg).to_empty(device=device)
    model._tie_weights()
    model.init_weights(0)
    if row.lora:
        adapters = plain_qlora(model, row.lora)
        return plain_step(model, adamw(adapters, fused=device.type == "cuda"), x, y, device)
    if row.kind == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mesh = init_device_mesh(device.type, (1,))
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for block in model.layers.values():
            fully_shard(block, mesh=mesh, mp_policy=policy)
        fully_shard(model, mesh=mesh, mp_policy=policy)
    if row.fp8:  # torchao's Float8Linear on the blocks' linears, as paratrain converts them
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        convert_to_float8_training(model.layers, config=Float8LinearConfig.from_recipe_name(row.fp8))
    if row.compile:
        compile_blocks(model)
    optimizer = adamw(model.parameters(), fused=device.type == "cuda")
    return plain_step(model, optimizer, x, y, device, autocast=row.kind == "pytorch")  # FSDP2 casts itself


def build_paratrain(cfg: ModelConfig, row: Row, kwargs: dict, x, y):
    from paratrain.train import train_step

    kwargs = dict(kwargs)
    factory = functools.partial(adamw, fused=x.is_cuda)
    if row.optimizer == "muon":
        from paratrain.parallel.muon import MuonRecipe

        factory = MuonRecipe(adamw={"fused": x.is_cuda})
    model, optimizer = paratrain.parallelize(
        model_on_meta(cfg), paratrain.init_mesh(), optimizer=factory,
        precision="bf16", data=DataParallel(zero=row.zero, grad_reduction="sum", offload=kwargs.pop("offload", None)),
        init=functools.partial(model_on_meta(cfg).param_init, seed=0), **kwargs)
    return lambda: train_step(model, optimizer, [(x, y)], 1.0)


# -- measuring -------------------------------------------------------------------------------------------------

def free(device) -> int | None:
    """Drop what the finished row left (compiled code included); the bytes still allocated after that."""
    torch._dynamo.reset()
    gc.collect()
    if device.type != "cuda":
        return None
    torch.cuda.empty_cache()
    return torch.cuda.memory_allocated(device)


def run_row(row: Row, cfg: ModelConfig, batch: int, seq: int, device, args, preset: str | None,
            profile=None) -> dict:
    # paratrain's loss is the fused one (parallelize's default); plain PyTorch's and FSDP2's keep the whole logits
    out = {"row": row.name, **dataclasses.asdict(row), "params": cfg.num_params(), "batch": batch, "seq": seq,
           "loss_chunk": DEFAULT_LOSS_CHUNK if row.kind == "paratrain" else 0}
    out["predicted"] = predict(cfg, row, batch, seq, preset, profile, out["loss_chunk"])
    kwargs = {}
    if row.kind == "paratrain":
        kwargs, why = parallelize_kwargs(row)
        if why:
            return {**out, "status": why}
    if row.model in ("large", "llama3"):
        if device.type != "cuda":
            return {**out, "status": "skipped: the large model needs a CUDA device"}
        free_bytes, _ = torch.cuda.mem_get_info(device)
        need = out["predicted"]["peak_bytes"] * MARGIN
        if free_bytes < need:
            return {**out, "status": f"skipped: needs ~{need / 1e9:.0f} GB (planner's peak + 10%), "
                                     f"{free_bytes / 1e9:.0f} GB free"}
    out["allocated_before"] = torch.cuda.memory_allocated(device) if device.type == "cuda" else None
    x, y = batches(cfg, 1, batch, seq, device)[0]
    start = time.perf_counter()
    try:
        step = build_plain(cfg, row, x, y, device) if row.kind != "paratrain" else build_paratrain(cfg, row, kwargs, x, y)
        out.update(measure(step, device, args.warmup, args.steps))
        out["status"] = "ok"
    except Exception as e:  # noqa: BLE001 - a row that fails (out of memory included) is a result
        out["status"] = f"error: {type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
    finally:
        step = None  # the closure holds the model and its optimizer
    out["row_s"] = time.perf_counter() - start
    out["allocated_after_free"] = free(device)
    if out["allocated_before"] is not None:  # what this row left behind (earlier rows' leftovers excluded)
        out["left_by_row"] = out["allocated_after_free"] - out["allocated_before"]
    if out["status"] == "ok":
        median = out["step_s"]["median"]
        out["tokens_per_s"] = batch * seq / median
        peak = device_peak_flops(device) or args.peak_flops
        out["mfu"] = flops_per_token(cfg, row, seq) * batch * seq / median / peak if peak else None
        p = out["predicted"]
        p["time_ratio"] = median / p["step_s"] if p["step_s"] else None
        p["memory_ratio"] = out["max_memory_allocated"] / p["peak_bytes"] if out["max_memory_allocated"] else None
    return out


def flops_per_token(cfg: ModelConfig, row: Row, seq: int) -> float:
    """The training FLOPs of a token: PaLM's 6N + attention, or under LoRA the planner's (no weight gradient for
    the frozen matmuls, the adapters' added: `paratrain.plan.lora.flops_per_token`)."""
    if not row.lora:
        return cfg.flops_per_token(seq)
    from paratrain.plan import Workload
    from paratrain.plan.lora import flops_per_token as lora_flops

    return lora_flops(Workload.for_model(cfg, seq_len=seq, lora=row.lora, base_dtype=row.base_dtype))


# -- the command -----------------------------------------------------------------------------------------------

def driver_version() -> str | None:
    if shutil.which("nvidia-smi"):
        try:
            return subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                  capture_output=True, text=True, timeout=20).stdout.strip().splitlines()[0]
        except (OSError, subprocess.SubprocessError, IndexError):
            pass
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="where to run (default cuda)")
    parser.add_argument("--size", default="1b", choices=list(SIZES), help="the small model (default 1b)")
    parser.add_argument("--large", default="llama2-7b",
                        help="the large model, a paratrain.models name (default llama2-7b); '' for none")
    parser.add_argument("--llama3", default="llama3.1-8b",
                        help="the model of the Llama 3 rows, a paratrain.models name (default llama3.1-8b); '' for none")
    parser.add_argument("--llama3-seq", type=int, default=8192,
                        help="tokens per sequence of the Llama 3 rows (default 8192)")
    parser.add_argument("--batch", type=int, default=4, help="sequences per step of the small model (default 4)")
    parser.add_argument("--large-batch", type=int, default=1, help="micro-batch of the large model (default 1)")
    parser.add_argument("--seq", type=int, default=2048, help="tokens per sequence, at most the model's (default 2048)")
    parser.add_argument("--steps", type=int, default=8, help="timed steps per row (default 8)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps before them, compilation included "
                                                              "(default 3)")
    parser.add_argument("--budget-s", type=float, default=420,
                        help="no row starts after this many seconds; the rest are written as skipped (default 420)")
    parser.add_argument("--no-compile", action="store_true", help="skip the compiled rows (a quick CPU dry run)")
    parser.add_argument("--peak-flops", type=float, default=None,
                        help="peak FLOP/s for MFU where paratrain.hardware does not know the device (e.g. a CPU)")
    parser.add_argument("--profile", metavar="JSON", default=None,
                        help="predict with this hardware profile (paratrain plan --calibrate's) instead of the "
                             "device's preset")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"), help="results directory")
    parser.add_argument("--repredict", metavar="JSON", default=None,
                        help="run nothing: print a past run's measured rows (its .json) against today's planner "
                             "on --profile or the device's preset (any machine, no GPU needed)")
    args = parser.parse_args(argv)
    profile = None
    if args.profile:
        from paratrain.plan.hardware import load_profile
        from paratrain.plan.memory import PlanError

        try:
            profile = load_profile(args.profile)
        except PlanError as e:
            print(f"bench_gpu: error: {e}", file=sys.stderr)
            return 2
    if args.repredict:
        return repredict(Path(args.repredict), profile, args.profile)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench_gpu: error: no CUDA device here (use --device cpu --size tiny for the dry run)", file=sys.stderr)
        return 2
    begin = time.perf_counter()
    device = torch.device(args.device, 0) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = True
    paratrain.init_mesh()  # the process group of one that FSDP2's device mesh and paratrain share
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu ({os.cpu_count()} cores)"
    results = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "machine": platform.node(),
               "device": name, "driver": driver_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
               "peak_flops": device_peak_flops(device) or args.peak_flops, "budget_s": args.budget_s,
               "steps": args.steps, "warmup": args.warmup, "profile": args.profile, "rows": []}
    print(f"bench_gpu on {name} (driver {results['driver']}, torch {results['torch']}, CUDA {results['cuda']})",
          flush=True)
    models = {"small": (SIZES[args.size], args.batch)}
    if args.large:
        models["large"] = (get_model_config(args.large), args.large_batch)
    llama3 = None
    if args.llama3:
        models["llama3"] = (get_model_config(args.llama3), 1)
        llama3 = (models["llama3"][0], args.llama3_seq)
    preset = hardware_preset(name)
    for row in rows(bool(args.large), llama3):
        cfg, batch = models[row.model]
        batch = row.micro_batch or batch
        seq = min(args.llama3_seq if row.model == "llama3" else args.seq, cfg.max_seq_len)
        elapsed = time.perf_counter() - begin
        left = args.budget_s - elapsed
        if row.compile and args.no_compile:
            result = {"row": row.name, **dataclasses.asdict(row), "status": "skipped: --no-compile"}
        elif left <= 0 or (row.model != "small" and device.type == "cuda" and left < LARGE_ROW_MIN_S):
            result = {"row": row.name, **dataclasses.asdict(row),
                      "status": f"skipped: budget spent ({elapsed:.0f} s of --budget-s {args.budget_s:g})"}
        else:
            result = run_row(row, cfg, batch, seq, device, args, preset, profile)
        result["model_name"] = {"small": args.size, "large": args.large, "llama3": args.llama3}[row.model]
        results["rows"].append(result)
        print(f"  {result['model_name']:>10} {row.name:<44} {summary(result)}", flush=True)
    for result in transformers_rows(device, args, args.budget_s - (time.perf_counter() - begin)):
        result["model_name"] = "qwen3-hf"
        results["rows"].append(result)
        print(f"  {result['model_name']:>10} {result['row']:<44} {summary(result)}", flush=True)
    results["total_s"] = time.perf_counter() - begin
    write(results, Path(args.out))
    return 1 if any(r["status"].startswith("error") for r in results["rows"]) else 0


def _qwen3_row(kind: str) -> dict:
    """The name and the fields every row records of the Qwen3 row of `kind` (the planner does not predict it)."""
    name = f"transformers Qwen3 {'plain PyTorch' if kind == 'pytorch' else 'paratrain ZeRO-0'} compiled"
    return {"row": name, "model": "qwen3", "kind": kind, "compile": True, "zero": 0 if kind == "paratrain" else None,
            "recompute": "none"}


def transformers_rows(device, args, left_s: float) -> list[dict]:
    """A Qwen3-shaped transformers model (`paratrain.models.hf`: transformers' own modules, QK norms, head_dim 128) of
    ~1B parameters, batch --batch x seq --seq, bf16, every decoder layer compiled: plain PyTorch (the same module,
    autocast bf16, fused AdamW, clipping) against paratrain ZeRO-0 on it. Target: paratrain's median step ≤ 1.0x
    plain PyTorch's (the ratio is in the second row's detail)."""
    if left_s <= 0 or args.no_compile:  # neither row runs: nothing is built, transformers not imported
        return [{**_qwen3_row(kind), "status": "skipped: " + ("--no-compile" if args.no_compile else "budget spent")}
                for kind in ("pytorch", "paratrain")]
    import tempfile

    import transformers

    from paratrain.interop.hf_weights import weight_initializer
    from paratrain.models.hf import HFCausalLM, read_model_dir
    from paratrain.parallel.materialize import to_empty
    from paratrain.train import train_step

    small = device.type != "cuda"
    config = transformers.Qwen3Config(
        vocab_size=512 if small else 32000, hidden_size=128 if small else 2048,
        intermediate_size=256 if small else 6144, num_hidden_layers=2 if small else 16,
        num_attention_heads=4 if small else 16, num_key_value_heads=2 if small else 8, head_dim=32 if small else 128,
        max_position_embeddings=args.seq, tie_word_embeddings=False)
    directory = tempfile.mkdtemp(prefix="bench-gpu-qwen3-")
    with torch.device("meta"):
        meta = transformers.Qwen3ForCausalLM(config)
    meta.config.save_pretrained(directory)  # config only: both sides start from the seeded init
    seq = min(args.seq, config.max_position_embeddings)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, config.vocab_size, (args.batch, seq + 1), generator=g).to(device)
    x, y = tokens[:, :-1], tokens[:, 1:]
    out = []
    for kind in ("pytorch", "paratrain"):
        if left_s <= 0:
            out.append({**_qwen3_row(kind), "status": "skipped: budget spent"})
            continue
        start = time.perf_counter()
        model_cfg = read_model_dir(directory)
        model = HFCausalLM.build(model_cfg)
        init = weight_initializer(model, None, seed=0)
        row = {**_qwen3_row(kind), "params": model_cfg.params, "batch": args.batch, "seq": seq,
               "allocated_before": torch.cuda.memory_allocated(device) if device.type == "cuda" else None,
               "predicted": {"step_s": None, "time_ratio": None, "peak_bytes": None, "memory_ratio": None}}
        try:
            if kind == "pytorch":
                to_empty(model, device)
                with torch.no_grad():
                    for pname, param in model.named_parameters():
                        param.copy_(init(pname, param.shape))
                for layer in model.model.layers:
                    layer.compile()
                step = plain_step(model, adamw(model.parameters(), fused=device.type == "cuda"), x, y, device)
            else:
                pmodel, optimizer = paratrain.parallelize(
                    model, paratrain.init_mesh(), optimizer=functools.partial(adamw, fused=device.type == "cuda"),
                    precision="bf16", data=DataParallel(grad_reduction="sum"), compile=True, init=init)
                step = lambda: train_step(pmodel, optimizer, [(x, y)], 1.0)  # noqa: E731
            row.update(measure(step, device, args.warmup, args.steps))
            row["status"] = "ok"
            median = row["step_s"]["median"]
            row["tokens_per_s"] = args.batch * seq / median
            peak = device_peak_flops(device) or args.peak_flops
            row["mfu"] = model_cfg.flops_per_token(seq) * args.batch * seq / median / peak if peak else None
        except Exception as e:  # noqa: BLE001 - a row that fails is a result
            row["status"] = f"error: {type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
        step = model = pmodel = optimizer = None
        row["row_s"] = time.perf_counter() - start
        row["allocated_after_free"] = free(device)
        if row["allocated_before"] is not None:
            row["left_by_row"] = row["allocated_after_free"] - row["allocated_before"]
        left_s -= row["row_s"]
        out.append(row)
    if len(out) == 2 and all(r["status"] == "ok" for r in out):
        ratio = out[1]["step_s"]["median"] / out[0]["step_s"]["median"]
        out[1]["vs_plain"] = ratio
        out[1]["predicted"]["notes"] = [f"paratrain / plain PyTorch median step: {ratio:.3f} (target <= 1.0)"]
    return out


HOST_FIELDS = ("host_op_s", "host_full_op_s", "host_selective_op_s", "host_unit_s")


def repredict(path: Path, profile, profile_path: str | None = None) -> int:
    """A past run's measured rows against the planner as it is now (after a change to the planner). A profile
    calibrated before the calibration measured the host's costs takes them from the device's preset (said)."""
    from paratrain.plan import HARDWARE_PRESETS

    past = json.loads(path.read_text())
    preset = hardware_preset(past["device"])
    missing = [name for name in HOST_FIELDS if profile_path and name not in json.loads(Path(profile_path).read_text())]
    if profile is not None and missing and preset:
        profile = dataclasses.replace(profile, **{name: getattr(HARDWARE_PRESETS[preset], name) for name in missing})
        print(f"{Path(profile_path).name} predates the host's costs: {', '.join(missing)} of the {preset} preset "
              f"(an estimate, paratrain/plan/hardware.py)")
    print(f"{path.name} ({past['device']}) against the planner on {profile.name if profile else preset}\n")
    print("| model | row | step s min / median | predicted | median / predicted |\n| --- | --- | --- | --- | --- |")
    for r in past["rows"]:
        if r["status"] != "ok" or r.get("model") == "qwen3":  # a transformers model: no named config to predict
            continue
        row = Row(r["model"], r["kind"], r["compile"], r["zero"], r["recompute"], r.get("fp8"), r.get("offload"),
                  r.get("micro_batch"))
        cfg = SIZES[r["model_name"]] if r["model"] == "small" else get_model_config(r["model_name"])
        predicted = predict(cfg, row, r["batch"], r["seq"], preset, profile, r.get("loss_chunk", 0))["step_s"]
        s = r["step_s"]
        print(f"| {r['model_name']} | {row.name} | {s['min']:.3f} / {s['median']:.3f} | {predicted:.3f} | "
              f"{s['median'] / predicted:.2f} |")
    return 0


def summary(r: dict) -> str:
    if r["status"] != "ok":
        return r["status"]
    s, p = r["step_s"], r["predicted"]
    gib = (lambda b: "-" if b is None else f"{b / 2**30:.2f} GiB" if b >= 2**30 else f"{b / 2**20:.1f} MiB")
    mfu = "-" if r["mfu"] is None else f"{r['mfu']:.1%}"
    ratio = (lambda v: "-" if v is None else f"{v:.2f}")
    return (f"{s['min']:.3f} / {s['median']:.3f} / {s['max']:.3f} | {r['tokens_per_s']:,.0f} | {mfu} | "
            f"{gib(r['max_memory_allocated'])} | {gib(r.get('allocated_before'))} | {gib(r.get('left_by_row'))} | "
            f"{'-' if p['step_s'] is None else format(p['step_s'], '.3f')} ({ratio(p['time_ratio'])}) | "
            f"{gib(p['peak_bytes'])} ({ratio(p['memory_ratio'])})")


def write(results: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"gpu-bench-{time.strftime('%Y%m%d-%H%M%S')}"
    stem.with_suffix(".json").write_text(json.dumps(results, indent=2) + "\n")
    lines = [f"# bench_gpu {results['date']} on {results['device']}, driver {results['driver']}, "
             f"torch {results['torch']}, CUDA {results['cuda']}", "",
             f"{results['warmup']} warm-up + {results['steps']} timed steps per row; budget {results['budget_s']:g} s, "
             f"used {results['total_s']:.0f} s. Predicted = paratrain.plan's estimate on "
             f"{'the calibrated profile ' + results['profile'] if results.get('profile') else 'the preset'} "
             "(measured / predicted in brackets).", "",
             "| model | row | step s min / median / max | tokens/s | MFU | peak allocated | allocated before | "
             "left after free | predicted step s | predicted peak |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    notes = []
    for r in results["rows"]:
        cells = summary(r).split(" | ")
        cells += [""] * (8 - len(cells))
        lines.append(f"| {r['model_name']} | {r['row']} | " + " | ".join(cells) + " |")
        for note in r.get("predicted", {}).get("notes", []):
            notes.append(f"- {r['model_name']} {r['row']}: {note}")
    lines += ["", *dict.fromkeys(notes)]
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"written: {stem}.json, {stem}.md")


if __name__ == "__main__":
    sys.exit(main())
