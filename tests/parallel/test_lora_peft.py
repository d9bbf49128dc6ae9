"""A LoRA run's adapters in PEFT's format and merged (`paratrain export --adapter`, `--merge`): PEFT loads them over
transformers' model of the base and computes the logits paratrain's model computes; the merged export equals PEFT's
`merge_and_unload()`. The base: a short run of the reference model, exported; the LoRA run starts from it."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from paratrain.cli import main
from paratrain.interop.export import import_hf
from paratrain.models import Transformer
from paratrain.parallel.lora import LoRA, convert_to_lora

SIZE = ["--n-layers", "2", "--dim", "32", "--n-heads", "4", "--n-kv-heads", "2", "--ffn-dim", "64"]
RUN = ["--seq-len", "32", "--global-batch", "4", "--sample-tokens", "0", "--eval-every", "0", "--no-progress"]
LORA = ["--lora", "4", "--lora-alpha", "12", "--lora-targets", "wq,wv,w1,w2", "--lr", "0.02", "--warmup-steps", "0"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("peft")
    assert main(["train", *SIZE, *RUN, "--steps", "2", "--out", str(root / "base-run")]) == 0
    assert main(["export", str(root / "base-run"), str(root / "base")]) == 0
    assert main(["train", *RUN, *LORA, "--steps", "3", "--init-from", str(root / "base"), "--out", str(root / "lora")]) == 0
    assert main(["export", str(root / "lora"), str(root / "adapter"), "--adapter"]) == 0
    assert main(["export", str(root / "lora"), str(root / "merged"), "--merge"]) == 0
    return root


def _ours(root, run: str = "lora", base_dtype: str | None = None) -> torch.nn.Module:
    """paratrain's reference model of the base with the run's adapters, as it trained them."""
    cfg, state = import_hf(root / "base")
    model = Transformer(cfg)
    model.load_state_dict(state)
    convert_to_lora(model, LoRA(4, alpha=12, targets=("wq", "wv", "w1", "w2"), base_dtype=base_dtype))
    adapters = load_file(root / run / "final" / "model.safetensors")
    assert len(adapters) == 2 * 2 * 4 and all(".lora_" in n for n in adapters)
    missing, unexpected = model.load_state_dict(adapters, strict=False)
    assert not unexpected and all(".lora_" not in n for n in missing)
    assert any(t.abs().max() > 0 for n, t in adapters.items() if ".lora_B." in n), "the adapters trained"
    return model.eval()


def test_a_lora_resume_needs_the_directory_of_its_base(runs, tmp_path, capsys):
    """A LoRA checkpoint carries its model's config and tokenizer but not the frozen base, read from --init-from
    again: a directory that is gone is refused in one line before anything starts."""
    capsys.readouterr()
    code = main(["train", "--resume", str(runs / "lora"), "--init-from", str(tmp_path / "gone")])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "holds the adapters, not the frozen base" in err, err


def test_peft_loads_the_adapters_over_transformers_model_with_paratrains_logits(runs):
    import peft
    import transformers
    config = json.loads((runs / "adapter" / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["lora_alpha"] == 12 and len(config["target_modules"]) == 2 * 4
    base = transformers.LlamaForCausalLM.from_pretrained(runs / "base", attn_implementation="eager")
    theirs = peft.PeftModel.from_pretrained(base, runs / "adapter").eval()
    tokens = torch.randint(0, 256, (2, 19), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = _ours(runs)(tokens)
        torch.testing.assert_close(theirs(tokens).logits, ours, rtol=0, atol=1e-5)
        plain = transformers.LlamaForCausalLM.from_pretrained(runs / "base", attn_implementation="eager").eval()
        assert (plain(tokens).logits - ours).abs().max() > 1e-3, "the adapters change the logits"


def test_the_merged_export_equals_peft_merge_and_unload(runs):
    import peft
    import transformers
    base = transformers.LlamaForCausalLM.from_pretrained(runs / "base", attn_implementation="eager")
    merged = peft.PeftModel.from_pretrained(base, runs / "adapter").merge_and_unload()
    want = {n: t for n, t in merged.state_dict().items()}
    got = load_file(runs / "merged" / "model.safetensors")
    assert set(got) <= set(want) and len(got) >= len(want) - 1  # a tied head is written once
    for name, value in got.items():
        torch.testing.assert_close(value, want[name], rtol=0, atol=0, msg=name)
    ours = transformers.LlamaForCausalLM.from_pretrained(runs / "merged", attn_implementation="eager").eval()
    tokens = torch.randint(0, 256, (2, 19), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(ours(tokens).logits, _ours(runs)(tokens), rtol=0, atol=1e-5)


def test_the_merged_export_of_an_fp8_base_computes_what_the_run_computed(runs):
    """`--base-dtype fp8`: the merged weights are the base as the run held it (e4m3 at its rows' scales, decoded) plus
    the adapters' product, so transformers' model of the merged export computes the run's logits."""
    import transformers
    fp8 = runs / "lora-fp8"
    assert main(["train", *RUN, *LORA, "--base-dtype", "fp8", "--steps", "3", "--init-from", str(runs / "base"),
                 "--out", str(fp8)]) == 0
    assert main(["export", str(fp8), str(runs / "merged-fp8"), "--merge"]) == 0
    ours = transformers.LlamaForCausalLM.from_pretrained(runs / "merged-fp8", attn_implementation="eager").eval()
    tokens = torch.randint(0, 256, (2, 19), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = _ours(runs, "lora-fp8", "fp8")(tokens)
        torch.testing.assert_close(ours(tokens).logits, want, rtol=0, atol=1e-5)
        assert (_ours(runs, "lora-fp8")(tokens) - want).abs().max() > 1e-4, "the fp8 base differs from the fp32 one"


@pytest.mark.parametrize("argv, message", [
    (["base-run", "x", "--adapter"], "holds no LoRA adapters (it was not trained with --lora)"),
    (["base-run", "x", "--merge"], "holds no LoRA adapters"),
    (["lora", "x"], "holds LoRA adapters over a frozen base (a --lora run): export them with --adapter"),
])
def test_export_of_the_wrong_kind_of_run_is_one_line(runs, argv, message, capsys):
    assert main(["export", str(runs / argv[0]), str(runs / "out" / argv[1]), *argv[2:]]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err


def test_a_transformers_backend_run_exports_adapters_peft_loads(tmp_path):
    """A Qwen2 (q, k, v biases; transformers' own modeling under `--backend transformers`): the adapters keep
    transformers' module names; PEFT's logits are those of the same model converted here, and the merged export
    equals PEFT's merge bit for bit."""
    import peft
    import transformers
    torch.manual_seed(0)
    config = transformers.Qwen2Config(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      tie_word_embeddings=False)
    transformers.Qwen2ForCausalLM(config).save_pretrained(tmp_path / "base")
    targets = ("q_proj", "v_proj", "down_proj")
    assert main(["train", *RUN, "--lora", "4", "--lora-targets", ",".join(targets), "--lr", "0.02", "--steps", "3",
                 "--init-from", str(tmp_path / "base"), "--backend", "transformers", "--out", str(tmp_path / "run")]) == 0
    assert main(["export", str(tmp_path / "run"), str(tmp_path / "adapter"), "--adapter"]) == 0
    assert main(["export", str(tmp_path / "run"), str(tmp_path / "merged"), "--merge"]) == 0

    def base():
        return transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base", attn_implementation="eager")

    theirs = peft.PeftModel.from_pretrained(base(), tmp_path / "adapter").eval()
    ours = base()
    convert_to_lora(ours, LoRA(4, targets=targets))
    missing, unexpected = ours.load_state_dict(load_file(tmp_path / "run" / "final" / "model.safetensors"), strict=False)
    assert not unexpected and all(".lora_" not in n for n in missing)
    tokens = torch.randint(0, 256, (2, 19), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(theirs(tokens).logits, ours.eval()(tokens).logits, rtol=0, atol=1e-5)
        assert (base()(tokens).logits - theirs(tokens).logits).abs().max() > 1e-3, "the adapters change the logits"
    want = theirs.merge_and_unload().state_dict()
    got = load_file(tmp_path / "merged" / "model.safetensors")
    assert got.keys() == want.keys() and all(torch.equal(got[n], want[n]) for n in got)
