"""The Llama weights people download: Llama 3.1/3.2's rope scaling ("llama3") and tied embeddings, read with
`paratrain.from_pretrained`, trained with --init-from and written back by `export`.

The directory is what transformers saves for a Llama 3.2-style config built here (no download): GQA, tied
embeddings, rope_scaling llama3 with a short original context, so that the scaled frequencies matter within
the tested sequence.
"""

import json

import pytest
import torch

import paratrain
from paratrain.cli import main
from paratrain.interop.hf import HFError, model_config_from_hf
from paratrain.models import MODEL_CONFIGS, Transformer

transformers = pytest.importorskip("transformers")

ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16}


def _llama32_dir(path, tied=True):
    config = transformers.LlamaConfig(
        vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=8,
        num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-5, rope_theta=500000.0,
        rope_scaling=dict(ROPE), tie_word_embeddings=tied)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    model.save_pretrained(path)
    return model


def _tokens(length: int) -> torch.Tensor:
    return torch.randint(0, 300, (2, length), generator=torch.Generator().manual_seed(3))


def test_from_pretrained_equals_transformers_past_the_original_context(tmp_path):
    theirs = _llama32_dir(tmp_path / "hf")
    ours = paratrain.from_pretrained(tmp_path / "hf")
    cfg = ours.config
    assert (cfg.rope_scaling, cfg.rope_factor, cfg.rope_original_max_seq_len) == ("llama3", 8.0, 16)
    assert cfg.tie_embeddings and cfg.n_kv_heads == 2 and ours.output.weight is ours.tok_embeddings.weight
    tokens = _tokens(96)  # six times the original context
    with torch.no_grad():
        mine, reference = ours(tokens), theirs(tokens).logits
        torch.testing.assert_close(mine, reference, rtol=0, atol=1e-4)
        # the scaling is what makes them equal: without it the positions past the original context differ
        plain = Transformer(dataclasses_replace(cfg, rope_scaling="none"))
        plain.load_state_dict(ours.state_dict())
        assert (plain(tokens)[:, 16:] - reference[:, 16:]).abs().max() > 1e-3


def dataclasses_replace(cfg, **changes):
    import dataclasses

    return dataclasses.replace(cfg, **changes)


def test_init_from_trains_it_and_export_writes_its_rope_scaling_back(tmp_path, capsys):
    hf = _llama32_dir(tmp_path / "hf")
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("the quick brown fox jumps over the lazy dog. " * 400)
    code = main(["train", "--init-from", str(tmp_path / "hf"), "--data", str(corpus), "--out", str(tmp_path / "run"),
                 "--steps", "3", "--global-batch", "4", "--micro-batch", "4", "--seq-len", "64", "--eval-every", "0",
                 "--sample-tokens", "0", "--no-progress", "--peak-flops", "1e12"])
    assert code == 0
    # The first line names the model by what the directory holds and trains it with the fine-tuning recipe, never
    # the toy config --model defaulted to (tiny's peak 3e-3 would wreck pretrained weights).
    first = capsys.readouterr().out.splitlines()[0]
    size = sum(p.numel() for p in hf.parameters())
    assert first.startswith(f"paratrain: LlamaForCausalLM {size / 1e3:.3g}K from {tmp_path / 'hf'} ({size:,} "
                            f"parameters)"), first
    assert "lr 2e-05, warm-up 0 steps, cosine to 2e-06, weight decay 0.1 (from the fine-tuning recipe: full " \
           "fine-tuning: Llama 2-Chat's SFT (Touvron et al. 2023, §3.1" in first, first
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert all(2e-6 <= r["lr"] <= 2e-5 for r in records), records
    assert main(["export", str(tmp_path / "run"), str(tmp_path / "out")]) == 0
    doc = json.loads((tmp_path / "out" / "config.json").read_text())
    assert doc["rope_scaling"] == ROPE and doc["tie_word_embeddings"] is True and doc["rope_theta"] == 500000.0
    theirs = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "out").eval()
    ours = paratrain.from_pretrained(tmp_path / "out")
    tokens = _tokens(80)
    with torch.no_grad():
        torch.testing.assert_close(ours(tokens), theirs(tokens).logits, rtol=0, atol=1e-4)


def test_other_rope_types_are_refused_in_one_line():
    base = {"model_type": "llama", "vocab_size": 10, "hidden_size": 8, "intermediate_size": 16,
            "num_hidden_layers": 1, "num_attention_heads": 2}
    for key in ("rope_scaling", "rope_parameters"):
        with pytest.raises(HFError, match=r"rope_type 'dynamic' is not supported") as refused:
            model_config_from_hf({**base, key: {"rope_type": "dynamic", "factor": 2.0}})
        assert "\n" not in str(refused.value)
    cfg = model_config_from_hf({**base, "rope_parameters": {**ROPE, "rope_theta": 5e5}})
    assert (cfg.rope_scaling, cfg.rope_low_freq_factor, cfg.rope_high_freq_factor, cfg.rope_theta) == \
        ("llama3", 1.0, 4.0, 5e5)


def test_the_llama_3_1_and_3_2_configs_have_their_published_shapes():
    """Hugging Face's meta-llama configs: parameters 8.03B, 70.6B, 1.24B (tied), 3.21B (tied)."""
    expected = {"llama3.1-8b": 8.03e9, "llama3.1-70b": 70.55e9, "llama3.2-1b": 1.236e9, "llama3.2-3b": 3.213e9}
    for name, params in expected.items():
        cfg = MODEL_CONFIGS[name]
        assert cfg.num_params() == pytest.approx(params, rel=5e-3), name
        assert cfg.rope_scaling == "llama3" and cfg.max_seq_len == 131072
    assert MODEL_CONFIGS["llama3.2-1b"].rope_factor == 32.0 and MODEL_CONFIGS["llama3.1-8b"].rope_factor == 8.0
