"""Loading a transformers model under ZeRO-3 never holds the whole model: each of 2 ranks builds it on the meta
device and materializes only its shards, reading the directory's safetensors one tensor at a time with plain file
reads (no memory map). Measured: the growth of each rank's peak resident memory (VmHWM) over the load, against
the model's fp32 bytes; the same load without sharding (ZeRO-0) is measured beside it, so the meter is seen to
count a whole model where one is held."""

from __future__ import annotations

import gc
import tempfile
from pathlib import Path

import pytest
import torch

from paratrain import DataParallel, init_mesh, parallelize
from paratrain.interop.hf_weights import weight_initializer
from paratrain.models.hf import HFCausalLM, read_model_dir
from paratrain.peak_memory import proc_status_bytes, reset_peak_rss, return_freed_memory
from paratrain.testing import run_on_ranks


def _save(directory: Path) -> int:
    """A Qwen3 of 6.8M parameters (8 layers; its largest tensor 4% of it), sharded in 4 files; its fp32 bytes."""
    import transformers

    config = transformers.Qwen3Config(vocab_size=1024, hidden_size=256, intermediate_size=768, num_hidden_layers=8,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                                      tie_word_embeddings=False)
    model = transformers.Qwen3ForCausalLM(config)
    model.save_pretrained(directory, max_shard_size="8MB")
    return sum(p.numel() for p in model.parameters()) * 4


def _load_peak(directory: str, zero: int, mesh) -> int:
    """Bytes by which this rank's peak resident memory grew while the model was built and loaded."""
    gc.collect()
    reset_peak_rss()
    start = proc_status_bytes("VmRSS")
    model = HFCausalLM.build(read_model_dir(directory))
    pmodel, _ = parallelize(model, mesh, data=DataParallel(zero=zero), init=weight_initializer(model, directory, 0))
    peak = proc_status_bytes("VmHWM") - start
    del pmodel, model
    gc.collect()
    return peak


def _both(rank, world, directory):
    # Every tensor its own mapping: a freed tensor leaves RSS at once, so a load that follows another is not
    # served from the heap the first one left behind (glibc's default keeps it, hiding the second load's peak).
    return_freed_memory()
    mesh = init_mesh(dp=2)
    _load_peak(directory, 3, mesh)  # the first load pays one-time costs (imports, allocator pools): not counted
    return {"zero3": _load_peak(directory, 3, mesh), "zero0": _load_peak(directory, 0, mesh)}


@pytest.mark.multirank
def test_zero3_loads_a_model_without_any_rank_holding_it_whole():
    directory = Path(tempfile.mkdtemp(prefix="paratrain-hf-load-"))
    model_bytes = _save(directory)
    assert (directory / "model.safetensors.index.json").is_file()
    for rank, peaks in enumerate(run_on_ranks(_both, 2, str(directory), timeout=300)):
        print(f"rank {rank}: zero3 {peaks['zero3'] / model_bytes:.2f}x, zero0 {peaks['zero0'] / model_bytes:.2f}x "
              f"of the model's {model_bytes / 1e6:.1f} MB")
        assert peaks["zero3"] < 0.7 * model_bytes, peaks
        # the meter sees a whole model where one is held (1.15x-1.17x measured; zero3 0.46x-0.47x), so the zero3
        # bound above is not met by a blind meter
        assert peaks["zero0"] > 0.8 * model_bytes, peaks
