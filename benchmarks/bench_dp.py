"""Data-parallel benchmark: paratrain's DDP / ZeRO-1/2/3 against PyTorch's own implementations.

    python benchmarks/bench_dp.py                       # defaults: ~3M-param Transformer, 2 and 4 ranks
    python benchmarks/bench_dp.py --steps 3 --warmup 1 --ranks 2 --variants ddp zero1

Pairs (paratrain variant <-> PyTorch counterpart):
    ddp    zero=0  <-> torch.nn.parallel.DistributedDataParallel
    zero1  zero=1  <-> ZeroRedundancyOptimizer(AdamW) + DistributedDataParallel
    zero2  zero=2  <-> FSDP2 fully_shard(reshard_after_forward=False)
    zero3  zero=3  <-> FSDP2 fully_shard(reshard_after_forward=True)
    hsdp   zero=3, --dp-shard world/2  <-> FSDP2 fully_shard on a (replicate 2, shard world/2) mesh (4+ ranks)

Every variant runs in its own `run_on_ranks` launch (fresh processes, one thread
per rank) on the same model, init, data and number of steps. See
benchmarks/README.md for what each column means and how bytes are counted.
"""

from __future__ import annotations

import datetime
import functools
import importlib.util
import inspect
import os
import statistics
import sys
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP

from common import (
    MB, add_common_args, adamw_factory, build_model, doc_parser, failure_notes, fmt, fmt_load, fmt_spread,
    global_batch, model_config, optimizer_tensors, proc_status_kb, ratio_cell, rss_start_note, run_meta, run_rounds,
    set_time_ratio, storage_bytes, warm_process, write_results,
)
from paratrain.mesh import MeshShape, build_mesh
from paratrain.peak_memory import reset_peak_rss
from paratrain.parallel.api import DataParallel, parallelize
from paratrain.ranks import RankError, run_on_ranks


@dataclass(frozen=True)
class Spec:
    """One benchmarked implementation: which framework and how it is configured."""

    pair: str  # ddp | zero1 | zero2 | zero3 | hsdp
    framework: str  # paratrain | pytorch
    label: str
    zero: int = 0  # paratrain's ZeRO stage
    torch_kind: str = ""  # ddp | zero_opt | fsdp2
    reshard: bool = False  # FSDP2 reshard_after_forward
    replicas: int = 1  # hybrid sharding: shards over world / replicas ranks, replicated `replicas` times

    def usable(self, world: int) -> bool:
        """Whether the variant means something on `world` ranks (hybrid: at least two ranks per shard group)."""
        return world % self.replicas == 0 and (self.replicas == 1 or world // self.replicas >= 2)

    def dp_shard(self, world: int) -> int:
        return world // self.replicas


PAIRS = {
    "ddp": (Spec("ddp", "paratrain", "paratrain DDP (zero=0)", zero=0),
            Spec("ddp", "pytorch", "torch DDP", torch_kind="ddp")),
    "zero1": (Spec("zero1", "paratrain", "paratrain ZeRO-1", zero=1),
              Spec("zero1", "pytorch", "torch ZeroRedundancyOptimizer+DDP", torch_kind="zero_opt")),
    "zero2": (Spec("zero2", "paratrain", "paratrain ZeRO-2", zero=2),
              Spec("zero2", "pytorch", "torch FSDP2 reshard_after_forward=False", torch_kind="fsdp2")),
    "zero3": (Spec("zero3", "paratrain", "paratrain ZeRO-3", zero=3),
              Spec("zero3", "pytorch", "torch FSDP2 reshard_after_forward=True", torch_kind="fsdp2", reshard=True)),
    # Hybrid sharding: ZeRO-3 within each half of the ranks, the halves replicas of each other (HSDP).
    "hsdp": (Spec("hsdp", "paratrain", "paratrain ZeRO-3 HSDP (2 replicas, --dp-shard world/2)", zero=3, replicas=2),
             Spec("hsdp", "pytorch", "torch FSDP2 on a (replicate 2, shard world/2) mesh", torch_kind="fsdp2",
                  reshard=True, replicas=2)),
}


# ---------------------------------------------------------------- per-rank pieces
class DistCounter:
    """Bytes this rank sends in torch.distributed's Python collectives, by paratrain.comm's ring formulas.

    Patches the `torch.distributed` attributes that PyTorch's implementations call
    at run time (FSDP2: all_gather_single / reduce_scatter_single; ZeroRedundancyOptimizer:
    broadcast). DDP's reducer calls the process group from C++ and is invisible
    here: `extra_per_step` adds its gradient all-reduce analytically.
    """

    # collective -> (position of the full-size tensor or tensor list in its signature, ring factor):
    # all-reduce of S bytes sends 2·S·(N−1)/N, all-gather / reduce-scatter of a full S sends S·(N−1)/N, and
    # a broadcast S·(N−1)/N (a pipelined broadcast has N−1 receivers of S; averaged over ranks — paratrain's
    # Comm counts the root's S instead, but paratrain broadcasts nothing during a step).
    RULES = {"all_reduce": (0, 2), "broadcast": (0, 1), "all_gather_single": (0, 1), "all_gather_into_tensor": (0, 1),
             "all_gather": (0, 1), "reduce_scatter_single": (1, 1), "reduce_scatter_tensor": (1, 1),
             "reduce_scatter": (1, 1)}

    def __init__(self, extra_per_step: float = 0.0):
        self.extra_per_step, self.bytes, self.counting, self._saved = extra_per_step, 0.0, False, {}

    def sent(self, original, index: int, factor: int, args, kwargs) -> float:
        bound = inspect.signature(original).bind(*args, **kwargs).arguments
        n = dist.get_world_size(bound.get("group"))
        full = list(bound.values())[index]
        nbytes = sum(t.numel() * t.element_size() for t in (full if isinstance(full, (list, tuple)) else [full]))
        return factor * nbytes * (n - 1) / n

    def install(self) -> None:
        for name, (index, factor) in self.RULES.items():
            original = self._saved[name] = getattr(dist, name)

            def wrapper(*args, _original=original, _rule=(index, factor), **kwargs):
                if self.counting:
                    self.bytes += self.sent(_original, *_rule, args, kwargs)
                return _original(*args, **kwargs)

            setattr(dist, name, functools.wraps(original)(wrapper))

    def uninstall(self) -> None:
        for name, original in self._saved.items():
            setattr(dist, name, original)

    def reset(self) -> None:
        self.bytes, self.counting = 0.0, True

    def read(self) -> float:
        self.counting = False
        return self.bytes + self.extra_per_step


@dataclass
class Runner:
    """What the training loop needs from one implementation."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    clip: object  # clip(max_norm)
    comm_reset: object
    comm_read: object  # -> bytes sent since reset
    state_bytes: object  # -> {"params":..., "grads":..., "optimizer":..., "total":...}
    close: object = lambda: None


def setup_paratrain(model, spec: Spec, world: int, args) -> Runner:
    mesh = build_mesh(MeshShape(dp=world, dp_shard=spec.dp_shard(world)))
    pmodel, opt = parallelize(model, mesh, optimizer=adamw_factory(args),
                              data=DataParallel(zero=spec.zero, bucket_mb=args.bucket_mb))
    engine = pmodel.engine

    def state_bytes():
        # Counted like PyTorch's side, by distinct storages (paratrain's resident_bytes() is kept for reference:
        # it adds views of one storage twice, e.g. DDP's param.grad, which is a view of its bucket).
        params = list(model.parameters()) + engine.masters()
        units = [u.full for u in getattr(engine, "units", [])]
        buckets = [t for b in getattr(engine, "buckets", []) for t in (b.buffer, b.shard_grad)]
        grads = [p.grad for p in params] + buckets
        moments = optimizer_tensors(opt)
        b = {"params": storage_bytes(params + units), "grads": storage_bytes(grads), "optimizer": storage_bytes(moments),
             "total": storage_bytes(params + units + grads + moments)}
        return {**b, "paratrain_resident_bytes": pmodel.resident_bytes(opt)["total"]}

    return Runner(pmodel, opt, pmodel.clip_grad_norm_, pmodel.comm.reset,
                  lambda: sum(pmodel.comm.bytes_by_axis().values()), state_bytes)


def blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules FSDP2 shards one by one before the root (paratrain's default ZeRO-3 units alike)."""
    return list(model.layers.values()) if hasattr(model, "layers") else list(model.children())


def setup_pytorch(model, spec: Spec, world: int, args) -> Runner:
    grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    ddp_allreduce = 2 * grad_bytes * (world - 1) / world  # every gradient, once per step, in fp32
    if spec.torch_kind in ("ddp", "zero_opt"):
        # gradient_as_bucket_view: gradients live in DDP's buckets, not in a second copy beside them.
        wrapped = DDP(model, gradient_as_bucket_view=True, bucket_cap_mb=args.bucket_mb)
        counter = DistCounter(extra_per_step=ddp_allreduce)
        opt = (ZeroRedundancyOptimizer(wrapped.parameters(), optimizer_class=torch.optim.AdamW, lr=args.lr,
                                       weight_decay=args.weight_decay) if spec.torch_kind == "zero_opt"
               else adamw_factory(args)(wrapped.parameters()))
    else:
        # A 2D (replicate, shard) mesh makes fully_shard hybrid: sharded on dim 1, replicated on dim 0.
        mesh = (init_device_mesh("cpu", (world,)) if spec.replicas == 1 else
                init_device_mesh("cpu", (spec.replicas, spec.dp_shard(world)), mesh_dim_names=("replicate", "shard")))
        for block in blocks(model):
            fully_shard(block, mesh=mesh, reshard_after_forward=spec.reshard)
        wrapped = fully_shard(model, mesh=mesh, reshard_after_forward=spec.reshard)
        opt, counter = adamw_factory(args)(wrapped.parameters()), DistCounter()
    counter.install()
    local_opt = getattr(opt, "optim", opt)  # ZeroRedundancyOptimizer keeps its shard's state in .optim

    def state_bytes():
        params = list(wrapped.parameters())
        grads, moments = [p.grad for p in params], optimizer_tensors(local_opt)
        b = {"params": storage_bytes(params), "grads": storage_bytes(grads), "optimizer": storage_bytes(moments)}
        return {**b, "total": storage_bytes(params + grads + moments)}

    clip = lambda max_norm: torch.nn.utils.clip_grad_norm_(wrapped.parameters(), max_norm)  # noqa: E731
    return Runner(wrapped, opt, clip, counter.reset, counter.read, state_bytes, counter.uninstall)


def bench_rank(rank: int, world: int, spec: Spec, args) -> dict:
    """One rank of one variant: warm-up + measured steps; timings, losses, comm and memory."""
    warm_process(args)
    reset_ok = reset_peak_rss()
    rss0, hwm0 = proc_status_kb("VmRSS"), proc_status_kb("VmHWM")
    model = build_model(model_config(args), args.seed)
    setup = setup_paratrain if spec.framework == "paratrain" else setup_pytorch
    run = setup(model, spec, world, args)
    times, losses, comm, state = [], [], [], None
    for step in range(args.warmup + args.steps):
        x, y = (t[rank * args.micro_batch:(rank + 1) * args.micro_batch] for t in global_batch(step, world, args))
        dist.barrier()
        run.comm_reset()
        t0 = time.perf_counter()
        loss = F.cross_entropy(run.model(x).flatten(0, 1).float(), y.flatten())
        loss.backward()
        if args.clip > 0:
            run.clip(args.clip)
        run.optimizer.step()
        elapsed = time.perf_counter() - t0
        sent = run.comm_read()
        if step >= args.warmup:
            times.append(elapsed)
            comm.append(sent)
        if step == args.warmup + args.steps - 1:
            state = run.state_bytes()  # after the last step, before gradients are released
        run.optimizer.zero_grad(set_to_none=True)
        total = loss.detach().clone()
        dist.all_reduce(total)  # the global mean loss (not counted: the counters are off)
        losses.append(total.item() / world)
    run.close()
    return {"times": times, "losses": losses, "comm": comm, "state": state, "rss0_kb": rss0,
            "hwm0_kb": hwm0, "hwm_kb": proc_status_kb("VmHWM"), "rss_end_kb": proc_status_kb("VmRSS"),
            "hwm_reset": reset_ok}


# ---------------------------------------------------------------- driver
def run_variant(spec: Spec, world: int, args) -> dict:
    """Launch one variant on `world` fresh ranks and reduce the per-rank results to one row."""
    row = {"pair": spec.pair, "variant": spec.label, "framework": spec.framework, "ranks": world}
    if spec.zero == 3 and spec.framework == "paratrain" and not importlib.util.find_spec("paratrain.parallel.data.zero3"):
        return {**row, "error": "not available (paratrain.parallel.data.zero3 does not exist)"}
    print(f"  {spec.label} on {world} ranks ...", file=sys.stderr, flush=True)
    try:
        results = run_on_ranks(bench_rank, world, spec, args, timeout=args.timeout)
    except RankError as exc:
        return {**row, "error": f"{type(exc).__name__}: {str(exc).splitlines()[0]}", "detail": str(exc)}
    r0 = results[0]
    step = statistics.median(r0["times"])
    return {**row, "step_s": step, "tokens_per_s": args.micro_batch * args.seq * world / step,
            "step_times_s": r0["times"], "losses": r0["losses"],
            "peak_rss_delta_mb": max((r["hwm_kb"] - r["rss0_kb"]) / 1024 for r in results),
            "rss_start_mb": max(r["rss0_kb"] for r in results) / 1024,
            "hwm_start_mb": max(r["hwm0_kb"] for r in results) / 1024,
            "rss_end_mb": max(r["rss_end_kb"] for r in results) / 1024,
            "hwm_reset": all(r["hwm_reset"] for r in results),
            "state_mb": max(r["state"]["total"] for r in results) / MB,
            "state_breakdown_mb": {k: max(r["state"][k] for r in results) / MB for k in results[0]["state"]},
            "comm_mb_per_step": max(statistics.mean(r["comm"]) for r in results) / MB}


def compare(rows: list[dict]) -> None:
    """Fill the paratrain rows' ratios against the PyTorch row of the same pair and world size.

    With several rounds the time ratio is the median of the rounds' ratios, each taken between the
    two sides of one round (run back to back, so under about the same load)."""
    by_key = {(r["pair"], r["ranks"], r["framework"]): r for r in rows}
    for r in rows:
        ref = by_key.get((r["pair"], r["ranks"], "pytorch"))
        if r["framework"] != "paratrain" or "error" in r or ref is None or "error" in ref:
            continue
        set_time_ratio(r, ref)
        r["state_ratio"] = r["state_mb"] / ref["state_mb"]
        r["rss_ratio"] = r["peak_rss_delta_mb"] / ref["peak_rss_delta_mb"] if ref["peak_rss_delta_mb"] > 0 else None
        r["loss_max_rel_diff"] = max(abs(a - b) / abs(b) for a, b in zip(r["losses"], ref["losses"]))
        r["final_loss"], r["ref_final_loss"] = r["losses"][-1], ref["losses"][-1]


def markdown(rows: list[dict], meta: dict) -> str:
    head = ["variant", "ranks", "step ms median (min–max)", "tokens/s", "peak RSS Δ MB/rank", "RSS end MB/rank",
            "model state MB/rank", "comm MB/rank/step", "time ratio", "state ratio", "RSS ratio",
            "loss max rel diff"]
    lines = [f"# Data-parallel benchmark, {meta['date']}", "",
             f"- machine: {meta['platform']}, {meta['cpu_count']} CPUs ({meta['cpu_model']}), torch {meta['torch']}",
             f"- command: `{meta['command']}`",
             f"- model: {meta['model']} — {meta['params']:,} parameters ({meta['params'] * 4 / MB:.1f} MB fp32)",
             f"- per rank: micro-batch {meta['micro_batch']} × seq {meta['seq']}; AdamW lr {meta['lr']}, "
             f"clip {meta['clip']}; {meta['warmup']} warm-up + {meta['steps']} measured steps; "
             f"{meta.get('rounds', 1)} round(s) per pair, the sides alternating which runs first (step ms: the "
             "median of the rounds' medians, min–max over every step)",
             "- ratios are paratrain / PyTorch counterpart (the row below it); ≤ 1.0 means paratrain is "
             "faster / smaller",
             "- timings come from a 2-core shared machine (ranks oversubscribe the cores, other jobs may run): "
             "they are noisy; model-state and comm bytes are exact. Load average (1, 5, 15 min) at start "
             f"{fmt_load(meta['load_avg_start'])}, at end {fmt_load(meta['load_avg_end'])}.", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['variant']} | {r['ranks']} | {r['error']} |" + " |" * (len(head) - 3))
            continue
        spread = fmt_spread(r, ".1f")
        cells = [r["variant"], str(r["ranks"]), spread, fmt(r["tokens_per_s"], ",.0f"),
                 fmt(r["peak_rss_delta_mb"], ".1f"), fmt(r["rss_end_mb"], ".0f"), fmt(r["state_mb"], ".2f"),
                 fmt(r["comm_mb_per_step"], ".2f"), ratio_cell(r), fmt(r.get("state_ratio"), ".2f"),
                 fmt(r.get("rss_ratio"), ".2f"), fmt(r.get("loss_max_rel_diff"), ".1e")]
        lines.append("| " + " | ".join(cells) + " |")
    ok = [r for r in rows if "error" not in r]
    if ok:
        lines += rss_start_note([r["rss_start_mb"] for r in ok], all(r["hwm_reset"] for r in ok),
                                "after imports and a warm-up step of a tiny model")
    lines += failure_notes(rows, lambda r: f"{r['variant']}, {r['ranks']} ranks")
    return "\n".join(lines) + "\n"


def parse_args(argv=None):
    p = doc_parser(__doc__)
    p.add_argument("--ranks", type=int, nargs="+", default=[2, 4], help="world sizes to run, one launch per variant each")
    p.add_argument("--variants", nargs="+", choices=list(PAIRS), default=list(PAIRS),
                   help="pairs to run (each runs its paratrain and its PyTorch side)")
    add_common_args(p, micro_batch_default=4, micro_batch_help="sequences per rank per step")
    p.add_argument("--rounds", type=int, default=1,
                   help="rounds per pair, the sides alternating which runs first; the time ratio is the median of "
                        "the rounds' ratios")
    p.add_argument("--bucket-mb", type=float, default=25.0,
                   help="paratrain's gradient bucket size (DDP, ZeRO-1/2); gloo's reduce-scatter and all-gather "
                        "allocate temporaries of about the bucket's size")
    p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"),
                   help="directory for dp-<time>.md and .json")
    args = p.parse_args(argv)
    if args.steps < 1 or args.warmup < 0 or min(args.ranks) < 1 or args.rounds < 1:
        p.error("--steps must be >= 1, --warmup >= 0, --ranks >= 1, --rounds >= 1")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    now = datetime.datetime.now()
    meta = run_meta(args, now)
    rows = []
    for world in args.ranks:
        for pair in args.variants:
            specs = [spec for spec in PAIRS[pair] if spec.usable(world)]
            rows.extend(run_rounds(specs, args.rounds, lambda spec: run_variant(spec, world, args)))
    meta["load_avg_end"] = os.getloadavg()
    compare(rows)
    text = markdown(rows, meta)
    print(text)
    write_results(args.out, "dp", now, text, {"meta": meta, "args": vars(args), "rows": rows})
    return 1 if any("error" in r and not r["error"].startswith("not available") for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
