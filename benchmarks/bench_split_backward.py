"""The split backward of zero-bubble schedules: B (input gradient) + W (weight gradients) against one full backward.

One process, one pipeline stage of the reference model (its middle blocks: the stage input
requires grad, as a received activation does). Per round, on the same forward: a full backward;
paratrain's B then W (`paratrain.parallel.pipeline.runner`); torch.distributed.pipelining's
stage_backward_input then stage_backward_weight. Times are min / median / max over rounds, and
the weight gradients of both splits are checked against the full backward's.

    python benchmarks/bench_split_backward.py [--rounds 20] [--dim 256] [--layers 4] [--seq 128]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

from paratrain.models import ModelConfig, Transformer
from paratrain.models.llama import rotary_tables
from paratrain.parallel.pipeline.split_backward import input_backward, weight_backward


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--rounds", type=int, default=20, help="timed rounds (after 3 warm-up rounds)")
    p.add_argument("--dim", type=int, default=256, help="model width")
    p.add_argument("--layers", type=int, default=4, help="blocks in the stage")
    p.add_argument("--seq", type=int, default=128, help="sequence length")
    p.add_argument("--micro-batch", type=int, default=4, help="sequences per micro-batch")
    p.add_argument("--threads", type=int, default=1, help="intra-op threads")
    p.add_argument("--out", default=str(Path(__file__).parent / "results"), help="results directory")
    return p.parse_args(argv)


class Stage(nn.Module):
    """Middle blocks of the reference model: activation in, activation out."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.layers = Transformer(cfg).layers

    def forward(self, h):
        cos, sin = rotary_tables(h.shape[1], self.config.head_dim, self.config.rope_theta, h.device, h.dtype)
        for layer in self.layers.values():
            h = layer(h, cos, sin)
        return h


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

    cfg = ModelConfig(vocab_size=512, dim=args.dim, n_layers=args.layers, n_heads=8, n_kv_heads=4,
                      ffn_dim=int(args.dim * 8 / 3) // 8 * 8, max_seq_len=args.seq)
    torch.manual_seed(0)
    stage = Stage(cfg)
    params = list(stage.parameters())
    g = torch.Generator().manual_seed(1)
    x = torch.randn(args.micro_batch, args.seq, args.dim, generator=g)
    grad = torch.randn(args.micro_batch, args.seq, args.dim, generator=g)

    def forward():
        inp = x.clone().requires_grad_()
        return inp, stage(inp)

    def full():
        inp, out = forward()
        return timed(lambda: torch.autograd.backward(out, grad)), inp

    def ours():
        inp, out = forward()
        work = []
        b = timed(lambda: work.append(input_backward(out, grad, inp, params)))
        w = timed(lambda: weight_backward(work[0]))
        return b, w, inp

    def theirs():
        inp, out = forward()
        groups = []
        b = timed(lambda: groups.append(stage_backward_input([out], [grad], [inp], iter(params))[1]))
        w = timed(lambda: stage_backward_weight(iter(params), groups[0]))
        return b, w, inp

    def grads():
        result = [p.grad.clone() for p in params]
        for p in params:
            p.grad = None
        return result

    times = {"full": [], "paratrain B": [], "paratrain W": [], "torch B": [], "torch W": []}
    worst = {"paratrain": 0.0, "torch": 0.0}
    for round_ in range(args.rounds + 3):
        t_full, inp_full = full()
        reference, ref_input = grads(), inp_full.grad
        b, w, inp = ours()
        mine = grads()
        tb, tw, inp_t = theirs()
        other = grads()
        for name, got, got_input in (("paratrain", mine, inp.grad), ("torch", other, inp_t.grad)):
            diff = max([(a - r).abs().max().item() for a, r in zip(got, reference)]
                       + [(got_input - ref_input).abs().max().item()])
            worst[name] = max(worst[name], diff)
        if round_ >= 3:
            for key, value in zip(times, (t_full, b, w, tb, tw)):
                times[key].append(value)
    full_med = statistics.median(times["full"])
    rows = []
    for key, values in times.items():
        rows.append((key, min(values), statistics.median(values), max(values)))
    split = {"paratrain": [b + w for b, w in zip(times["paratrain B"], times["paratrain W"])],
             "torch": [b + w for b, w in zip(times["torch B"], times["torch W"])]}
    now = datetime.datetime.now(datetime.timezone.utc)
    lines = [f"# Split backward (ZB-H1's B + W) against a full backward ({now.isoformat(timespec='seconds')})", "",
             f"Machine: {platform.platform()}, {os.cpu_count()} CPUs, torch {torch.__version__}, "
             f"{args.threads} thread(s); load average {os.getloadavg()[0]:.1f}. Stage: {args.layers} blocks of "
             f"dim {args.dim}, micro-batch {args.micro_batch} × seq {args.seq}; {args.rounds} rounds.", "",
             "| pass | min ms | median ms | max ms |", "|---|---|---|---|"]
    lines += [f"| {k} | {a * 1e3:.1f} | {m * 1e3:.1f} | {z * 1e3:.1f} |" for k, a, m, z in rows]
    lines += ["", "| split | B + W median / full median | max abs diff of gradients vs full |", "|---|---|---|"]
    lines += [f"| {name} | **{statistics.median(v) / full_med:.2f}** | {worst[name]:.1e} |" for name, v in split.items()]
    text = "\n".join(lines) + "\n"
    print(text)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"split-backward-{now:%Y%m%d-%H%M%S}"
    stem.with_suffix(".md").write_text(text)
    stem.with_suffix(".json").write_text(json.dumps({"args": vars(args), "times_s": times, "max_abs_diff": worst,
                                                     "ratio_median": {k: statistics.median(v) / full_med
                                                                      for k, v in split.items()}}, indent=1))
    print(f"wrote {stem}.md and {stem}.json", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
