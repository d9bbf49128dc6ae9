"""Context-parallel benchmark: paratrain's ring attention at cp 1/2/4 against one process and torch's context parallel.

    python benchmarks/bench_cp.py                          # defaults: a 2-layer model, seq 2048, cp 2 and 4
    python benchmarks/bench_cp.py --steps 2 --warmup 1 --cp 2

Rows (each its own `run_on_ranks` launch on CPU gloo ranks, the same model, init and batches):
    single        one process, the whole sequence: the reference the losses are checked against
    paratrain cpN `parallelize` on `MeshShape(cp=N)`: each rank holds 2 of the 2·N load-balanced chunks,
                  causal SDPA answered by paratrain's ring (`paratrain.parallel.context`)
    torch cpN     `torch.distributed.tensor.experimental.context_parallel` on a 1-D device mesh of N ranks
                  (the tokens, labels and positions sharded by its head-tail load balancer), gradients
                  averaged over the ranks by hand; where it cannot run on this torch and the CPU, the row
                  says why in one line

Per row: step time (rank 0, median), the bytes a forward leaves alive for backward per rank
(`paratrain.peak_memory.TensorMemory`: the peak of activation memory, logits included), the K/V
bytes each rank sends on the cp axis per step against the ring's formula (paratrain rows:
layers × [(cp − 1)·KV + (cp − 1)·KV + cp·dKV], KV = 2·B·H·(s/cp)·E·4 bytes in fp32, dKV the same;
H the query heads, because the reference model repeats K/V to them before SDPA on the CPU), and
the largest relative difference of the losses from one process's. See benchmarks/README.md.
"""

from __future__ import annotations

import datetime
import os
import statistics
import sys
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from common import (
    MB, adamw_factory, add_common_args, build_model, doc_parser, failed_row, fmt, fmt_load, fmt_spread, model_config,
    run_meta, write_results,
)
from paratrain.mesh import MeshShape, build_mesh
from paratrain.parallel.api import parallelize
from paratrain.peak_memory import kept_by_forward
from paratrain.ranks import RankError, run_on_ranks


@dataclass(frozen=True)
class Spec:
    """One row: which framework and how many cp ranks."""

    framework: str  # single | paratrain | torch
    cp: int = 1

    @property
    def label(self) -> str:
        return "one process (reference)" if self.framework == "single" else f"{self.framework} cp{self.cp}"


def batch(step: int, args) -> tuple[torch.Tensor, torch.Tensor]:
    """Step `step`'s sequences (micro_batch × seq), the same for every row and every rank."""
    g = torch.Generator().manual_seed(args.seed * 100003 + step)
    shape = (args.micro_batch, args.seq)
    return torch.randint(0, args.vocab, shape, generator=g), torch.randint(0, args.vocab, shape, generator=g)


# ---------------------------------------------------------------- the three implementations
class Single:
    """One process: mean cross-entropy over the whole sequences."""

    def __init__(self, args, world: int):
        self.model = build_model(model_config(args), args.seed)
        self.optimizer = adamw_factory(args)(self.model.parameters())

    def forward(self, x, y):
        return F.cross_entropy(self.model(x).flatten(0, 1), y.flatten())

    def finish(self, args) -> None:
        if args.clip > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), args.clip)

    def kv_bytes(self) -> int | None:
        return None


class Paratrain(Single):
    """`parallelize` on a cp mesh: the model takes whole sequences, its loss splits the labels alike."""

    def __init__(self, args, world: int):
        mesh = build_mesh(MeshShape(cp=world))
        self.model, self.optimizer = parallelize(build_model(model_config(args), args.seed), mesh,
                                                 optimizer=adamw_factory(args))
        self.world = world

    def forward(self, x, y):
        self.model.comm.reset()
        # the engine averages gradients over the cp ranks: each backs a token sum over the whole count × cp
        local = self.model.loss_fn(self.model(x), y)
        return local / y.numel() * self.world

    def finish(self, args) -> None:
        if args.clip > 0:
            self.model.clip_grad_norm_(args.clip)

    def kv_bytes(self) -> int:
        return self.model.comm.bytes_by_axis().get("cp", 0)


class TorchCP(Single):
    """torch's experimental context parallel: SDPA patched inside its context, buffers sharded in place."""

    def __init__(self, args, world: int):
        from torch.distributed.device_mesh import init_device_mesh

        super().__init__(args, world)
        self.mesh, self.world = init_device_mesh("cpu", (world,)), world

    def forward(self, x, y):
        from torch.distributed.tensor.experimental import context_parallel

        x, y, positions = x.clone(), y.clone(), torch.arange(x.shape[1])
        with context_parallel(self.mesh, buffers=[x, y, positions], buffer_seq_dims=[1, 1, 0],
                              no_restore_buffers={x, y, positions}):
            loss = F.cross_entropy(self.model(x, positions=positions).flatten(0, 1), y.flatten())
            loss.backward()
        return loss.detach()

    def finish(self, args) -> None:
        for p in self.model.parameters():  # each rank's mean over its equal share of the tokens: average them
            dist.all_reduce(p.grad)
            p.grad.div_(self.world)
        super().finish(args)


IMPLEMENTATIONS = {"single": Single, "paratrain": Paratrain, "torch": TorchCP}


# ---------------------------------------------------------------- one rank
def step(run: Single, x, y, args) -> float:
    """One training step; the global mean loss."""
    loss = run.forward(x, y)
    if loss.requires_grad:
        loss.backward()
    run.finish(args)
    run.optimizer.step()
    run.optimizer.zero_grad(set_to_none=True)
    value = loss.detach().clone()
    if dist.is_initialized() and dist.get_world_size() > 1:  # each rank's share × cp (paratrain) or its mean (torch)
        dist.all_reduce(value)
        value /= dist.get_world_size()
    return value.item()


def activation_bytes(run: Single, x) -> int:
    """Bytes a forward leaves alive (what backward reads, and the logits); the fewest of two forwards."""
    def forward():
        if not isinstance(run, TorchCP):
            return run.model(x)
        from torch.distributed.tensor.experimental import context_parallel

        xs, pos = x.clone(), torch.arange(x.shape[1])
        with context_parallel(run.mesh, buffers=[xs, pos], buffer_seq_dims=[1, 0]):
            return run.model(xs, positions=pos)

    return kept_by_forward(run.model, forward, repeats=3)


def bench_rank(rank: int, world: int, spec: Spec, args) -> dict:
    run = IMPLEMENTATIONS[spec.framework](args, world)
    times, losses, kv = [], [], []
    for i in range(args.warmup + args.steps):
        x, y = batch(i, args)
        if world > 1:
            dist.barrier()
        t0 = time.perf_counter()
        losses.append(step(run, x, y, args))
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
            kv.append(run.kv_bytes())
    return {"times": times, "losses": losses, "kv": kv, "activations": activation_bytes(run, batch(0, args)[0])}


# ---------------------------------------------------------------- driver
def kv_formula(args, cp: int) -> int:
    """The ring's K/V bytes per rank per step (fp32): layers × [(cp−1)·KV + (cp−1)·KV + cp·dKV]; none at cp 1,
    where attention is the model's own SDPA call and no ring runs."""
    if cp == 1:
        return 0
    block = 2 * args.micro_batch * args.heads * (args.seq // cp) * (args.dim // args.heads) * 4
    return args.layers * ((cp - 1) * block + (cp - 1) * block + cp * block)


def run_row(spec: Spec, args) -> dict:
    row = {"label": spec.label, "framework": spec.framework, "cp": spec.cp}
    print(f"  {spec.label} ...", file=sys.stderr, flush=True)
    try:
        results = run_on_ranks(bench_rank, spec.cp, spec, args, timeout=args.timeout)
    except RankError as exc:
        return failed_row(row, exc)
    r0 = results[0]
    row.update(step_s=statistics.median(r0["times"]), step_times_s=r0["times"], losses=r0["losses"],
               activations_mb=max(r["activations"] for r in results) / MB)
    if spec.framework == "paratrain":
        row.update(kv_bytes=max(max(r["kv"]) for r in results), kv_formula=kv_formula(args, spec.cp))
    return row


def compare(rows: list[dict]) -> None:
    """Losses against one process's; time and activation ratios to it and, for torch rows, paratrain ÷ torch."""
    ok = [r for r in rows if "error" not in r]
    single = next((r for r in ok if r["framework"] == "single"), None)
    for r in ok:
        if single is not None:
            r["loss_max_rel_diff"] = max(abs(a - b) / abs(b) for a, b in zip(r["losses"], single["losses"]))
            r["activation_ratio"] = r["activations_mb"] / single["activations_mb"]
        ours = next((p for p in ok if p["framework"] == "paratrain" and p["cp"] == r["cp"]), None)
        if r["framework"] == "torch" and ours is not None:
            r["time_ratio"] = ours["step_s"] / r["step_s"]


def markdown(rows: list[dict], meta: dict) -> str:
    head = ["row", "ranks", "step ms median (min–max)", "activations MB/rank", "÷ one process's",
            "K/V bytes/rank/step (cp axis)", "formula", "paratrain ÷ torch time", "loss max rel diff"]
    lines = [f"# Context-parallel benchmark, {meta['date']}", "",
             f"- machine: {meta['platform']}, {meta['cpu_count']} CPUs ({meta['cpu_model']}), torch {meta['torch']}",
             f"- command: `{meta['command']}`",
             f"- model: {meta['model']} — {meta['params']:,} parameters",
             f"- batch: {meta['micro_batch']} × seq {meta['seq']}, the same sequences on every cp rank; fp32; AdamW "
             f"lr {meta['lr']}, clip {meta['clip']}; {meta['warmup']} warm-up + {meta['steps']} measured steps",
             "- activations: the bytes a forward leaves alive for backward on a rank (TensorMemory), max over ranks",
             "- timings come from a 2-core shared machine and 4 ranks oversubscribe it: noisy. Load average (1, 5, "
             f"15 min) at start {fmt_load(meta['load_avg_start'])}, at end {fmt_load(meta['load_avg_end'])}.", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['label']} | {r['cp']} | did not run: {r['error']} |" + " |" * (len(head) - 3))
            continue
        spread = fmt_spread(r, ".0f")
        kv = f"{r['kv_bytes']:,}" if "kv_bytes" in r else "-"
        formula = (f"{r['kv_formula']:,} ({'equal' if r['kv_bytes'] == r['kv_formula'] else 'DIFFERS'})"
                   if "kv_formula" in r else "-")
        cells = [r["label"], str(r["cp"]), spread, fmt(r["activations_mb"], ".2f"),
                 fmt(r.get("activation_ratio"), ".3f"), kv, formula, fmt(r.get("time_ratio"), ".2f"),
                 fmt(r.get("loss_max_rel_diff"), ".1e")]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def parse_args(argv=None):
    p = doc_parser(__doc__)
    p.add_argument("--cp", type=int, nargs="+", default=[2, 4], help="cp degrees to run (one launch each)")
    p.add_argument("--no-torch", action="store_true", help="skip torch's context parallel rows")
    add_common_args(p, micro_batch_default=1, micro_batch_help="sequences per step (every cp rank sees them all)")
    p.set_defaults(dim=128, layers=2, heads=4, kv_heads=4, ffn=256, vocab=256, seq=2048, steps=5, warmup=1)
    p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"),
                   help="directory for cp-<time>.md and .json")
    args = p.parse_args(argv)
    if any(args.seq % (2 * cp) for cp in args.cp) or args.steps < 1:
        p.error("--seq must be divisible by 2 × every --cp, --steps >= 1")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    now = datetime.datetime.now()
    meta = run_meta(args, now)
    specs = [Spec("single")] + [Spec(fw, cp) for cp in args.cp for fw in ("paratrain", "torch")
                                if fw == "paratrain" or not args.no_torch]
    rows = [run_row(spec, args) for spec in specs]
    compare(rows)
    meta["load_avg_end"] = os.getloadavg()
    text = markdown(rows, meta)
    print(text)
    write_results(args.out, "cp", now, text, {"meta": meta, "rows": rows})
    broken = [r for r in rows if "error" in r and r["framework"] != "torch"]
    return 1 if broken else 0


if __name__ == "__main__":
    sys.exit(main())
