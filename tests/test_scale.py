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
from paratrain.interop.export import export_hf
from paratrain.peak_memory import return_freed_memory
from paratrain.testing import run_on_ranks
from parallel_cases import vm_bytes

WORLD = 8


def big_config(out) -> Config:
    cfg = Config()
    m = cfg.model
    m.vocab_size, m.n_layers, m.dim, m.n_heads, m.n_kv_heads, m.ffn_dim = 512, 8, 512, 8, 8, 1536
    cfg.data.seq_len = 32
    cfg.parallel.zero = 3
    t = cfg.train
    t.steps, t.global_batch, t.micro_batch, t.warmup_steps = 3, WORLD, 1, 1
    t.eval_every, t.eval_batches, t.sample_tokens = 0, 1, 8
    t.peak_flops = 1e12
    cfg.run.out, cfg.run.progress = str(out), False
    return cfg


def full_fp32_bytes() -> int:
    with torch.device("meta"):
        from paratrain.models import Transformer
        return 4 * Transformer(big_config("unused").model).num_params()


# What a rank may use above its footprint before training (interpreter, torch, the process group):
# less than the whole fp32 model, which ZeRO-3 over 8 ranks never needs (its state is 16Ψ/8 = half of 4Ψ).
CAP_BYTES = int(0.9 * full_fp32_bytes())


def _train(rank, world, out):
    from paratrain.train import train

    return_freed_memory()
    start = vm_bytes("VmRSS")
    result = train(big_config(out))
    return result.peak_mem_bytes - start, result.sample


def test_zero3_trains_a_model_whose_fp32_weights_exceed_a_ranks_cap(tmp_path):
    results = run_on_ranks(_train, WORLD, str(tmp_path / "run"), timeout=600)
    for rise, _ in results:
        assert rise < CAP_BYTES, (f"peak RSS {rise / 2**20:.0f} MiB above start ≥ cap {CAP_BYTES / 2**20:.0f} MiB "
                                  f"(whole fp32 model {full_fp32_bytes() / 2**20:.0f} MiB)")
    assert results[0][1]  # the text sample
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(metrics) == 3 and all(torch.isfinite(torch.tensor(r["loss"])) for r in metrics)
    weights = tmp_path / "run" / "final" / "model.safetensors"
    with safe_open(str(weights), framework="pt") as f:
        stored = sum(torch.Size(f.get_slice(k).get_shape()).numel() for k in f.keys())
    assert 4 * stored == full_fp32_bytes()
    exported = export_hf(tmp_path / "run", tmp_path / "hf", dtype=torch.bfloat16)
    assert os.path.getsize(tmp_path / "hf" / exported.files[0]) > 2 * stored
    print(f"whole fp32 model {full_fp32_bytes() / 2**20:.0f} MiB, cap {CAP_BYTES / 2**20:.0f} MiB; "
          f"per-rank peak RSS above start (MiB): {[round(r / 2**20) for r, _ in results]}")
