"""ZeRO-3 trains, through the trainer, a model whose full fp32 parameters exceed what one rank may use.

8 ranks, the model built on the meta device and materialized shard by shard; the run ends as every
run does (text sample, final weights) and is exported to Hugging Face. Each rank measures its own
peak resident set over the whole run (every step, the build before and the end after), with freed
memory returned to the system at once (MALLOC_MMAP_THRESHOLD_), so a transient whole-model tensor
anywhere would show.
"""

import json
import os

import torch
from safetensors import safe_open

from paratrain.config import Config
from paratrain.run.build import resolve_model_config
from paratrain.run.export import export_hf
from paratrain.peak_memory import proc_status_bytes, return_freed_memory
from paratrain.testing import run_on_ranks

WORLD = 8


def big_config(out, corpus: str = "default") -> Config:
    cfg = Config()
    cfg.data.path = corpus
    m = cfg.model
    # Many small blocks: ZeRO-3 holds a few units at a time beside its 16Ψ/8, so small units leave room (measured
    # under the cap, a model of this size: 6 MiB with 16 blocks, 14 with 24, 18 with 32). Each unit costs its
    # gathers (a broadcast per rank on gloo) whatever its size: no more blocks than that room needs.
    m.vocab_size, m.n_layers, m.dim, m.n_heads, m.n_kv_heads, m.ffn_dim = 512, 24, 384, 6, 6, 1024
    cfg.data.seq_len = 32
    cfg.parallel.zero = 3
    cfg.parallel.activation_checkpointing = 1  # as a model too large for one rank is trained
    t = cfg.train
    t.steps, t.global_batch, t.micro_batch, t.warmup_steps = 2, WORLD, 1, 1
    # Two sampled tokens: the sample runs forward on the sharded model (what the peak must cover) and feeds
    # back what it sampled; each further token is one more forward over all 24 units.
    t.eval_every, t.eval_batches, t.sample_tokens = 0, 1, 2
    t.peak_flops = 1e12
    cfg.run.out, cfg.run.progress = str(out), False
    return cfg


def full_fp32_bytes() -> int:
    return 4 * resolve_model_config(big_config("unused"), tokenizer_vocab=0).num_params()


# What a rank may use above its footprint before training (interpreter, torch, the process group):
# less than the whole fp32 model, which ZeRO-3 over 8 ranks never needs (its state is 16Ψ/8 = half of 4Ψ).
CAP_BYTES = int(0.9 * full_fp32_bytes())


def _warm_up(rank, world) -> None:
    """Run every kernel of a training step once on a tiny model, and the collectives: the code pages they
    bring into memory (hundreds of MiB of libtorch) are the interpreter's, not training memory."""
    import torch.distributed as dist
    import torch.nn.functional as F
    from paratrain.models import ModelConfig, Transformer

    tiny = Transformer(ModelConfig(vocab_size=512, dim=32, n_layers=1, n_heads=4, n_kv_heads=4, ffn_dim=64,
                                   max_seq_len=32))
    opt = torch.optim.AdamW(tiny.parameters())
    tokens = torch.randint(0, 512, (1, 33))
    F.cross_entropy(tiny(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten()).backward()
    opt.step()
    x = torch.ones(world * 8)
    dist.all_reduce(x)
    dist.all_gather_into_tensor(x, x[:8])
    dist.reduce_scatter_tensor(x[:8], x)


def _train(rank, world, out, corpus):
    from paratrain.train import train

    return_freed_memory()
    _warm_up(rank, world)
    start = proc_status_bytes("VmRSS")
    result = train(big_config(out, corpus))
    return result.peak_mem_bytes - start, result.sample


def test_zero3_trains_a_model_whose_fp32_weights_exceed_a_ranks_cap(tmp_path):
    corpus = tmp_path / "corpus.txt"  # a small corpus: its tokens are held by every rank
    corpus.write_text("".join(f"line {i}: the quick brown fox jumps over the lazy dog.\n" for i in range(4000)))
    results = run_on_ranks(_train, WORLD, str(tmp_path / "run"), str(corpus), timeout=600)
    for rise, _ in results:
        assert rise < CAP_BYTES, (f"peak RSS {rise / 2**20:.0f} MiB above start ≥ cap {CAP_BYTES / 2**20:.0f} MiB "
                                  f"(whole fp32 model {full_fp32_bytes() / 2**20:.0f} MiB)")
    assert results[0][1]  # the text sample
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(metrics) == 2 and all(torch.isfinite(torch.tensor(r["loss"])) for r in metrics)
    weights = tmp_path / "run" / "final" / "model.safetensors"
    with safe_open(str(weights), framework="pt") as f:
        stored = sum(torch.Size(f.get_slice(k).get_shape()).numel() for k in f.keys())
    assert 4 * stored == full_fp32_bytes()
    exported = export_hf(tmp_path / "run", tmp_path / "hf", dtype=torch.bfloat16)
    assert exported.weight_files == ("model.safetensors",) and (tmp_path / "hf" / "config.json").is_file()
    assert os.path.getsize(tmp_path / "hf" / "model.safetensors") > 2 * stored  # bf16, every parameter
    print(f"whole fp32 model {full_fp32_bytes() / 2**20:.0f} MiB, cap {CAP_BYTES / 2**20:.0f} MiB; "
          f"per-rank peak RSS above start (MiB): {[round(r / 2**20) for r, _ in results]}")
