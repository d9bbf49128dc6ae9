"""ZeRO-Offload's pieces and its step: the host's AdamW, the host link, and a step with and without offload.

    python benchmarks/bench_offload.py                        # the CPU: tiny model, 2 rounds
    python benchmarks/bench_offload.py --device cuda --model llama3.2-1b --model llama2-7b

Rows, each the median over --rounds (the spread shown):

- host AdamW: torch's fused CPU AdamW over --params fp32 parameters (the offloaded step's kernel), by intra-op
  thread count (1, 2, 4, ... up to this process's cores): seconds per billion parameters, and the memory
  traffic it reaches (28 bytes per parameter: the gradient read, the master and the two moments read and
  written). `paratrain.plan.hardware.Hardware.host_bytes_per_s` is this number for a node;
- host link (CUDA only): device to host and host to device copies of --copy-mb, pinned and pageable, GB/s
  (`Hardware.pcie_bytes_per_s` is the pinned one); on the CPU one host copy stands for it;
- step: `paratrain train`'s step (`parallelize` + `train_step`, bf16, fused AdamW, selective recomputation on
  CUDA) of each --model, one process, without and with `offload="optimizer"`: median step seconds, the time
  outside forward and backward, and the peak memory (CUDA: max_memory_allocated; CPU: the process's peak RSS,
  where offload saves nothing: the host is the device). The planner's prediction of both on `--hardware`
  stands beside them (`paratrain.plan.estimate`).

Writes benchmarks/results/offload-<time>.md and .json with the machine and its load.
"""

from __future__ import annotations

import datetime
import functools
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from common import doc_parser, fmt_load, machine, proc_status_kb, write_results

ADAMW_BYTES = 28  # per parameter: gradient read 4, master read+write 8, two moments read+write 16


def _median_spread(values: list[float]) -> tuple[float, float, float]:
    return statistics.median(values), min(values), max(values)


def bench_adamw(params: int, rounds: int) -> list[dict]:
    """Fused CPU AdamW over `params` fp32 elements (in 64 tensors), per thread count."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    counts = sorted({1, cores} | {2 ** k for k in range(1, 8) if 2 ** k < cores})
    tensors = [torch.nn.Parameter(torch.randn(params // 64)) for _ in range(64)]
    for t in tensors:
        t.grad = torch.randn_like(t)
    optimizer = torch.optim.AdamW(tensors, lr=1e-4, fused=True)
    before, rows = torch.get_num_threads(), []
    try:
        for threads in counts:
            torch.set_num_threads(threads)
            optimizer.step()  # warm: the state is allocated
            times = []
            for _ in range(rounds):
                start = time.perf_counter()
                optimizer.step()
                times.append(time.perf_counter() - start)
            median, low, high = _median_spread(times)
            n = sum(t.numel() for t in tensors)
            rows.append({"threads": threads, "seconds": times, "s_per_billion": median * 1e9 / n,
                         "gb_per_s": ADAMW_BYTES * n / median / 1e9, "spread": (low * 1e9 / n, high * 1e9 / n)})
            print(f"host AdamW, {threads} thread(s): {rows[-1]['s_per_billion']:.2f} s per billion parameters, "
                  f"{rows[-1]['gb_per_s']:.1f} GB/s", flush=True)
    finally:
        torch.set_num_threads(before)
    return rows


def bench_copies(device: torch.device, megabytes: float, rounds: int) -> list[dict]:
    """GB/s of copies between host and `device` (CUDA: each direction, pinned and pageable; CPU: a host copy)."""
    n = int(megabytes * 2**20 // 4)
    rows = []
    if device.type != "cuda":
        a, b = torch.empty(n), torch.randn(n)
        times = []
        for _ in range(rounds + 1):
            start = time.perf_counter()
            a.copy_(b)
            times.append(time.perf_counter() - start)
        median, _, _ = _median_spread(times[1:])
        rows.append({"copy": "host to host (the CPU's stand-in for the host link)", "gb_per_s": 4 * n / median / 1e9,
                     "seconds": times[1:]})
        return rows
    on_device = torch.randn(n, device=device)
    for pinned in (True, False):
        host = torch.empty(n, pin_memory=pinned)
        for name, dst, src in (("device to host", host, on_device), ("host to device", on_device, host)):
            times = []
            for _ in range(rounds + 1):
                torch.cuda.synchronize(device)
                start = time.perf_counter()
                dst.copy_(src, non_blocking=pinned)
                torch.cuda.synchronize(device)
                times.append(time.perf_counter() - start)
            median, _, _ = _median_spread(times[1:])
            rows.append({"copy": f"{name}, {'pinned' if pinned else 'pageable'}", "gb_per_s": 4 * n / median / 1e9,
                         "seconds": times[1:]})
    for r in rows:
        print(f"{r['copy']}: {r['gb_per_s']:.1f} GB/s", flush=True)
    return rows


def _reset_peak(device: torch.device) -> None:
    """The peak from now on: CUDA's allocator statistics; on the CPU VmHWM set to the current RSS (Linux)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass


def _peak(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return proc_status_kb("VmHWM") / 2**20


def bench_step(model_name: str, device: torch.device, offload: str | None, steps: int, batch: int,
               seq: int) -> dict:
    """Median step seconds (and outside forward/backward) of one process training `model_name`."""
    import paratrain
    from paratrain.models import Transformer, get_model_config
    from paratrain.train import StepTimer, train_step

    cfg = get_model_config(model_name)
    seq = min(seq, cfg.max_seq_len)
    with torch.device("meta"):
        model = Transformer(cfg)
    mesh = paratrain.init_mesh()  # its device: this process's GPU under CUDA, else the CPU
    _reset_peak(device)
    model, optimizer = paratrain.parallelize(
        model, mesh, optimizer=functools.partial(torch.optim.AdamW, lr=1e-4, fused=True), precision="bf16",
        data=paratrain.DataParallel(offload=offload), activation_checkpointing="selective" if device.type == "cuda" else 0,
        compile=device.type == "cuda", init=functools.partial(Transformer(cfg).param_init, seed=0))
    g = torch.Generator().manual_seed(0)
    totals, outside = [], []
    for step in range(steps + 1):
        tokens = torch.randint(0, cfg.vocab_size, (batch, seq + 1), generator=g).to(device)
        timer = StepTimer(model.comm)
        start = time.perf_counter()
        train_step(model, optimizer, [(tokens[:, :-1], tokens[:, 1:])], 1.0, timer=timer)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if step:  # the first compiles and allocates the optimizer's state
            totals.append(time.perf_counter() - start)
            outside.append(totals[-1] - timer.seconds["forward_backward"])
    row = {"model": model_name, "offload": offload or "none", "seconds": totals, "median_s": statistics.median(totals),
           "outside_s": statistics.median(outside), "peak_gib": _peak(device), "batch": batch, "seq": seq}
    del model, optimizer
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    return row


def predict(model_name: str, offload: str | None, hardware: str, batch: int, seq: int, compiled: bool) -> dict:
    from paratrain.models import get_model_config
    from paratrain.plan import HARDWARE_PRESETS, Layout, Workload, estimate

    cfg = get_model_config(model_name)
    workload = Workload.for_model(cfg, seq_len=min(seq, cfg.max_seq_len), global_batch=batch, precision="bf16")
    layout = Layout(micro_batch=batch, recompute="selective" if compiled else "none", compile=compiled, offload=offload)
    est = estimate(workload, layout, HARDWARE_PRESETS[hardware])
    return {"predicted_s": est.time.total, "predicted_optimizer_s": est.time.optimizer,
            "predicted_gib": est.memory.total / 2**30}


def main(argv: list[str] | None = None) -> int:
    parser = doc_parser(__doc__)
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--model", action="append", help="a preset model to step (repeatable; default: tiny on the "
                                                        "CPU, llama3.2-1b on CUDA)")
    parser.add_argument("--params", type=int, default=2**26, help="parameters of the host AdamW rows")
    parser.add_argument("--copy-mb", type=float, default=256, help="size of each host link copy")
    parser.add_argument("--steps", type=int, default=4, help="measured steps of each step row")
    parser.add_argument("--batch", type=int, default=2, help="sequences per step")
    parser.add_argument("--seq", type=int, default=2048, help="sequence length (at most the model's)")
    parser.add_argument("--rounds", type=int, default=3, help="repeats of the AdamW and copy rows")
    parser.add_argument("--hardware", default=None, help="planner preset for the predictions (default: h100-80gb "
                                                         "on CUDA, none on the CPU)")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"), help="results directory")
    args = parser.parse_args(argv)
    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    models = args.model or (["llama3.2-1b"] if device.type == "cuda" else ["tiny"])
    hardware = args.hardware or ("h100-80gb" if device.type == "cuda" else None)
    now = datetime.datetime.now()
    meta = {"date": now.isoformat(timespec="seconds"), "machine": machine(), "load_avg_start": os.getloadavg(),
            "args": vars(args), "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"}
    adamw = bench_adamw(args.params, args.rounds)
    copies = bench_copies(device, args.copy_mb, args.rounds)
    steps = []
    for name in models:
        for offload in (None, "optimizer"):
            row = bench_step(name, device, offload, args.steps, args.batch, args.seq)
            if hardware:
                row.update(predict(name, offload, hardware, args.batch, args.seq, device.type == "cuda"))
            steps.append(row)
            print(f"{name} offload {row['offload']}: {row['median_s']:.3f} s per step "
                  f"({row['outside_s']:.3f} s outside forward/backward), peak {row['peak_gib']:.2f} GiB", flush=True)
    meta["load_avg_end"] = os.getloadavg()
    m = meta["machine"]
    lines = [f"# paratrain offload, {meta['date']}", "",
             f"{meta['device']}; {m['cpu_model']}, {m['cpu_count']} cores, torch {m['torch']}; load average "
             f"{fmt_load(meta['load_avg_start'])} at the start, {fmt_load(meta['load_avg_end'])} at the end.", "",
             f"## Host AdamW (fused, {64 * (args.params // 64):,} fp32 parameters)", "",
             "| threads | s per billion parameters (min-max) | GB/s of traffic |", "| --- | --- | --- |"]
    lines += [f"| {r['threads']} | {r['s_per_billion']:.2f} ({r['spread'][0]:.2f}-{r['spread'][1]:.2f}) | "
              f"{r['gb_per_s']:.1f} |" for r in adamw]
    lines += ["", "## Host link", "", "| copy | GB/s |", "| --- | --- |"]
    lines += [f"| {r['copy']} | {r['gb_per_s']:.1f} |" for r in copies]
    lines += ["", "## Step", "", "| model | offload | s per step (each) | outside fwd/bwd s | peak GiB | planner s | "
              "planner GiB |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in steps:
        planned = (f"{r['predicted_s']:.3f} | {r['predicted_gib']:.2f}" if "predicted_s" in r else "- | -")
        lines.append(f"| {r['model']} | {r['offload']} | {r['median_s']:.3f} ({', '.join(f'{s:.3f}' for s in r['seconds'])})"
                     f" | {r['outside_s']:.3f} | {r['peak_gib']:.2f} | {planned} |")
    text = "\n".join(lines) + "\n"
    print(text)
    write_results(args.out, "offload", now, text, {"meta": meta, "adamw": adamw, "copies": copies, "steps": steps})
    return 0


if __name__ == "__main__":
    sys.exit(main())
