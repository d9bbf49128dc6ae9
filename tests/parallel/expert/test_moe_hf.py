"""Hugging Face Mixtral interop: a `MixtralForCausalLM` built from a tiny config (no download) and paratrain's
`Transformer` give the same logits after an import (`HFWeights`, what --init-from reads) and after an export
(`export_hf`) loaded back by transformers."""

from __future__ import annotations

import json

import pytest
import torch
import transformers

from paratrain.interop.export import import_hf
from paratrain.run.export import export_hf
from paratrain.interop.hf import HFError, HFWeights, from_hf_name, hf_config, hf_names
from paratrain.models import ModelConfig, Transformer

VOCAB, SEQ = 96, 24


def _mixtral(seed: int = 0):
    cfg = transformers.MixtralConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=64,
        rms_norm_eps=1e-5, rope_theta=1e6, attn_implementation="eager", tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = transformers.MixtralForCausalLM(cfg).float().eval()
    with torch.no_grad():  # the default init leaves the norms at 1 and the router near uniform: perturb both
        for name, p in model.named_parameters():
            p.add_(torch.randn_like(p) * (0.3 if "norm" in name or "gate" in name else 0.02))
    return model


def _tokens() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))


def _hf_logits(model, tokens) -> torch.Tensor:
    with torch.no_grad():
        return model(tokens).logits.float()


def _ours(config: ModelConfig, state: dict) -> Transformer:
    model = Transformer(config).float().eval()
    model.load_state_dict(state, strict=True)
    return model


def test_names_map_the_router_and_each_experts_rows():
    assert from_hf_name("model.layers.1.block_sparse_moe.gate.weight") == "layers.1.feed_forward.router.weight"
    assert from_hf_name("model.layers.0.block_sparse_moe.experts.3.w2.weight") == "layers.0.feed_forward.experts.w2"
    assert hf_names("layers.0.feed_forward.experts.w1", 2) == [
        "model.layers.0.block_sparse_moe.experts.0.w1.weight", "model.layers.0.block_sparse_moe.experts.1.w1.weight"]


def test_import_gives_mixtrals_logits(tmp_path):
    hf = _mixtral()
    hf.save_pretrained(tmp_path)  # the Hub's layout: block_sparse_moe.experts.{j}.w1/w2/w3
    config, state = import_hf(tmp_path)
    assert (config.n_experts, config.top_k, config.expert_hidden_dim, config.rope_theta) == (4, 2, 48, 1e6)
    tokens = _tokens()
    with torch.no_grad():
        ours = _ours(config, state)(tokens).float()
    torch.testing.assert_close(ours, _hf_logits(hf, tokens), rtol=1e-5, atol=1e-5)
    stacked = HFWeights(tmp_path).read("layers.1.feed_forward.experts.w3")
    torch.testing.assert_close(stacked[2], hf.model.layers[1].mlp.experts.gate_up_proj[2, 48:])  # w3 = up


def test_export_loads_back_into_mixtral_with_the_same_logits(tmp_path):
    hf = _mixtral(seed=3)
    hf.save_pretrained(tmp_path / "hf")
    config, state = import_hf(tmp_path / "hf")
    final = tmp_path / "run" / "final"  # what `paratrain train` leaves: weights + model config
    final.mkdir(parents=True)
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in state.items()}, str(final / "model.safetensors"))
    (final / "model_config.json").write_text(json.dumps(config.__dict__))
    result = export_hf(final, tmp_path / "out")
    doc = json.loads((tmp_path / "out" / "config.json").read_text())
    assert doc["architectures"] == ["MixtralForCausalLM"] and doc["num_local_experts"] == 4
    back = transformers.MixtralForCausalLM.from_pretrained(tmp_path / "out", attn_implementation="eager").float().eval()
    tokens = _tokens()
    torch.testing.assert_close(_hf_logits(back, tokens), _hf_logits(hf, tokens), rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        ours = _ours(config, state)(tokens).float()
    torch.testing.assert_close(ours, _hf_logits(back, tokens), rtol=1e-5, atol=1e-5)
    assert result.model_config == config


def test_refusals_name_the_field(tmp_path):
    shared = ModelConfig(vocab_size=64, dim=32, n_layers=1, n_heads=4, n_kv_heads=2, ffn_dim=48, n_experts=4,
                         shared_expert=True)
    with pytest.raises(HFError, match="shared_expert"):
        hf_config(shared)
    hf = _mixtral()
    hf.config.sliding_window = 16
    hf.save_pretrained(tmp_path)
    with pytest.raises(HFError, match="sliding_window 16"):
        import_hf(tmp_path)
