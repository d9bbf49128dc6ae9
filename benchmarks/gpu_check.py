"""One command to run first on any CUDA machine: is every path built without a GPU right on this one?

    python benchmarks/gpu_check.py                    # one GPU is enough; 2+ GPUs add the NCCL layouts
    python benchmarks/gpu_check.py --device cpu --size tiny --steps 2    # the same rows, small, on the CPU

One PASS/FAIL row per check (SKIP where the machine lacks what a row needs, e.g. a second GPU); the exit
status is 1 if any row failed. About 3 minutes on one H100/H200.

- ring kernels fp32 / bf16: the ring's block kernels (parallel/context/kernels.py: CUDA memory-efficient in
  fp32, flash in bf16) over one causal attention split into 4 query/key blocks, merged by lse, backward
  from the merged out and lse, against whole causal SDPA (out, dq, dk, dv; norm-relative);
  cp2: ring attention over 2 ranks (NCCL) against one process (2+ GPUs).
- experts grouped GEMM: GroupedExperts through torch._grouped_mm against its per-expert loop, forward and
  backward, bf16; tiny-moe: `paratrain train --model tiny-moe` learns (loss falls by a third).
- compile ZeRO-0 / ZeRO-3: parallelize(compile=True) against eager, bf16, no graph break.
- selective recomputation against none, bf16.
- plan --calibrate --quick: writes a profile (kept beside the results for bench_gpu.py --profile), the host's costs
  of an eager step among its rates (the row says them: the planner's H200 host is an estimate until then).
- elastic launcher: `paratrain train` run through torch's elastic agent and the worker server (a worker
  forked from the server initializes CUDA itself).
- memory snapshot: `--memory-snapshot` writes a snapshot after step 1 and one when a step runs out of memory.
- offload optimizer: AdamW's state on the host (pinned), stepped in the host thread, against the device's step
  (ZeRO-0 and ZeRO-3): losses within 1e-3; offload optimizer, Muon: Muon's momentum on the host, the Newton–Schulz
  iteration on the device, against Muon on the device (ZeRO-1): losses within 1e-3, the update's staging pinned.
- world 1, bf16: DDP, ZeRO-1/2/3 and tensor parallelism (the reference plan at tp 1) against one plain
  PyTorch process (autocast bf16, fp32 weights, AdamW): largest relative loss difference.
- world 1 LoRA ZeRO-0 / QLoRA ZeRO-3: `parallelize(lora=LoRA(8))` with a bf16 base under DDP, and with an NF4 base
  under ZeRO-3 (its 4-bit rows gathered and decoded on the GPU), bf16, against one plain PyTorch process over the
  model `convert_to_lora` made (autocast bf16, AdamW over the adapters): largest relative loss difference.
- checkpoint: saved mid-run and loaded into a fresh model, the next steps bit-equal, with AdamW and fused
  AdamW (whose step count must be loaded onto the GPU).
- fused loss fp32 / bf16: the loss with the head fused in (chunks of 1,024 tokens, logits recomputed in backward)
  against the whole logits' loss at Llama 3.1 8B's head (4,096 x 128,256, 4,096 tokens): loss, dX, dW, and the
  peak bytes each adds.
- fp8 llama3.1-8b shapes: each FP8 recipe's matmul, forward and backward, at the 8B block's linear shapes and 8,192
  tokens against bf16's (error and time).
- memory given back: a bf16 model and its optimizer (DDP, ZeRO-1/2/3) built, trained and dropped
  (gc.collect()): under 1% of its bytes left (torch.cuda.memory_allocated; on the CPU, live tensor bytes).
- the 1B step: paratrain (DDP at world 1, bf16) against plain PyTorch eager (autocast, fused AdamW) on the
  same GPU: paratrain's median step within 10% of plain PyTorch's (tokens/s, MFU, peak memory reported).
- transformers Qwen3 compiled, world 1: a Qwen3-shaped transformers model (`paratrain.models.hf`) compiled per
  decoder layer, bf16, under ZeRO-0..3, its tp plan at tp 1, selective/full recomputation and FP8, against
  transformers' model stepped plainly (autocast bf16): loss within 2%, no graph break.
- with 2+ GPUs: dp2 (ZeRO 0-3), tp2, tp2 with sequence parallelism and pp2 with every schedule over NCCL.

Writes benchmarks/results/gpu-check-<date>.json and .md with the device, torch and CUDA versions.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import functools
import gc
import io
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import paratrain
from paratrain import DataParallel, PipelineParallel, TensorParallel
from paratrain.hardware import device_peak_flops
from paratrain.models import ModelConfig, Transformer
from paratrain.models.tp_plans import LLAMA_TP_PLAN
from paratrain.peak_memory import TensorMemory

SIZES = {
    "tiny": ModelConfig(vocab_size=256, dim=64, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=128, max_seq_len=64),
    "1b": ModelConfig(vocab_size=32000, dim=2048, n_layers=16, n_heads=16, n_kv_heads=8, ffn_dim=5632,
                      max_seq_len=2048),
}
CHECK = ModelConfig(vocab_size=512, dim=128, n_layers=4, n_heads=8, n_kv_heads=4, ffn_dim=256, max_seq_len=128)
# The CPU dry run's: the same rows and code paths on half CHECK's width and depth and a quarter of its batch (bf16
# matmuls take slow kernels on a CPU); a GPU runs CHECK.
CHECK_CPU = ModelConfig(vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, max_seq_len=64)
CHECK_BATCH = {"cuda": (8, 64), "cpu": (4, 32)}  # sequences x tokens per step of the equivalence rows
LAYOUTS_1 = {"ddp": {}, "zero1": {"zero": 1}, "zero2": {"zero": 2}, "zero3": {"zero": 3}, "tp1_plan": {"tp": 1}}
LAYOUTS_2 = {**{f"dp2_zero{z}": {"dp": 2, "zero": z} for z in range(4)}, "tp2": {"tp": 2},
             "tp2_sp": {"tp": 2, "sp": True},
             **{f"pp2_{s}": {"pp": 2, "schedule": s} for s in ("gpipe", "1f1b", "interleaved", "zb-h1")}}
TOL = 2e-2  # bf16 keeps 8 bits of mantissa: a few steps stay within 2% of the autocast reference
LORA_RANK = 8  # the LoRA rows' adapters
LORA_ROWS = {"LoRA zero0": (None, 0), "QLoRA zero3": ("nf4", 3)}  # name: (base dtype, ZeRO stage)
LEFT_TOL = 1e-2  # of a dropped model's bytes, what may stay allocated (nothing of it should)


def batches(cfg: ModelConfig, steps: int, batch: int, seq: int, device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(steps):
        tokens = torch.randint(0, cfg.vocab_size, (batch, seq + 1), generator=g)
        out.append((tokens[:, :-1].to(device), tokens[:, 1:].to(device)))
    return out


def check_model(device) -> ModelConfig:
    """The equivalence rows' model on `device`: CHECK on a GPU, CHECK_CPU on the CPU."""
    return CHECK if device.type == "cuda" else CHECK_CPU


def check_batches(device, steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`steps` batches of the equivalence rows' model and batch on `device`."""
    return batches(check_model(device), steps, *CHECK_BATCH[device.type], device)


def model_on_meta(cfg: ModelConfig) -> Transformer:
    with torch.device("meta"):
        return Transformer(cfg)


def adamw(params, fused: bool = False):
    return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1, fused=fused)


# -- 1 and 5: equivalence ---------------------------------------------------------------------------------------

def reference_losses(cfg: ModelConfig, data, device) -> list[float]:
    """One plain PyTorch process: fp32 weights, autocast bf16, AdamW, global-norm clipping."""
    model = model_on_meta(cfg).to_empty(device=device)
    model.init_weights(0)
    return _plain_steps(model, list(model.parameters()), data, device)


def _plain_steps(model, trained: list, data, device) -> list[float]:
    """The plain PyTorch steps: autocast bf16, AdamW over `trained`, global-norm clipping; the losses."""
    optimizer = adamw(trained)
    losses = []
    for x, y in data:
        with torch.autocast(device.type, dtype=torch.bfloat16):
            logits = model(x)
        loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trained, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def paratrain_losses(cfg: ModelConfig, data, layout: dict) -> list[float]:
    """The same steps through parallelize() on this process's share of the mesh (the trainer's step)."""
    from paratrain.train import train_step

    mesh = paratrain.init_mesh(dp=layout.get("dp"), tp=layout.get("tp", 1), pp=layout.get("pp", 1))
    schedule = layout.get("schedule", "1f1b")
    lora = paratrain.LoRA(LORA_RANK, base_dtype=layout["base_dtype"]) if "base_dtype" in layout else None
    model, optimizer = paratrain.parallelize(
        model_on_meta(cfg), mesh, optimizer=paratrain.MuonRecipe() if layout.get("optimizer") == "muon" else adamw,
        precision="bf16",
        data=DataParallel(zero=layout.get("zero", 0), grad_reduction="sum", offload=layout.get("offload")),
        # At tp = 1 the reference plan is applied anyway (degenerate layers): its code runs on the GPU too.
        tensor=TensorParallel(plan=LLAMA_TP_PLAN if layout.get("tp") == 1 else None,
                              sequence_parallel=layout.get("sp", False)),
        pipeline=PipelineParallel(schedule=schedule, virtual_stages=2 if schedule == "interleaved" else 1),
        compile=layout.get("compile", False), activation_checkpointing=layout.get("recompute", 0),
        init=functools.partial(model_on_meta(cfg).param_init, seed=0), fp8=layout.get("fp8"), fp8_min_features=0,
        lora=lora)
    dp, rank = mesh.size("dp"), mesh.coord("dp")
    losses = []
    for x, y in data:
        rows = x.shape[0] // dp
        x, y = x[rank * rows:(rank + 1) * rows], y[rank * rows:(rank + 1) * rows]
        micro = max(1, rows // (2 * mesh.size("pp"))) if mesh.size("pp") > 1 else rows
        pieces = [(x[i:i + micro], y[i:i + micro]) for i in range(0, rows, micro)]
        losses.append(train_step(model, optimizer, pieces, 1.0).loss)
    return losses


def lora_reference_losses(cfg: ModelConfig, data, device, base_dtype: str | None) -> list[float]:
    """One plain PyTorch process over the model `convert_to_lora` made, its frozen base in bf16 (or NF4) as a bf16
    run stores it: autocast bf16, AdamW over the adapters, global-norm clipping."""
    from paratrain.parallel.lora import convert_to_lora

    model = model_on_meta(cfg).to_empty(device=device)
    model.init_weights(0)
    convert_to_lora(model, paratrain.LoRA(LORA_RANK, base_dtype=base_dtype), torch.bfloat16)
    return _plain_steps(model, [p for p in model.parameters() if p.requires_grad], data, device)


def _lora_rows(device, steps: int) -> list:
    cfg, data = check_model(device), check_batches(device, steps)

    def row(base_dtype, zero):
        losses = paratrain_losses(cfg, data, {"zero": zero, "base_dtype": base_dtype})
        diff = relative_difference(losses, lora_reference_losses(cfg, data, device, base_dtype))
        return {"passed": diff <= TOL, "losses": losses, "rel_diff": diff,
                "detail": f"loss rel diff {diff:.1e} vs one plain PyTorch process (tol {TOL:g})"}

    return [(f"world 1 {name}", functools.partial(row, *case)) for name, case in LORA_ROWS.items()]


def relative_difference(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


def check_world1(device, steps: int) -> dict:
    cfg, data = check_model(device), check_batches(device, steps)
    reference = reference_losses(cfg, data, device)
    out = {}
    for name, layout in LAYOUTS_1.items():
        losses = paratrain_losses(cfg, data, layout)
        out[name] = {"losses": losses, "rel_diff": relative_difference(losses, reference)}
    return {"reference": reference, "layouts": out}


def _world2_worker(job: dict) -> None:
    """Each of 2 processes (the elastic agent's): one layout over NCCL; rank 0 writes its losses."""
    from paratrain.distributed import shutdown

    device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    losses = paratrain_losses(check_model(device), check_batches(device, job["steps"]), job["layout"])
    if int(os.environ["RANK"]) == 0:
        Path(job["out"]).write_text(json.dumps(losses))
    shutdown()


def check_world2(device, steps: int) -> dict:
    from paratrain.launch import launch_processes

    reference = reference_losses(check_model(device), check_batches(device, steps), device)
    out = {}
    with tempfile.TemporaryDirectory() as work:
        for name, layout in LAYOUTS_2.items():
            path = Path(work) / f"{name}.json"
            try:
                launch_processes(_world2_worker, {"layout": layout, "steps": steps, "out": str(path)}, 2)
                losses = json.loads(path.read_text())
                out[name] = {"losses": losses, "rel_diff": relative_difference(losses, reference)}
            except Exception as e:  # noqa: BLE001 - a failed layout is a result, not the end of the check
                out[name] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"}
    return {"reference": reference, "layouts": out}


# -- 2: checkpoint round trip --------------------------------------------------------------------------------

def check_checkpoint(device, steps: int, fused: bool = False) -> dict:
    """Save after `steps` steps; the next 2 steps from the saved state equal the run that went on.

    `fused`: AdamW(fused=True), whose step count torch keeps on the parameter's device: a resume
    must put it there (on the host, CUDA's fused kernel reads host memory).
    """
    from paratrain.checkpoint import CheckpointReader, LocalCoordinator, save_checkpoint
    from paratrain.run.model_state import load_model_shards, model_shards
    from paratrain.train import train_step

    cfg, data = check_model(device), check_batches(device, steps + 2)

    def build():
        return paratrain.parallelize(model_on_meta(cfg), paratrain.init_mesh(),
                                     optimizer=functools.partial(adamw, fused=fused), precision="bf16",
                                     data=DataParallel(zero=3, grad_reduction="sum"),
                                     init=functools.partial(model_on_meta(cfg).param_init, seed=0))

    model, optimizer = build()
    with tempfile.TemporaryDirectory() as root:
        for x, y in data[:steps]:
            train_step(model, optimizer, [(x, y)], 1.0)
        save_checkpoint(root, steps, model_shards(model, optimizer), coordinator=LocalCoordinator())
        went_on = [train_step(model, optimizer, [(x, y)], 1.0).loss for x, y in data[steps:]]
        fresh, fresh_optimizer = build()
        load_model_shards(fresh, fresh_optimizer, CheckpointReader(Path(root) / f"step-{steps:08d}"))
        resumed = [train_step(fresh, fresh_optimizer, [(x, y)], 1.0).loss for x, y in data[steps:]]
    steps_where = sorted({str(s["step"].device) for s in fresh_optimizer.state.values()})
    return {"fused": fused, "went_on": went_on, "resumed": resumed, "bit_equal": went_on == resumed,
            "step_device": steps_where}


# -- 3: memory given back --------------------------------------------------------------------------------------

def check_release(device, steps: int) -> dict:
    """Per ZeRO stage: the bytes a bf16 model and its optimizer hold after `steps` steps, and those left once
    both are dropped and gc.collect() ran, above where they stood before the build."""
    from paratrain.train import train_step

    out, cfg = {}, check_model(device)
    # What lives now is no build's: the collections below look at what came after it alone (a full one walks every
    # object of the process, the earlier rows' compiled code included, for a second each).
    gc.collect()
    gc.freeze()
    try:
        for zero in range(4):
            meter = TensorMemory() if device.type == "cpu" else contextlib.nullcontext()
            with meter:
                def allocated() -> int:
                    return torch.cuda.memory_allocated(device) if device.type == "cuda" else meter.total

                data = check_batches(device, steps)  # made (and seen by the meter) before the count starts
                gc.collect()
                before = allocated()
                model, optimizer = paratrain.parallelize(
                    model_on_meta(cfg), paratrain.init_mesh(), optimizer=adamw, precision="bf16",
                    data=DataParallel(zero=zero, grad_reduction="sum"),
                    init=functools.partial(model_on_meta(cfg).param_init, seed=0))
                for x, y in data:
                    train_step(model, optimizer, [(x, y)], 1.0)
                built = allocated() - before
                del model, optimizer
                gc.collect()
                left = allocated() - before
            out[f"zero{zero}"] = {"built_bytes": built, "left_bytes": left, "freed": left <= LEFT_TOL * built}
    finally:
        gc.unfreeze()
    return out


# -- 4: throughput and memory against plain PyTorch ---------------------------------------------------------

def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(step, device, warmup: int, steps: int) -> dict:
    """Time `steps` calls of `step` after `warmup` (synchronized on CUDA): min, median, max and every time, and
    the peak of allocated device memory over the timed steps (None off CUDA). bench_gpu.py measures with it too."""
    for _ in range(warmup):
        step()
    _sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        _sync(device)
        times.append(time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    return {"step_s": {"min": min(times), "median": statistics.median(times), "max": max(times), "all": times},
            "max_memory_allocated": peak}


def plain_step(model, optimizer, x, y, device, autocast: bool = True):
    """Plain PyTorch's step (bench_gpu.py's too): the forward under bf16 autocast (when `autocast`), the loss in
    fp32, global-norm clipping, the optimizer's step."""

    def step():
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            logits = model(x)
        F.cross_entropy(logits.float().flatten(0, 1), y.flatten()).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def _eager_step(cfg: ModelConfig, x, y, device):
    """Plain PyTorch's step: fp32 weights, autocast bf16, fused AdamW on CUDA, global-norm clipping."""
    model = model_on_meta(cfg).to_empty(device=device)
    model.init_weights(0)
    return plain_step(model, adamw(model.parameters(), fused=device.type == "cuda"), x, y, device)


def check_throughput(cfg: ModelConfig, device, batch: int, seq: int, warmup: int, steps: int) -> dict:
    from paratrain.train import train_step

    x, y = batches(cfg, 1, batch, seq, device)[0]
    tokens = batch * seq
    flops = cfg.flops_per_token(seq) * tokens
    peak = device_peak_flops(device)
    out = {}

    out["pytorch_eager"] = measure(_eager_step(cfg, x, y, device), device, warmup, steps)
    pmodel, poptimizer = paratrain.parallelize(model_on_meta(cfg), paratrain.init_mesh(), optimizer=adamw,
                                               precision="bf16", data=DataParallel(grad_reduction="sum"),
                                               init=functools.partial(model_on_meta(cfg).param_init, seed=0))
    out["paratrain"] = measure(lambda: train_step(pmodel, poptimizer, [(x, y)], 1.0), device, warmup, steps)
    for result in out.values():
        median = result["step_s"]["median"]
        result["tokens_per_s"] = tokens / median
        result["mfu"] = flops / median / peak if peak else None
    return {"params": cfg.num_params(), "batch": batch, "seq": seq, "peak_flops": peak, **out}


# -- paths built without a GPU ---------------------------------------------------------------------------------

def _norm_relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def check_ring_kernels(device, dtype: torch.dtype) -> dict:
    """The ring's block kernel for `dtype` on `device` against whole causal SDPA, split into 4 blocks as the ring
    computes it: forward per (query, key) block merged by lse, backward from the merged out (contiguous, as the
    ring's row slices are) and lse."""
    from paratrain.parallel.context.kernels import attention_kernel
    from paratrain.parallel.context.ring import blockwise_causal_attention

    b, h, s, e, blocks = (2, 8, 1024, 64, 4) if device.type == "cuda" else (1, 2, 64, 16, 4)
    g = torch.Generator().manual_seed(0)
    q, k, v, grad = (torch.randn(b, h, s, e, generator=g).to(device, dtype) for _ in range(4))
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = F.scaled_dot_product_attention(*full, is_causal=True)
    ref.backward(grad)
    kernel = attention_kernel(device.type, dtype, e)
    out, dq, dk, dv = blockwise_causal_attention(kernel, q, k, v, grad, blocks)
    _sync(device)
    errors = {name: _norm_relative(mine, theirs) for name, mine, theirs in
              (("out", out, ref), ("dq", dq, full[0].grad), ("dk", dk, full[1].grad), ("dv", dv, full[2].grad))}
    tol = 2e-4 if dtype == torch.float32 else 3e-2
    return {"passed": max(errors.values()) <= tol, "kernel": kernel.name, "errors": errors, "tol": tol,
            "detail": f"{kernel.name}: " + ", ".join(f"{k} {v:.1e}" for k, v in errors.items()) + f" (tol {tol:g})"}


def _cp2_worker(job: dict) -> None:
    """Each of 2 processes: ring attention over cp = 2 (NCCL) against causal SDPA of the whole sequence."""
    from paratrain.comm import Comm
    from paratrain.distributed import shutdown
    from paratrain.mesh import MeshShape, build_mesh
    from paratrain.parallel.context.ring import Ring, ring_attention
    from paratrain.parallel.context.split import shard_sequence

    device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    mesh = paratrain.init_mesh(cp=2)
    rank = mesh.coord("cp")
    g = torch.Generator().manual_seed(0)
    q, k, v, grad = (torch.randn(2, 8, 1024, 64, generator=g).to(device, torch.bfloat16) for _ in range(4))
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = F.scaled_dot_product_attention(*full, is_causal=True)
    ref.backward(grad)
    local = [shard_sequence(t, 2, rank, dim=2).requires_grad_() for t in (q, k, v)]
    out = ring_attention(*local, Ring(Comm(build_mesh(MeshShape(cp=2))), seq_len=1024))
    out.backward(shard_sequence(grad, 2, rank, dim=2))
    errors = [_norm_relative(out, shard_sequence(ref, 2, rank, dim=2))]
    errors += [_norm_relative(t.grad, shard_sequence(f.grad, 2, rank, dim=2)) for t, f in zip(local, full)]
    if int(os.environ["RANK"]) == 0:
        Path(job["out"]).write_text(json.dumps(errors))
    shutdown()


def check_cp2(device) -> dict:
    if device.type != "cuda" or torch.cuda.device_count() < 2:
        return {"skipped": "needs 2 GPUs"}
    from paratrain.launch import launch_processes

    with tempfile.TemporaryDirectory() as work:
        path = Path(work) / "cp2.json"
        launch_processes(_cp2_worker, {"out": str(path)}, 2)
        errors = json.loads(path.read_text())
    return {"passed": max(errors) <= 3e-2, "detail": f"out, dq, dk, dv {', '.join(f'{e:.1e}' for e in errors)}"}


def check_grouped_experts(device) -> dict:
    """GroupedExperts through the grouped GEMM (where this device has it) against its own per-expert loop, bf16."""
    from paratrain import compat
    from paratrain.models.moe import GroupedExperts

    dim, hidden = (256, 512) if device.type == "cuda" else (64, 128)  # the CPU dry run's bf16 kernels are slow
    torch.manual_seed(0)
    experts = GroupedExperts(8, dim, hidden).to(device, torch.bfloat16)
    for w in experts.parameters():
        torch.nn.init.normal_(w, std=0.05)
    counts = [37, 0, 120, 64, 5, 200, 90, 44]
    x = torch.randn(sum(counts), dim, device=device, dtype=torch.bfloat16)
    counts_e = torch.tensor(counts, device=device)
    grad = torch.randn_like(x)

    def run(grouped: bool):
        xi = x.clone().requires_grad_()
        out = experts(xi, counts_e, counts) if grouped else experts._loop(xi, counts)
        out.backward(grad)
        grads = [xi.grad, *(w.grad.clone() for w in experts.parameters())]
        experts.zero_grad(set_to_none=True)
        return [out, *grads]

    used = compat.grouped_mm(x[:16], experts.w1.transpose(-2, -1)[:2],
                             torch.tensor([8, 16], device=device, dtype=torch.int32)) is not None
    errors = [_norm_relative(a, b) for a, b in zip(run(True), run(False))]
    tol = 2e-2
    how = "torch._grouped_mm" if used else "no grouped GEMM on this device: the loop both ways"
    return {"passed": max(errors) <= tol, "grouped_mm": used,
            "detail": f"{how}; out, dx, dw1, dw3, dw2 max {max(errors):.1e} (tol {tol:g})"}


def _small_run(device) -> list[str]:
    """The training rows' batch on the CPU dry run, two blocks, one held-out batch at the end and no sample: the row
    checks the path (launcher, snapshots, experts), and tiny's default batch (16 x 256 tokens) makes it take half a
    minute there; on a GPU the defaults run."""
    return [] if device.type == "cuda" else ["--global-batch", "4", "--seq-len", "64", "--n-layers", "2",
                                             "--eval-every", "0", "--eval-batches", "1", "--sample-tokens", "0"]


def _run_cli(args: list[str], timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "paratrain", *args], capture_output=True, text=True,
                          timeout=timeout)


def _cli_here(args: list[str]) -> tuple[int, str]:
    """`paratrain ARGS` in this process: its exit status and what it printed."""
    from paratrain.cli import main as paratrain_main

    said = io.StringIO()
    with contextlib.redirect_stdout(said), contextlib.redirect_stderr(said):
        try:
            code = paratrain_main(args)
        except SystemExit as e:  # bad arguments: argparse's exit
            code = e.code if isinstance(e.code, int) else 1
    return code, said.getvalue()


def _losses_of_run(run_dir: Path) -> list[float]:
    return [r["loss"] for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
            if r.get("kind", "step") == "step" and "loss" in r]


def check_tiny_moe(device, steps: int) -> dict:
    """`paratrain train --model tiny-moe` (one process: the command trains in the process that runs it, here this
    one, whose torch and trainer are imported already) learns."""
    with tempfile.TemporaryDirectory() as work:
        code, said = _cli_here(["train", "--model", "tiny-moe", "--steps", str(steps), "--out", f"{work}/run",
                                "--log-every", "1", "--no-progress", *_small_run(device)])
        if code:
            return {"passed": False, "detail": (said.strip().splitlines() or ["(no output)"])[-1][:300]}
        losses = _losses_of_run(Path(work) / "run")
    return {"passed": losses[-1] < losses[0] - 0.5, "losses": losses,
            "detail": f"{steps} steps: loss {losses[0]:.2f} -> {losses[-1]:.2f} (must fall by 0.5 nats)"}


def _graph_breaks() -> int:
    return sum(torch._dynamo.utils.counters["graph_break"].values())


def check_compile(device, zero: int, steps: int) -> dict:
    """ZeRO-`zero` with compile=True against the same layout eager, bf16; no graph break. On the CPU the
    aot_eager backend stands in for inductor (the same graphs, no kernel compilation)."""
    cfg, data = check_model(device), check_batches(device, steps)
    eager = paratrain_losses(cfg, data, {"zero": zero})
    torch._dynamo.reset()
    stats = torch._dynamo.utils.counters
    before, graphs_before = _graph_breaks(), stats["stats"]["unique_graphs"]
    compiled = paratrain_losses(cfg, data, {"zero": zero, "compile": True if device.type == "cuda" else "aot_eager"})
    breaks, graphs = _graph_breaks() - before, stats["stats"]["unique_graphs"] - graphs_before
    diff = relative_difference(compiled, eager)
    return {"passed": diff <= TOL and breaks == 0 and graphs > 0, "rel_diff": diff, "graph_breaks": breaks,
            "graphs": graphs, "detail": f"loss rel diff {diff:.1e} (tol {TOL:g}), {graphs} graphs, {breaks} graph breaks"}


def check_selective(device, steps: int) -> dict:
    cfg, data = check_model(device), check_batches(device, steps)
    none = paratrain_losses(cfg, data, {"zero": 0})
    selective = paratrain_losses(cfg, data, {"zero": 0, "recompute": "selective"})
    diff = relative_difference(selective, none)
    return {"passed": diff <= TOL, "rel_diff": diff, "detail": f"loss rel diff {diff:.1e} (tol {TOL:g})"}


def check_document_mask(device) -> dict:
    """--document-mask on the device's kernels (SDPA with a boolean mask and GQA: the memory-efficient kernel on
    CUDA): a packed sequence's logits against each document run alone, fp32 and bf16."""
    eos, details, passed = 1, [], True
    cfg = dataclasses.replace(CHECK, document_eos=eos)
    g = torch.Generator().manual_seed(0)
    docs = [torch.randint(2, CHECK.vocab_size, (n,), generator=g) for n in (17, 40, 9, 61)]
    segments = [torch.cat((d, torch.tensor([eos]))) for d in docs]
    packed = torch.cat(segments)[None].to(device)
    for dtype, tol in ((torch.float32, 1e-4), (torch.bfloat16, 3e-2)):
        torch.manual_seed(0)
        masked = Transformer(cfg).to(device=device, dtype=dtype)
        alone = Transformer(CHECK).to(device=device, dtype=dtype)
        alone.load_state_dict(masked.state_dict())
        with torch.no_grad():
            logits, start, worst = masked(packed)[0].float(), 0, 0.0
            for segment in segments:
                ref = alone(segment[None].to(device))[0].float()
                got = logits[start:start + len(segment)]
                worst = max(worst, ((got - ref).abs().max() / ref.abs().max()).item())
                start += len(segment)
        passed &= worst <= tol
        details.append(f"{str(dtype).removeprefix('torch.')} {worst:.1e} (tol {tol:g})")
    return {"passed": passed, "detail": "packed vs each document alone: " + ", ".join(details)}


def check_fp8(device, steps: int) -> dict:
    """FP8 linears on the device's kernels (torch._scaled_mm; rowwise where the GPU has it, SM90+): each matmul
    against fp32 matmuls of its dequantized operands, then a few bf16 steps of the check model with every block
    linear in FP8 against the same steps in bf16 (the losses must agree to FP8's few percent)."""
    from paratrain.parallel.fp8 import E4M3, E5M2, convert_to_fp8, fp8_linear, scale_of, to_fp8

    def dequantized(t, dtype, dim=None, pow2=False):
        scale = scale_of(t, dtype, dim, pow2)
        return to_fp8(t, scale, dtype).float() / scale

    def rel(a, b):
        return ((a.float() - b.float()).norm() / b.float().norm()).item()

    recipes = ["tensorwise"] + (["rowwise"] if device.type != "cuda" or torch.cuda.get_device_capability(device)[0] >= 9
                                else [])
    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 512, generator=g).to(device, torch.bfloat16).requires_grad_()
    w = (torch.randn(1024, 512, generator=g) * 0.05).to(device, torch.bfloat16).requires_grad_()
    dy = torch.randn(256, 1024, generator=g).to(device, torch.bfloat16)
    details, passed = [], True
    for recipe in recipes:
        x.grad = w.grad = None
        fp8_linear(x, w, None, recipe).backward(dy)
        y = fp8_linear(x.detach(), w.detach(), None, recipe)
        if recipe == "tensorwise":
            xq, wq, gq = dequantized(x, E4M3), dequantized(w, E4M3), dequantized(dy, E5M2)
            want = (xq @ wq.t(), gq @ wq, gq.t() @ xq)
        else:
            want = (dequantized(x, E4M3, 1, True) @ dequantized(w.t(), E4M3, 0, True),
                    dequantized(dy, E4M3, 1, True) @ dequantized(w, E4M3, 0, True),
                    dequantized(dy.t(), E4M3, 1, True) @ dequantized(x, E4M3, 0, True))
        worst = max(rel(got, ref) for got, ref in zip((y, x.grad, w.grad), want))
        same, reference = torchao_matches(recipe, x, w, dy, (y, x.grad, w.grad))
        cfg, data = check_model(device), check_batches(device, steps)
        losses = {}
        for name in ("bf16", recipe):
            torch.manual_seed(0)
            model = Transformer(cfg).to(device=device, dtype=torch.bfloat16)
            converted = convert_to_fp8(model, recipe) if name != "bf16" else []
            optimizer = adamw(model.parameters())
            losses[name] = []
            for inputs, labels in data:
                loss = F.cross_entropy(model(inputs).float().flatten(0, 1), labels.flatten())
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
                losses[name].append(loss.item())
        diff = relative_difference(losses[recipe], losses["bf16"])
        passed &= worst <= 1e-2 and diff <= 0.05 and len(converted) == cfg.n_layers * 7 and same is not False
        details.append(f"{recipe}: matmuls vs emulation {worst:.1e} (tol 1e-2), {reference}, {len(converted)} "
                       f"linears, loss vs bf16 {diff:.1e} (tol 0.05)")
    return {"passed": passed, "detail": "; ".join(details)}


LLAMA3_8B_HEAD = (4096, 128_256)  # hidden size, vocabulary of Llama 3.1 8B
LLAMA3_8B_LINEARS = {"wq/wo": (4096, 4096), "wk/wv": (4096, 1024), "w1/w3": (4096, 14336), "w2": (14336, 4096)}


def check_fused_loss(device, dtype: torch.dtype, small: bool) -> dict:
    """The fused loss (parallel/loss.py: the head's matmul and the cross-entropy in chunks of 1,024 tokens, the
    logits recomputed in backward) against the whole logits' loss (`precision.cross_entropy` of F.linear) on the
    device's kernels, at Llama 3.1 8B's head (4,096 x 128,256; 4,096 tokens, a fifth of them masked): the loss and
    the gradients of the hidden states and of the head, norm-relative (fp32 1e-5 with TF32 off; bf16 2e-2); and
    the peak bytes each adds over its inputs (torch.cuda.max_memory_allocated)."""
    from paratrain.parallel.loss import linear_cross_entropy
    from paratrain.precision import cross_entropy

    dim, vocab = (64, 512) if small else LLAMA3_8B_HEAD
    tokens = 256 if small else 4096
    chunk = 64 if small else 1024
    g = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, dim, generator=g).to(device, dtype).requires_grad_()
    w = (torch.randn(vocab, dim, generator=g) * 0.02).to(device, dtype).requires_grad_()
    y = torch.randint(0, vocab, (tokens,), generator=g)
    y[torch.rand(tokens, generator=g) < 0.2] = -100
    y = y.to(device)
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        results = {}
        for name, loss_of in (("fused", lambda: linear_cross_entropy(x, w, y, chunk=chunk)),
                              ("whole", lambda: cross_entropy(torch.nn.functional.linear(x, w), y))):
            x.grad = w.grad = None
            results[name] = _peak_of(device, lambda: loss_of().backward() or None, loss_of)
            results[name]["grads"] = (x.grad.clone(), w.grad.clone())
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    fused, whole = results["fused"], results["whole"]
    errors = [_norm_relative(fused["loss"], whole["loss"])] + \
        [_norm_relative(a, b) for a, b in zip(fused["grads"], whole["grads"])]
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    peaks = "" if fused["peak"] is None else \
        f"; peak over inputs {fused['peak'] / 2**20:,.0f} MiB fused vs {whole['peak'] / 2**20:,.0f} MiB whole logits"
    return {"passed": max(errors) <= tol, "errors": errors, "peak_fused": fused["peak"], "peak_whole": whole["peak"],
            "detail": f"{tokens} tokens x {vocab}: loss, dX, dW rel err {', '.join(f'{e:.1e}' for e in errors)} "
                      f"(tol {tol:g}){peaks}"}


def _peak_of(device, backward, loss_of) -> dict:
    """The loss (no grad) and the peak bytes that `backward()` (a forward and its backward) adds over what exists
    (on CUDA; the CPU's are `tests/parallel/test_fused_loss_memory.py`'s)."""
    with torch.no_grad():
        loss = loss_of().detach()
    if device.type != "cuda":
        backward()
        return {"loss": loss, "peak": None}
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    start = torch.cuda.memory_allocated(device)
    backward()
    torch.cuda.synchronize(device)
    return {"loss": loss, "peak": torch.cuda.max_memory_allocated(device) - start}


def check_fp8_8b(device, small: bool) -> dict:
    """FP8 matmuls (parallel/fp8.py, torch._scaled_mm) at Llama 3.1 8B's linear shapes, 8,192 tokens: each recipe's
    output and gradients against the bf16 matmul (norm-relative: e4m3 keeps 3 mantissa bits, e5m2 2; within 0.15), and
    its forward + backward time against bf16's (reported; the step's speedup is bench_gpu.py's llama3.1-8b rows)."""
    from paratrain.parallel.fp8 import fp8_linear

    shapes = {"tiny": (64, 128)} if small else LLAMA3_8B_LINEARS
    tokens = 256 if small else 8192
    recipes = ["tensorwise"] + (["rowwise"] if device.type != "cuda" or torch.cuda.get_device_capability(device)[0] >= 9
                                else [])
    g = torch.Generator().manual_seed(0)
    details, passed, out = [], True, {}
    for name, (fan_in, fan_out) in shapes.items():
        x = torch.randn(tokens, fan_in, generator=g).to(device, torch.bfloat16).requires_grad_()
        w = (torch.randn(fan_out, fan_in, generator=g) / fan_in ** 0.5).to(device, torch.bfloat16).requires_grad_()
        dy = torch.randn(tokens, fan_out, generator=g).to(device, torch.bfloat16)

        def run(recipe):
            x.grad = w.grad = None
            y = fp8_linear(x, w, None, recipe) if recipe else torch.nn.functional.linear(x, w)
            y.backward(dy)
            return y.detach(), x.grad, w.grad

        want = run(None)
        times = {"bf16": measure(lambda: run(None), device, 1, 3)["step_s"]["median"]}
        for recipe in recipes:
            worst = max(_norm_relative(a, b) for a, b in zip(run(recipe), want))
            times[recipe] = measure(lambda: run(recipe), device, 1, 3)["step_s"]["median"]
            passed &= worst <= 0.15
            out[f"{name} {recipe}"] = {"rel_err": worst, "speedup": times["bf16"] / times[recipe]}
            details.append(f"{name} {recipe} err {worst:.1e}, {times['bf16'] / times[recipe]:.2f}x bf16")
    return {"passed": passed, "shapes": out, "detail": f"{tokens} tokens: " + "; ".join(details) + " (tol 0.15)"}


def torchao_matches(recipe: str, x, w, dy, ours) -> tuple[bool | None, str]:
    """Whether torchao's Float8Linear (the reference implementation, where this image has it) computes the output
    and both gradients of `x` · `w`ᵀ exactly as paratrain's FP8 linear did (`ours`), on this device's kernels;
    None where torchao is not installed (the CPU suite holds the same equality on torch's emulated kernels)."""
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except ImportError:
        return None, "torchao not installed: not compared with it"
    layer = torch.nn.Sequential(torch.nn.Linear(w.shape[1], w.shape[0], bias=False, device=w.device, dtype=w.dtype))
    with torch.no_grad():
        layer[0].weight.copy_(w)
    convert_to_float8_training(layer, config=Float8LinearConfig.from_recipe_name(recipe))
    xx = x.detach().clone().requires_grad_()
    y = layer(xx)
    y.backward(dy)
    theirs = (y, xx.grad, layer[0].weight.grad)
    same = all(torch.equal(a, b) for a, b in zip(ours, theirs))
    worst = max((a.float() - b.float()).abs().max().item() for a, b in zip(ours, theirs))
    return same, f"torchao's Float8Linear {'equal to the bit' if same else f'differs (max {worst:.1e})'}"


def check_fp8_zero3(device, steps: int) -> dict:
    """ZeRO-3 gathering the FP8 linears' weights as their e4m3 casts (scales agreed over the shards), compiled and
    with selective recomputation, against ZeRO-0 casting its whole bf16 weights, eager: the same casts."""
    cfg, data = check_model(device), check_batches(device, steps)
    whole = paratrain_losses(cfg, data, {"zero": 0, "fp8": "tensorwise"})
    torch._dynamo.reset()
    gathered = paratrain_losses(cfg, data, {"zero": 3, "fp8": "tensorwise", "recompute": "selective",
                                              "compile": True if device.type == "cuda" else "aot_eager"})
    diff = relative_difference(gathered, whole)
    return {"passed": diff <= 2e-2, "rel_diff": diff, "detail": f"loss rel diff {diff:.1e} (tol 2e-2)"}


def check_offload(device, steps: int) -> dict:
    """The optimizer offloaded (pinned host masters, gradients out on a copy stream, the host's fused AdamW, the
    values back into the parameters) against the device's own step, ZeRO-0 and ZeRO-3: the same losses but for
    the two AdamW kernels' roundings; and the masters really on the host, pinned on CUDA."""
    cfg, data = check_model(device), check_batches(device, steps)
    details, worst = [], 0.0
    for zero in (0, 3):
        on_device = paratrain_losses(cfg, data, {"zero": zero})
        offloaded = paratrain_losses(cfg, data, {"zero": zero, "offload": "optimizer"})
        diff = relative_difference(offloaded, on_device)
        worst = max(worst, diff)
        details.append(f"ZeRO-{zero} loss rel diff {diff:.1e}")
    model, optimizer = paratrain.parallelize(torch.nn.Linear(16, 16), paratrain.init_mesh(), precision="bf16",
                                             optimizer=functools.partial(adamw, fused=True),
                                             data=DataParallel(offload="optimizer"))
    host = model.offload
    placed = all(v.device.type == "cpu" and v.is_pinned() == host.pinned for v in host.values)
    placed &= host.pinned == (device.type == "cuda") and model.module.weight.device.type == device.type
    before = model.module.weight.detach().clone()
    model(torch.ones(2, 16, device=device)).sum().backward()
    optimizer.step()  # stepped in the host step's thread: the next forward waits for it (here: at once)
    model(torch.ones(2, 16, device=device))
    moved = not torch.equal(model.module.weight.detach(), before)
    return {"passed": worst <= 1e-3 and placed and host.overlapped and moved, "rel_diff": worst,
            "detail": "; ".join(details) + f" (tol 1e-3); masters on the host, pinned: {host.pinned}; "
                      f"stepped in the host thread, overlapping the next forward: {host.overlapped}"}


def check_offload_muon(device, steps: int) -> dict:
    """Muon offloaded (its momentum and AdamW's state in pinned host memory, each bf16 update copied to the device
    for the Newton–Schulz iteration and the result back) against Muon on the device, ZeRO-1: the same losses but
    for the host's and the device's roundings of the element-wise passes; the momentum on the host and the update's
    staging buffers pinned on CUDA."""
    tiny = SIZES["tiny"]  # (the mechanism, not the scale: its Newton–Schulz is 8x cheaper than CHECK's on a CPU)
    data = batches(tiny, steps, 8, 32, device)
    on_device = paratrain_losses(tiny, data, {"zero": 1, "optimizer": "muon"})
    diff = relative_difference(paratrain_losses(tiny, data, {"zero": 1, "optimizer": "muon", "offload": "optimizer"}),
                               on_device)
    model, optimizer = paratrain.parallelize(torch.nn.Linear(16, 16, bias=False), paratrain.init_mesh(),
                                             precision="bf16", optimizer=functools.partial(torch.optim.Muon, lr=0.02),
                                             data=DataParallel(offload="optimizer"))
    before = model.module.weight.detach().clone()
    model(torch.ones(2, 16, device=device)).sum().backward()
    optimizer.step()
    moved = not torch.equal(model.module.weight.detach(), before)
    momenta, staging = [s["momentum_buffer"] for s in optimizer.state.values()], list(optimizer.host.buffers.values())
    placed = bool(momenta) and all(t.device.type == "cpu" for t in momenta + staging)
    placed &= all(t.is_pinned() == (device.type == "cuda") for t in staging)
    return {"passed": diff <= 1e-3 and placed and moved, "rel_diff": diff,
            "detail": f"ZeRO-1 loss rel diff {diff:.1e} vs Muon on the device (tol 1e-3); momentum on the host, "
                      f"the update's staging pinned: {optimizer.host.pinned} (placed as expected: {placed}); "
                      f"stepped: {moved}"}


def check_calibrate(device, profile: Path) -> dict:
    args = ["plan", "--calibrate", "--quick", "--out", str(profile)]
    if device.type == "cuda":  # its own process: a CUDA context of this one would sit on GPU 0 beside the ranks'
        result = _run_cli(args, timeout=600)
        code, said = result.returncode, result.stderr
    else:  # the CPU dry run: in this process, whose torch is imported already; the two ranks its worker server's
        code, said = _cli_here([*args, "--nproc", "2"])
    if code or not profile.exists():
        return {"passed": False, "detail": (said.strip().splitlines() or ["(no output)"])[-1][:300]}
    data = json.loads(profile.read_text())
    links = data.get("pcie_bytes_per_s", 0) > 0 or device.type != "cuda"  # the host link, measured on a GPU
    # the host's time per eager operation and what recomputation and ZeRO-3 add: measured here, where the GPU
    # presets hold an estimate (paratrain/plan/hardware.py) for the next GPU session to check
    host = {name: data.get(name, 0.0) for name in ("host_op_s", "host_full_op_s", "host_selective_op_s", "host_unit_s")}
    return {"passed": links and data.get("host_bytes_per_s", 0) > 0 and host["host_op_s"] > 0, "profile": str(profile),
            "host": host,
            "detail": f"{profile.name}: bf16 peak {data.get('peak_bf16', 0) / 1e12:.1f} TFLOP/s, "
                      f"memory {data.get('hbm_bytes_per_s', 0) / 1e9:.0f} GB/s, host AdamW "
                      f"{data.get('host_bytes_per_s', 0) / 1e9:.0f} GB/s, host link "
                      f"{data.get('pcie_bytes_per_s', 0) / 1e9:.1f} GB/s; host per eager op "
                      f"{host['host_op_s'] * 1e6:.1f} us, +{host['host_full_op_s'] * 1e6:.1f} full / "
                      f"+{host['host_selective_op_s'] * 1e6:.1f} selective per recomputed op, ZeRO-3 "
                      f"{host['host_unit_s'] * 1e6:.0f} us per unit"}


def check_launcher(device, steps: int) -> dict:
    """`paratrain train` through torch's elastic agent (launch_local) with one worker forked from the worker
    server, in this process, which has CUDA initialized by the rows before it."""
    from paratrain.commands.options import config_from_args
    from paratrain.cli import build_parser
    from paratrain.launch import launch_local

    with tempfile.TemporaryDirectory() as work:
        cfg = config_from_args(build_parser().parse_args(
            ["train", "--model", "tiny", "--steps", str(steps), "--out", f"{work}/run", "--log-every", "1",
             *_small_run(device)]))
        launch_local(cfg)
        losses = _losses_of_run(Path(work) / "run")
    return {"passed": len(losses) == steps and losses[-1] < losses[0], "losses": losses,
            "detail": f"1 worker, {steps} steps: loss {losses[0]:.2f} -> {losses[-1]:.2f}"}


# -- the command ---------------------------------------------------------------------------------------------

def check_memory_snapshot(device) -> dict:
    """`paratrain train --memory-snapshot`: a snapshot after the first optimizer step, and one when a step runs out
    of memory (the injected `oom` fault: a MemoryError inside the step) before the run's out-of-memory error. On
    the CPU: no snapshot, and the run says it needs CUDA."""
    from paratrain.cli import build_parser
    from paratrain.commands.options import config_from_args
    from paratrain.run.guard import OutOfMemory
    from paratrain.train import train

    def run(out: str):
        train(config_from_args(build_parser().parse_args(
            ["train", "--model", "tiny", "--steps", "2", "--out", out, "--memory-snapshot", "--no-progress",
             *_small_run(device)])))

    with tempfile.TemporaryDirectory() as work:
        run(f"{work}/ok")
        first = sorted(p.name for p in Path(work, "ok", "memory").glob("*.pickle"))
        os.environ["PARATRAIN_FAULT"] = "oom@rank0:step2"
        try:
            run(f"{work}/oom")
            raised = False
        except OutOfMemory:
            raised = True
        finally:
            del os.environ["PARATRAIN_FAULT"]
        oom = sorted(p.name for p in Path(work, "oom", "memory").glob("*.pickle"))
    if device.type != "cuda":
        return {"passed": not first and not oom and raised, "detail": "cpu: no snapshot (it needs CUDA)"}
    expected = (["rank-0-step-1.pickle"], ["rank-0-oom-step-2.pickle", "rank-0-step-1.pickle"])
    return {"passed": (first, oom) == expected and raised, "detail": f"written: {first}; out of memory: {oom}"}


def _world1_rows(device, steps: int) -> list:
    cfg, data = check_model(device), check_batches(device, steps)
    reference = functools.cache(lambda: reference_losses(cfg, data, device))

    def row(layout):
        losses = paratrain_losses(cfg, data, layout)
        diff = relative_difference(losses, reference())
        return {"passed": diff <= TOL, "losses": losses, "rel_diff": diff,
                "detail": f"loss rel diff {diff:.1e} vs one plain PyTorch process (tol {TOL:g})"}

    return [(f"world 1 {name}", functools.partial(row, layout)) for name, layout in LAYOUTS_1.items()]


def _world2_rows(device, steps: int) -> list:
    if device.type != "cuda" or torch.cuda.device_count() < 2:
        return [("world 2 NCCL layouts", lambda: {"skipped": "needs 2 GPUs"})]
    results = functools.cache(lambda: check_world2(device, steps)["layouts"])

    def row(name):
        r = results()[name]
        if "error" in r:
            return {"passed": False, "detail": r["error"]}
        return {"passed": r["rel_diff"] <= TOL, **r, "detail": f"loss rel diff {r['rel_diff']:.1e} (tol {TOL:g})"}

    return [(f"world 2 {name}", functools.partial(row, name)) for name in LAYOUTS_2]


def _checkpoint_row(device, steps: int, fused: bool) -> dict:
    r = check_checkpoint(device, steps, fused)
    return {**r, "passed": r["bit_equal"],
            "detail": f"next {len(r['went_on'])} losses bit-equal: {r['bit_equal']}"
                      + (f"; fused AdamW's step on {', '.join(r['step_device'])}" if fused else "")}


def _release_rows(device, steps: int) -> list:
    results = functools.cache(lambda: check_release(device, steps))

    def row(name):
        r = results()[name]
        return {**r, "passed": r["freed"], "detail": f"{r['left_bytes']:,} of {r['built_bytes']:,} bytes left"}

    return [(f"memory given back {name}", functools.partial(row, name)) for name in ("zero0", "zero1", "zero2", "zero3")]


def _throughput_row(cfg: ModelConfig, device, batch: int, seq: int, steps: int) -> dict:
    t = check_throughput(cfg, device, batch, seq, 2, steps)
    mine, plain = t["paratrain"], t["pytorch_eager"]
    ratio = mine["step_s"]["median"] / plain["step_s"]["median"]
    mem = (lambda r: "-" if r["max_memory_allocated"] is None else f"{r['max_memory_allocated'] / 2**30:.2f} GiB")
    mfu = (lambda r: "-" if r["mfu"] is None else f"{r['mfu']:.1%}")
    # On 2 shared CPU cores a step's time is noise: the bound is a GPU's.
    passed = ratio <= 1.10 if device.type == "cuda" else True
    return {**t, "passed": passed, "time_ratio": ratio,
            "detail": f"{t['params'] / 1e6:,.0f}M params, {batch}x{seq}: step {mine['step_s']['median']:.3f} s vs "
                      f"plain {plain['step_s']['median']:.3f} s ({ratio:.2f}x), MFU {mfu(mine)} vs {mfu(plain)}, "
                      f"peak {mem(mine)} vs {mem(plain)}"}


def check_transformers_qwen3(device, steps: int) -> dict:
    """A Qwen3-shaped transformers model (QK norms, head_dim ≠ hidden/heads) through `paratrain.models.hf`, compiled per
    decoder layer, bf16, at world 1 under ZeRO-0..3, its own tensor-parallel plan at tp 1, selective and full
    recomputation and FP8 (on CUDA), against transformers' model of the same directory stepped plainly (autocast
    bf16, AdamW): largest relative loss difference per layout, and no graph break."""
    import transformers

    from paratrain.interop.hf_weights import weight_initializer
    from paratrain.models.hf import HFCausalLM, read_model_dir
    from paratrain.train import train_step

    small = device.type != "cuda"  # the CPU dry run: bf16 matmuls there may take torch's slow reference kernel
    config = transformers.Qwen3Config(vocab_size=512 if small else 2048, hidden_size=128 if small else 512,
                                      intermediate_size=256 if small else 1536, num_hidden_layers=2 if small else 4,
                                      num_attention_heads=4 if small else 8, num_key_value_heads=2 if small else 4,
                                      head_dim=48 if small else 128, max_position_embeddings=256,
                                      tie_word_embeddings=False)
    directory = tempfile.mkdtemp(prefix="gpu-check-qwen3-")
    torch.manual_seed(0)
    transformers.Qwen3ForCausalLM(config).save_pretrained(directory)
    g = torch.Generator().manual_seed(0)
    tokens = (2, 33) if small else (4, 129)
    data = [(t[:, :-1].to(device), t[:, 1:].to(device))
            for t in (torch.randint(0, config.vocab_size, tokens, generator=g) for _ in range(steps))]
    plain = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).to(device)
    optimizer = adamw(plain.parameters())
    reference = []
    for x, y in data:
        with torch.autocast(device.type, dtype=torch.bfloat16):
            logits = plain(x).logits
        loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        reference.append(loss.item())
    del plain, optimizer
    backend = True if device.type == "cuda" else "aot_eager"
    if device.type == "cuda":
        layouts = {f"zero{z}": {"zero": z} for z in (0, 1, 2, 3)}
        layouts.update({"tp1 plan": {"tp": True}, "selective": {"recompute": "selective"},
                        "full": {"recompute": "full"}, "fp8 tensorwise": {"fp8": "tensorwise"}})
    else:
        # The CPU dry run compiles each option once, two of them together (every compilation, aot_eager's
        # included, is seconds of a CPU): ZeRO-3 with selective recomputation, the tp plan with full; at world 1
        # ZeRO-1 and -2 compile ZeRO-0's layer graphs (what they shard is outside them): left to the GPU.
        layouts = {"zero0": {"zero": 0}, "zero3 selective": {"zero": 3, "recompute": "selective"},
                   "tp1 plan full": {"tp": True, "recompute": "full"}}
    worst, details, breaks = 0.0, [], _graph_breaks()
    for name, layout in layouts.items():
        model = HFCausalLM.build(read_model_dir(directory))
        pmodel, opt = paratrain.parallelize(
            model, paratrain.init_mesh(), optimizer=adamw, precision="bf16", compile=backend,
            data=DataParallel(zero=layout.get("zero", 0), grad_reduction="sum"),
            tensor=TensorParallel(plan=model.tensor_parallel_plan() if layout.get("tp") else None),
            activation_checkpointing=layout.get("recompute", 0), fp8=layout.get("fp8"), fp8_min_features=0,
            init=weight_initializer(model, directory, seed=0))
        losses = [train_step(pmodel, opt, [(x, y)], 0.0).loss for x, y in data]
        diff = relative_difference(losses, reference)
        worst = max(worst, diff)
        details.append(f"{name} {diff:.1e}")
        del pmodel, opt
    breaks = _graph_breaks() - breaks
    return {"passed": worst <= TOL and breaks == 0, "rel_diff": worst, "graph_breaks": breaks,
            "detail": f"loss rel diff vs transformers eager: {', '.join(details)} (tol {TOL:g}); {breaks} graph breaks"}


def rows(device, args, profile: Path) -> list:
    """(name, check) in the order they run: each check returns {"passed", "detail", ...} or {"skipped": why}."""
    steps = args.check_steps
    seq = min(args.seq, SIZES[args.size].max_seq_len)
    return [
        ("ring kernels fp32", lambda: check_ring_kernels(device, torch.float32)),
        ("ring kernels bf16", lambda: check_ring_kernels(device, torch.bfloat16)),
        ("ring attention cp2", lambda: check_cp2(device)),
        ("experts grouped GEMM", lambda: check_grouped_experts(device)),
        ("tiny-moe trains", lambda: check_tiny_moe(device, args.train_steps)),
        ("compile ZeRO-0", lambda: check_compile(device, 0, steps)),
        ("compile ZeRO-3", lambda: check_compile(device, 3, steps)),
        ("selective recomputation", lambda: check_selective(device, steps)),
        ("document mask", lambda: check_document_mask(device)),
        ("fp8 linears", lambda: check_fp8(device, steps)),
        ("fp8 ZeRO-3 gathers", lambda: check_fp8_zero3(device, steps)),
        ("fp8 llama3.1-8b shapes", lambda: check_fp8_8b(device, args.size == "tiny")),
        ("fused loss fp32", lambda: check_fused_loss(device, torch.float32, args.size == "tiny")),
        ("fused loss bf16", lambda: check_fused_loss(device, torch.bfloat16, args.size == "tiny")),
        ("offload optimizer", lambda: check_offload(device, steps)),
        ("offload optimizer, Muon", lambda: check_offload_muon(device, steps)),
        ("plan --calibrate --quick", lambda: check_calibrate(device, profile)),
        ("elastic launcher", lambda: check_launcher(device, args.train_steps)),
        ("memory snapshot", lambda: check_memory_snapshot(device)),
        *_world1_rows(device, steps),
        *_lora_rows(device, steps),
        ("checkpoint round trip", lambda: _checkpoint_row(device, steps, False)),
        ("checkpoint round trip, fused AdamW", lambda: _checkpoint_row(device, steps, True)),
        *_release_rows(device, steps),
        (f"{args.size} step vs plain PyTorch", lambda: _throughput_row(SIZES[args.size], device, args.batch, seq,
                                                                       args.steps)),
        ("transformers Qwen3 compiled, world 1", lambda: check_transformers_qwen3(device, steps)),
        *_world2_rows(device, steps),
    ]


def run_rows(checks: list) -> list[dict]:
    out = []
    for name, check in checks:
        start = time.perf_counter()
        try:
            result = check()
        except Exception as e:  # noqa: BLE001 - a check that raises is a FAIL row, and the next row still runs
            result = {"passed": False, "detail": f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:300]}"}
        status = "SKIP" if "skipped" in result else "PASS" if result["passed"] else "FAIL"
        row = {"row": name, "status": status, "seconds": time.perf_counter() - start,
               **{k: v for k, v in result.items() if k != "passed"}}
        out.append(row)
        print(f"{status}  {name:<40} {result.get('detail') or result.get('skipped')}  ({row['seconds']:.1f} s)",
              flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="where to run (default cuda)")
    parser.add_argument("--size", default="1b", choices=list(SIZES), help="model of the throughput row (default 1b)")
    parser.add_argument("--steps", type=int, default=10, help="measured steps of the throughput row (default 10)")
    parser.add_argument("--check-steps", type=int, default=5, help="steps of each equivalence run (default 5)")
    parser.add_argument("--train-steps", type=int, default=40,
                        help="steps of the tiny-moe and launcher training runs (default 40)")
    parser.add_argument("--batch", type=int, default=4, help="sequences per throughput step (default 4)")
    parser.add_argument("--seq", type=int, default=2048, help="tokens per sequence (default 2048)")
    parser.add_argument("--only", metavar="TEXT", default=None, help="run only the rows whose name contains TEXT")
    parser.add_argument("--skip", metavar="TEXT", default=None, help="leave out the rows whose name contains TEXT")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"), help="results directory")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_check: error: no CUDA device here (use --device cpu for the same checks on the CPU)",
              file=sys.stderr)
        return 2
    device = torch.device(args.device, 0) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    results = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "machine": platform.node(),
               "device": torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu ({os.cpu_count()} cores)",
               "torch": torch.__version__, "cuda": torch.version.cuda, "gpus": torch.cuda.device_count()}
    print(f"gpu_check on {results['device']} (torch {results['torch']}, CUDA {results['cuda']})", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"gpu-check-{time.strftime('%Y%m%d-%H%M%S')}"
    checks = [(n, c) for n, c in rows(device, args, stem.with_name(stem.name + "-profile.json"))
              if (args.only is None or args.only in n) and (args.skip is None or args.skip not in n)]
    start = time.perf_counter()
    results["rows"] = run_rows(checks)
    results["total_s"] = time.perf_counter() - start
    write(results, stem)
    failed = [r["row"] for r in results["rows"] if r["status"] == "FAIL"]
    print(f"{'FAILED: ' + ', '.join(failed) if failed else 'all rows passed'} ({results['total_s']:.0f} s)")
    return 1 if failed else 0


def write(results: dict, stem: Path) -> None:
    stem.with_suffix(".json").write_text(json.dumps(results, indent=2, default=str) + "\n")
    lines = [f"# gpu_check {results['date']} on {results['device']} ({results['gpus']} GPU(s)), "
             f"torch {results['torch']}, CUDA {results['cuda']}", "", f"{results['total_s']:.0f} s.", "",
             "| row | result | detail | s |", "| --- | --- | --- | --- |"]
    lines += [f"| {r['row']} | {r['status']} | {r.get('detail') or r.get('skipped')} | {r['seconds']:.1f} |"
              for r in results["rows"]]
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print(f"written: {stem}.json, {stem}.md")


if __name__ == "__main__":
    sys.exit(main())
