"""One command for a CUDA machine: is paratrain right and fast on this GPU?

    python benchmarks/gpu_check.py                    # one GPU is enough; 2+ GPUs add the NCCL layouts
    python benchmarks/gpu_check.py --device cpu --size tiny --steps 4    # the same checks, small, on the CPU

1. Equivalence at world 1, bf16: every data-parallel engine (DDP, ZeRO-1/2/3) and tensor parallelism
   (the reference plan, degenerate at tp = 1) against one plain PyTorch process (autocast bf16, fp32
   weights, AdamW), same model, same batches: largest relative loss difference per layout.
2. A checkpoint saved mid-run, loaded into a fresh model: the next steps' losses equal those of the
   run that went on (bit-exact); with AdamW and with fused AdamW (whose step count must be loaded
   onto the GPU, where its kernel reads it).
3. Memory given back: a bf16 model and its optimizer (DDP, ZeRO-1/2/3), built, trained and dropped
   (gc.collect()): torch.cuda.memory_allocated left above where it stood before the build (on the
   CPU, live tensor bytes: paratrain.peak_memory.TensorMemory); under 1% of the model's bytes.
4. A 1B-class model: tokens/s, MFU (the GPU's dense bf16 peak, paratrain.hardware) and
   torch.cuda.max_memory_allocated of paratrain (DDP at world 1, bf16) against plain PyTorch eager
   (the same model, autocast bf16, AdamW(fused=True)), on the same GPU, several steps after warm-up.
5. With 2+ GPUs: dp2 (ZeRO 0-3), tp2, tp2 with sequence parallelism and pp2 with every schedule over
   NCCL, against the single-process reference.

Writes benchmarks/results/gpu-check-<date>.json and .md with the device, torch and CUDA versions.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import gc
import json
import os
import platform
import statistics
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
LAYOUTS_1 = {"ddp": {}, "zero1": {"zero": 1}, "zero2": {"zero": 2}, "zero3": {"zero": 3}, "tp1_plan": {"tp": 1}}
LAYOUTS_2 = {**{f"dp2_zero{z}": {"dp": 2, "zero": z} for z in range(4)}, "tp2": {"tp": 2},
             "tp2_sp": {"tp": 2, "sp": True},
             **{f"pp2_{s}": {"pp": 2, "schedule": s} for s in ("gpipe", "1f1b", "interleaved", "zb-h1")}}
TOL = 2e-2  # bf16 keeps 8 bits of mantissa: a few steps stay within 2% of the autocast reference
LEFT_TOL = 1e-2  # of a dropped model's bytes, what may stay allocated (nothing of it should)


def batches(cfg: ModelConfig, steps: int, batch: int, seq: int, device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(steps):
        tokens = torch.randint(0, cfg.vocab_size, (batch, seq + 1), generator=g)
        out.append((tokens[:, :-1].to(device), tokens[:, 1:].to(device)))
    return out


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
    optimizer = adamw(model.parameters())
    losses = []
    for x, y in data:
        with torch.autocast(device.type, dtype=torch.bfloat16):
            logits = model(x)
        loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def paratrain_losses(cfg: ModelConfig, data, layout: dict) -> list[float]:
    """The same steps through parallelize() on this process's share of the mesh (the trainer's step)."""
    from paratrain.train import train_step

    mesh = paratrain.init_mesh(dp=layout.get("dp"), tp=layout.get("tp", 1), pp=layout.get("pp", 1))
    schedule = layout.get("schedule", "1f1b")
    model, optimizer = paratrain.parallelize(
        model_on_meta(cfg), mesh, optimizer=adamw, precision="bf16",
        data=DataParallel(zero=layout.get("zero", 0), grad_reduction="sum"),
        # At tp = 1 the reference plan is applied anyway (degenerate layers): its code runs on the GPU too.
        tensor=TensorParallel(plan=LLAMA_TP_PLAN if layout.get("tp") == 1 else None,
                              sequence_parallel=layout.get("sp", False)),
        pipeline=PipelineParallel(schedule=schedule, virtual_stages=2 if schedule == "interleaved" else 1),
        init=functools.partial(model_on_meta(cfg).param_init, seed=0))
    dp, rank = mesh.size("dp"), mesh.coord("dp")
    losses = []
    for x, y in data:
        rows = x.shape[0] // dp
        x, y = x[rank * rows:(rank + 1) * rows], y[rank * rows:(rank + 1) * rows]
        micro = max(1, rows // (2 * mesh.size("pp"))) if mesh.size("pp") > 1 else rows
        pieces = [(x[i:i + micro], y[i:i + micro]) for i in range(0, rows, micro)]
        losses.append(train_step(model, optimizer, pieces, 1.0).loss)
    return losses


def relative_difference(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


def check_world1(device, steps: int) -> dict:
    data = batches(CHECK, steps, 8, 64, device)
    reference = reference_losses(CHECK, data, device)
    out = {}
    for name, layout in LAYOUTS_1.items():
        losses = paratrain_losses(CHECK, data, layout)
        out[name] = {"losses": losses, "rel_diff": relative_difference(losses, reference)}
    return {"reference": reference, "layouts": out}


def _world2_worker(job: dict) -> None:
    """Each of 2 processes (the elastic agent's): one layout over NCCL; rank 0 writes its losses."""
    from paratrain.distributed import shutdown

    data = batches(CHECK, job["steps"], 8, 64, torch.device("cuda", int(os.environ["LOCAL_RANK"])))
    losses = paratrain_losses(CHECK, data, job["layout"])
    if int(os.environ["RANK"]) == 0:
        Path(job["out"]).write_text(json.dumps(losses))
    shutdown()


def check_world2(device, steps: int) -> dict:
    from paratrain.launch import launch_processes

    reference = reference_losses(CHECK, batches(CHECK, steps, 8, 64, device), device)
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

    data = batches(CHECK, steps + 2, 8, 64, device)

    def build():
        return paratrain.parallelize(model_on_meta(CHECK), paratrain.init_mesh(),
                                     optimizer=functools.partial(adamw, fused=fused), precision="bf16",
                                     data=DataParallel(zero=3, grad_reduction="sum"),
                                     init=functools.partial(model_on_meta(CHECK).param_init, seed=0))

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

    out = {}
    for zero in range(4):
        meter = TensorMemory() if device.type == "cpu" else contextlib.nullcontext()
        with meter:
            def allocated() -> int:
                return torch.cuda.memory_allocated(device) if device.type == "cuda" else meter.total

            data = batches(CHECK, steps, 8, 64, device)  # made (and seen by the meter) before the count starts
            gc.collect()
            before = allocated()
            model, optimizer = paratrain.parallelize(
                model_on_meta(CHECK), paratrain.init_mesh(), optimizer=adamw, precision="bf16",
                data=DataParallel(zero=zero, grad_reduction="sum"),
                init=functools.partial(model_on_meta(CHECK).param_init, seed=0))
            for x, y in data:
                train_step(model, optimizer, [(x, y)], 1.0)
            built = allocated() - before
            del model, optimizer
            gc.collect()
            left = allocated() - before
        out[f"zero{zero}"] = {"built_bytes": built, "left_bytes": left, "freed": left <= LEFT_TOL * built}
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


def _eager_step(cfg: ModelConfig, x, y, device):
    """Plain PyTorch's step: fp32 weights, autocast bf16, fused AdamW on CUDA, global-norm clipping."""
    model = model_on_meta(cfg).to_empty(device=device)
    model.init_weights(0)
    optimizer = adamw(model.parameters(), fused=device.type == "cuda")

    def step():
        with torch.autocast(device.type, dtype=torch.bfloat16):
            logits = model(x)
        F.cross_entropy(logits.float().flatten(0, 1), y.flatten()).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


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


# -- the command ---------------------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="where to run (default cuda)")
    parser.add_argument("--size", default="1b", choices=list(SIZES), help="model of the throughput check (default 1b)")
    parser.add_argument("--steps", type=int, default=10, help="measured steps of the throughput check (default 10)")
    parser.add_argument("--check-steps", type=int, default=5, help="steps of each equivalence run (default 5)")
    parser.add_argument("--batch", type=int, default=4, help="sequences per throughput step (default 4)")
    parser.add_argument("--seq", type=int, default=2048, help="tokens per sequence (default 2048)")
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
    results["world1"] = check_world1(device, args.check_steps)
    results["checkpoint"] = check_checkpoint(device, args.check_steps)
    results["checkpoint_fused"] = check_checkpoint(device, args.check_steps, fused=True)
    results["release"] = check_release(device, args.check_steps)
    seq = min(args.seq, SIZES[args.size].max_seq_len)
    results["throughput"] = check_throughput(SIZES[args.size], device, args.batch, seq, 2, args.steps)
    if device.type == "cuda" and torch.cuda.device_count() >= 2:
        results["world2_nccl"] = check_world2(device, args.check_steps)
    else:
        results["world2_nccl"] = "skipped: fewer than 2 GPUs"
    write(results, Path(args.out))
    failed = [n for part in ("world1", "world2_nccl") if isinstance(results[part], dict)
              for n, r in results[part]["layouts"].items() if "error" in r or r["rel_diff"] > TOL]
    failed += [part for part in ("checkpoint", "checkpoint_fused") if not results[part]["bit_equal"]]
    failed += [f"release: {name}" for name, r in results["release"].items() if not r["freed"]]
    print(f"{'FAILED: ' + ', '.join(failed) if failed else 'all checks passed'}")
    return 1 if failed else 0


def write(results: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"gpu-check-{time.strftime('%Y%m%d-%H%M%S')}"
    stem.with_suffix(".json").write_text(json.dumps(results, indent=2) + "\n")
    lines = [f"# gpu_check {results['date']} on {results['device']} ({results['gpus']} GPU(s)), "
             f"torch {results['torch']}, CUDA {results['cuda']}", "", "| layout | rel loss diff vs one process |",
             "| --- | --- |"]
    for part in ("world1", "world2_nccl"):
        if isinstance(results[part], dict):
            for name, r in results[part]["layouts"].items():
                lines.append(f"| {part}: {name} | {r.get('error') or format(r['rel_diff'], '.2e')} |")
    fused = results["checkpoint_fused"]
    lines += ["", f"checkpoint resume bit-equal: {results['checkpoint']['bit_equal']}; with fused AdamW: "
              f"{fused['bit_equal']} (its step on {', '.join(fused['step_device'])})",
              "", "memory left after a bf16 model and its optimizer are dropped (gc.collect()):", "",
              "| ZeRO | bytes while alive | bytes left |", "| --- | --- | --- |"]
    lines += [f"| {name} | {r['built_bytes']:,} | {r['left_bytes']:,} |" for name, r in results["release"].items()]
    lines += [""]
    t = results["throughput"]
    lines += [f"throughput, {t['params']:,} parameters, batch {t['batch']} × {t['seq']}:", "",
              "| | step s min / median / max | tokens/s | MFU | max_memory_allocated |", "| --- | --- | --- | --- | --- |"]
    for who in ("pytorch_eager", "paratrain"):
        r = t[who]
        s = r["step_s"]
        mfu = "-" if r["mfu"] is None else f"{r['mfu']:.1%}"
        mem = "-" if r["max_memory_allocated"] is None else f"{r['max_memory_allocated'] / 2**30:.2f} GiB"
        lines.append(f"| {who} | {s['min']:.3f} / {s['median']:.3f} / {s['max']:.3f} | {r['tokens_per_s']:,.0f} | "
                     f"{mfu} | {mem} |")
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"written: {stem}.json, {stem}.md")


if __name__ == "__main__":
    sys.exit(main())
