"""The transformers backend's step against the reference model's: the same Llama shapes, one process, eager, fp32.

    python benchmarks/bench_hf_backend.py [--steps 30] [--dim 256 --layers 4 ...]

`paratrain train --backend transformers` trains transformers' own `LlamaForCausalLM` (`paratrain.models.hf`);
the default for a llama directory is paratrain's reference `Transformer`. Both are built here from one
config.json, loaded with the same weights, parallelized at world 1 and stepped in turn on the same batches
(AdamW, clipping, the trainer's `train_step`), the order alternating, so that each step of one has a step of
the other beside it under the same load. Reported: each side's median step and the median of the per-step
ratios (transformers ÷ reference) with their quartiles. Target: within 1.10×.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import fmt_load, machine, write_results  # noqa: E402


def _setup(directory: str, backend: str):
    from paratrain import DataParallel, init_mesh, parallelize
    from paratrain.models import Transformer
    from paratrain.interop.hf_weights import weight_initializer
    from paratrain.models.hf import HFCausalLM, read_model_dir

    if backend == "transformers":
        model = HFCausalLM.build(read_model_dir(directory))
        init = weight_initializer(model, directory, seed=0)
    else:
        from paratrain.interop.hf import HFWeights

        weights = HFWeights(directory)
        with torch.device("meta"):
            model = Transformer(weights.config)
        init = lambda name, shape: weights.read(name).float()  # noqa: E731
    return parallelize(model, init_mesh(), optimizer=functools.partial(torch.optim.AdamW, lr=1e-4),
                       data=DataParallel(grad_reduction="sum"), init=init)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=30, help="measured steps per side (after 3 warm-up steps)")
    parser.add_argument("--dim", type=int, default=256, help="hidden size")
    parser.add_argument("--layers", type=int, default=4, help="decoder layers")
    parser.add_argument("--heads", type=int, default=8, help="query heads")
    parser.add_argument("--kv-heads", type=int, default=4, help="key/value heads")
    parser.add_argument("--ffn", type=int, default=688, help="feed-forward width")
    parser.add_argument("--vocab", type=int, default=512, help="vocabulary")
    parser.add_argument("--seq", type=int, default=256, help="sequence length")
    parser.add_argument("--batch", type=int, default=8, help="sequences per step")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"), help="results directory")
    args = parser.parse_args()
    import transformers

    from paratrain.train import train_step

    now, load = datetime.datetime.now(datetime.timezone.utc), os.getloadavg()
    directory = tempfile.mkdtemp(prefix="bench-hf-")
    config = transformers.LlamaConfig(vocab_size=args.vocab, hidden_size=args.dim, intermediate_size=args.ffn,
                                      num_hidden_layers=args.layers, num_attention_heads=args.heads,
                                      num_key_value_heads=args.kv_heads, max_position_embeddings=args.seq,
                                      tie_word_embeddings=False)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(directory)
    sides = {name: _setup(directory, name) for name in ("reference", "transformers")}
    g = torch.Generator().manual_seed(0)
    times: dict[str, list[float]] = {name: [] for name in sides}
    for step in range(args.steps + 3):
        x = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=g)
        order = list(sides) if step % 2 else list(sides)[::-1]
        for name in order:
            model, optimizer = sides[name]
            start = time.perf_counter()
            train_step(model, optimizer, [(x[:, :-1], x[:, 1:])], 1.0)
            if step >= 3:
                times[name].append(time.perf_counter() - start)
    ratios = [t / r for t, r in zip(times["transformers"], times["reference"])]
    q = statistics.quantiles(ratios, n=4)
    median = {name: statistics.median(values) for name, values in times.items()}
    text = (f"# transformers backend vs reference model (CPU, fp32, eager)\n\n{now:%Y-%m-%d %H:%M} UTC, "
            f"{machine()['cpu_model']} ({os.cpu_count()} CPUs), load {fmt_load(load)} at start, torch "
            f"{torch.__version__}, transformers {transformers.__version__}\n\nLlama dim {args.dim}, {args.layers} "
            f"layers, {args.heads}/{args.kv_heads} heads, ffn {args.ffn}, vocab {args.vocab}; batch {args.batch} × "
            f"{args.seq}; {args.steps} steps each, alternating\n\n| side | median step ms |\n|---|---|\n"
            + "".join(f"| {name} | {median[name] * 1e3:.1f} |\n" for name in sides)
            + f"\nratio transformers ÷ reference: median {statistics.median(ratios):.3f} (quartiles {q[0]:.3f}–"
              f"{q[2]:.3f}); target ≤ 1.10\n")
    print(text)
    write_results(args.out, "hf-backend", now, text,
                  {"args": vars(args), "machine": machine(), "load": load, "step_times_s": times, "ratios": ratios})


if __name__ == "__main__":
    main()
