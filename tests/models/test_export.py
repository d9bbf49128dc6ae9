"""Hugging Face export and import: exact round trips, Hugging Face's own loader, --init-from, and bad input."""

import dataclasses
import json
import shutil

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from paratrain.checkpoint import CheckpointReader, LocalCoordinator, ShardSpec, save_checkpoint
from paratrain.interop.export import import_hf
from paratrain.run.export import SourceKind, export_hf, resolve_source
from paratrain.interop.hf import HFError, HFWeights, model_config_from_hf
from paratrain.cli import main
from paratrain.config import Config
from paratrain.data import DataSampler, build_dataset
from paratrain.data.tokenizer import BPETokenizer, ByteTokenizer
from paratrain.metrics import read_metrics
from paratrain.models import ModelConfig, Transformer
from paratrain.interop.hf import hf_name
from paratrain.testing import run_on_ranks
from paratrain.train import IGNORE_INDEX, build_model, save_final, train

# Vocabulary above the byte tokenizer's 259 so that `paratrain train --init-from` can use it.
MICRO = ModelConfig(vocab_size=320, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=48, max_seq_len=64,
                    rope_theta=500000.0)
TIED = dataclasses.replace(MICRO, tie_embeddings=True)


def weights_of(model: Transformer) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def make_final(run, cfg: ModelConfig, seed: int) -> dict[str, torch.Tensor]:
    """A run directory with only final/ (as `train` writes it); returns the weights."""
    weights = weights_of(build_model(cfg, torch.device("cpu"), seed))
    save_final(run, cfg, ByteTokenizer(), {n: w.shape for n, w in weights.items()}, weights.items())
    return weights


def make_checkpoint(root, step: int, cfg: ModelConfig, seed: int, *, store_config: bool = True,
                    stored_config: ModelConfig | None = None):
    """A committed checkpoint of `model/<name>` fp32 tensors, each saved as two row boxes.

    Its shared state holds `stored_config` (default `cfg`) as "model_config" unless not `store_config`.
    """
    weights = weights_of(build_model(cfg, torch.device("cpu"), seed))
    shards = {}
    for name, value in weights.items():
        half = (value.shape[0] + 1) // 2
        for part, (lo, hi) in enumerate([(0, half), (half, value.shape[0])]):
            offset = (lo,) + (0,) * (value.dim() - 1)
            shards[f"model/{name}#{part}"] = (ShardSpec(f"model/{name}", value.shape, offset), value[lo:hi])
    shared = {"step": step}
    if store_config:
        shared["model_config"] = dataclasses.asdict(stored_config or cfg)
    save_checkpoint(root, step, shards, shared_state=shared, coordinator=LocalCoordinator())
    return weights


def assert_same_weights(state: dict, expected: dict, tied: bool) -> None:
    expected = dict(expected)
    if tied:
        expected["output.weight"] = expected["tok_embeddings.weight"]
    assert set(state) == set(expected)
    for name, value in expected.items():
        assert state[name].dtype == value.dtype and torch.equal(state[name], value), name


def write_corpus(path) -> str:
    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()
    path.write_text("\n".join(" ".join(words[(i * 7 + j) % len(words)] for j in range(9)) for i in range(300)))
    return str(path)


TRAIN_ARGS = ["--seq-len", "32", "--global-batch", "4", "--micro-batch", "4", "--steps", "1", "--lr", "0",
              "--min-lr", "0", "--eval-batches", "1", "--sample-tokens", "0", "--no-progress"]


# ---- round trips ----


@pytest.mark.parametrize("cfg", [MICRO, TIED], ids=["untied", "tied"])
def test_final_round_trip_is_exact(tmp_path, cfg):
    weights = make_final(tmp_path / "run", cfg, seed=3)
    result = export_hf(tmp_path / "run", tmp_path / "hf")
    assert result.source.kind is SourceKind.FINAL and result.tokenizer_file == "byte_tokenizer.json"

    stored = load_file(tmp_path / "hf" / "model.safetensors")
    assert ("lm_head.weight" in stored) == (not cfg.tie_embeddings)
    assert set(stored) == {hf_name(n) for n in weights}
    doc = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert doc["tie_word_embeddings"] is cfg.tie_embeddings and doc["architectures"] == ["LlamaForCausalLM"]
    assert doc["torch_dtype"] == "float32" and doc["eos_token_id"] == ByteTokenizer.eos_id

    config, state = import_hf(tmp_path / "hf")
    assert config == cfg
    assert_same_weights(state, weights, cfg.tie_embeddings)
    Transformer(config).load_state_dict(state, strict=True)
    assert state["output.weight"] is state["tok_embeddings.weight"] or not cfg.tie_embeddings


def test_sharded_layout_and_bf16_round_trip(tmp_path):
    weights = make_final(tmp_path / "run", MICRO, seed=1)
    result = export_hf(tmp_path / "run", tmp_path / "hf", max_shard_bytes=20_000)
    assert len(result.weight_files) > 2 and not (tmp_path / "hf" / "model.safetensors").exists()
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == set(result.weight_files)
    config, state = import_hf(tmp_path / "hf")
    assert config == MICRO
    assert_same_weights(state, weights, tied=False)

    export_hf(tmp_path / "run", tmp_path / "bf16", dtype=torch.bfloat16)
    _, state = import_hf(tmp_path / "bf16")
    assert_same_weights(state, {n: w.to(torch.bfloat16) for n, w in weights.items()}, tied=False)
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["torch_dtype"] == "bfloat16"


def test_run_exports_its_newest_checkpoint_assembled_from_boxes(tmp_path):
    run = tmp_path / "run"
    make_final(run, TIED, seed=0)
    make_checkpoint(run / "checkpoints", 4, TIED, seed=4)
    newest = make_checkpoint(run / "checkpoints", 8, TIED, seed=8)

    result = export_hf(run, tmp_path / "hf")
    assert result.source.kind is SourceKind.CHECKPOINT and result.step == 8
    assert result.tokenizer_file == "byte_tokenizer.json"  # from the run's final/
    config, state = import_hf(tmp_path / "hf")
    assert config == TIED
    assert_same_weights(state, newest, tied=True)

    older = resolve_source(run / "checkpoints" / "step-00000004")
    assert older.kind is SourceKind.CHECKPOINT and older.run_dir == run


def test_checkpoint_without_stored_config_uses_the_runs_final_config(tmp_path):
    run = tmp_path / "run"
    make_final(run, MICRO, seed=0)
    weights = make_checkpoint(run / "checkpoints", 2, MICRO, seed=2, store_config=False)
    export_hf(run / "checkpoints" / "step-00000002", tmp_path / "hf")
    assert_same_weights(import_hf(tmp_path / "hf")[1], weights, tied=False)


def test_rotary_inv_freq_is_ignored_and_a_stored_tied_head_must_equal_the_table(tmp_path):
    make_final(tmp_path / "run", TIED, seed=0)
    export_hf(tmp_path / "run", tmp_path / "hf")
    path = tmp_path / "hf" / "model.safetensors"
    stored = load_file(path)
    stored["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)
    stored["lm_head.weight"] = stored["model.embed_tokens.weight"].clone()
    save_file(stored, path, metadata={"format": "pt"})
    import_hf(tmp_path / "hf")
    stored["lm_head.weight"][0, 0] += 1
    save_file(stored, path, metadata={"format": "pt"})
    with pytest.raises(HFError, match="tie_word_embeddings=true but 'lm_head.weight' differs"):
        import_hf(tmp_path / "hf")


def test_exports_the_checkpoints_paratrain_train_saves(tmp_path):
    """A run's newest checkpoint holds its last weights; a step directory taken out of its run still exports."""
    corpus = write_corpus(tmp_path / "corpus.txt")
    sizes = ["--n-layers", "2", "--dim", "32", "--n-heads", "4", "--n-kv-heads", "2", "--ffn-dim", "48"]
    argv = ["train", "--data", corpus, "--out", str(tmp_path / "run"), *TRAIN_ARGS, "--steps", "2", "--lr", "1e-2",
            "--min-lr", "1e-3", "--warmup-steps", "1", "--checkpoint-every", "1", "--tie-embeddings", "true", *sizes]
    assert main(argv) == 0
    assert export_hf(tmp_path / "run", tmp_path / "hf").step == 2
    final = load_file(tmp_path / "run" / "final" / "model.safetensors")
    assert_same_weights(import_hf(tmp_path / "hf")[1], final, tied=True)

    alone = tmp_path / "alone" / "step-00000001"
    shutil.copytree(tmp_path / "run" / "checkpoints" / "step-00000001", alone)
    result = export_hf(alone, tmp_path / "hf1")
    assert result.source.run_dir is None and result.model_config.tie_embeddings and result.model_config.dim == 32
    config, state = import_hf(tmp_path / "hf1")
    with CheckpointReader(alone) as ckpt:
        assert_same_weights(state, {n: ckpt.read(f"model/{n}") for n in HFWeights(tmp_path / "hf1").names}, tied=True)
    assert not torch.equal(state["layers.0.attention.wq.weight"], final["layers.0.attention.wq.weight"])


# ---- Hugging Face's own loader ----


@pytest.mark.parametrize("cfg, shard", [(MICRO, None), (TIED, None), (MICRO, 20_000)],
                         ids=["untied", "tied", "sharded"])
def test_hugging_face_loads_the_export_with_equal_logits(tmp_path, cfg, shard):
    transformers = pytest.importorskip("transformers")
    weights = make_final(tmp_path / "run", cfg, seed=5)
    export_hf(tmp_path / "run", tmp_path / "hf", max_shard_bytes=shard)
    ours = Transformer(cfg)
    ours.load_state_dict(import_hf(tmp_path / "hf")[1])
    assert_same_weights(weights_of(ours), weights, tied=False)
    theirs = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf", attn_implementation="eager").eval()
    assert theirs.config.tie_word_embeddings is cfg.tie_embeddings
    tokens = torch.randint(0, cfg.vocab_size, (2, 19), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(theirs(tokens).logits, ours(tokens), rtol=0, atol=1e-5)


@pytest.mark.parametrize("tied", [False, True])
def test_imports_what_hugging_face_saves(tmp_path, tied):
    transformers = pytest.importorskip("transformers")
    hf_config = transformers.LlamaConfig(
        vocab_size=100, hidden_size=32, intermediate_size=40, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=1, max_position_embeddings=128, rms_norm_eps=1e-5, tie_word_embeddings=tied)
    torch.manual_seed(0)
    theirs = transformers.LlamaForCausalLM(hf_config).eval()
    theirs.save_pretrained(tmp_path / "saved")
    config, state = import_hf(tmp_path / "saved")
    assert (config.n_kv_heads, config.tie_embeddings, config.max_seq_len) == (1, tied, 128)
    ours = Transformer(config)
    ours.load_state_dict(state, strict=True)
    tokens = torch.randint(0, 100, (2, 11), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(ours(tokens), theirs(tokens).logits, rtol=0, atol=1e-5)


def test_bpe_tokenizer_is_exported_for_auto_tokenizer(tmp_path):
    transformers = pytest.importorskip("transformers")
    tokenizer = BPETokenizer.train(["the quick brown fox jumps over the lazy dog"] * 20, 300)
    weights = weights_of(build_model(MICRO, torch.device("cpu"), 0))
    save_final(tmp_path / "run", MICRO, tokenizer, {n: w.shape for n, w in weights.items()}, weights.items())
    assert export_hf(tmp_path / "run", tmp_path / "hf").tokenizer_file == "tokenizer.json"
    doc = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert (doc["bos_token_id"], doc["eos_token_id"]) == (tokenizer.bos_id, tokenizer.eos_id)
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert theirs("the lazy fox")["input_ids"] == tokenizer.encode("the lazy fox")
    assert theirs.eos_token_id == tokenizer.eos_id


# ---- paratrain train --init-from ----


def first_batch_loss(model: Transformer, corpus: str, seq_len: int, global_batch: int, seed: int) -> float:
    """The loss the trainer's first step sees: its sampler's first global batch, mean over target tokens."""
    train_set, _, _ = build_dataset(corpus, "byte", seq_len, None, eval_fraction=0.02, progress=False)
    inputs, labels = train_set.get_batch(DataSampler(len(train_set), global_batch, 0, 1, seed=seed).next_batch())
    with torch.no_grad():
        logits = model(inputs)
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX).item()


def test_train_init_from_starts_from_the_exported_weights(tmp_path):
    weights = make_final(tmp_path / "src", MICRO, seed=7)
    export_hf(tmp_path / "src", tmp_path / "hf")
    corpus = write_corpus(tmp_path / "corpus.txt")
    code = main(["train", "--init-from", str(tmp_path / "hf"), "--data", corpus, "--out", str(tmp_path / "run"),
                 *TRAIN_ARGS])
    assert code == 0
    # lr 0: the one step moves nothing, so the run ends with the weights it started from.
    final = load_file(tmp_path / "run" / "final" / "model.safetensors")
    assert_same_weights(final, weights, tied=False)
    model = Transformer(MICRO)
    model.load_state_dict(weights)
    first = read_metrics(tmp_path / "run" / "metrics.jsonl")[0]["loss"]
    assert first == pytest.approx(first_batch_loss(model, corpus, 32, 4, seed=0), rel=1e-5)


def _train_init_from(rank, world_size, hf_dir, corpus, out, zero, tp):
    cfg = Config()
    cfg.model.init_from, cfg.data.path, cfg.data.seq_len = hf_dir, corpus, 32
    cfg.train.steps, cfg.train.global_batch, cfg.train.micro_batch = 1, 4, 4 // (world_size // tp)
    cfg.train.lr = cfg.train.min_lr = 0.0
    cfg.train.eval_batches, cfg.train.sample_tokens = 1, 0
    cfg.parallel.zero, cfg.parallel.tp = zero, tp
    cfg.run.out, cfg.run.progress = out, False
    train(cfg)


@pytest.mark.parametrize("zero, tp", [(0, 2), (3, 1)], ids=["tp2", "zero3_dp2"])
def test_init_from_under_sharded_layouts(tmp_path, zero, tp):
    """Each rank materializes only its slices of the imported weights; gathered back, they are the export."""
    weights = make_final(tmp_path / "src", TIED, seed=9)
    export_hf(tmp_path / "src", tmp_path / "hf")
    corpus = write_corpus(tmp_path / "corpus.txt")
    run_on_ranks(_train_init_from, 2, str(tmp_path / "hf"), corpus, str(tmp_path / "run"), zero, tp, timeout=120)
    final = load_file(tmp_path / "run" / "final" / "model.safetensors")
    assert_same_weights(final, weights, tied=False)


# ---- bad input: one line, exit 2 ----


def broken_export(tmp_path, edit_config=None, edit_weights=None):
    make_final(tmp_path / "src", MICRO, seed=0)
    out = tmp_path / "hf"
    export_hf(tmp_path / "src", out)
    if edit_config:
        doc = json.loads((out / "config.json").read_text())
        edit_config(doc)
        (out / "config.json").write_text(json.dumps(doc))
    if edit_weights:
        stored = load_file(out / "model.safetensors")
        edit_weights(stored)
        save_file(stored, out / "model.safetensors", metadata={"format": "pt"})
    return out


def one_line_error(capsys, argv) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    return err


def test_export_bad_sources_and_targets(tmp_path, capsys):
    err = one_line_error(capsys, ["export", str(tmp_path / "missing"), str(tmp_path / "out")])
    assert "is not a directory" in err
    (tmp_path / "empty").mkdir()
    assert "neither a run directory" in one_line_error(capsys, ["export", str(tmp_path / "empty"), str(tmp_path / "o")])
    make_final(tmp_path / "run", MICRO, seed=0)
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "x").write_text("")
    assert "--overwrite" in one_line_error(capsys, ["export", str(tmp_path / "run"), str(tmp_path / "taken")])
    err = one_line_error(capsys, ["export", str(tmp_path / "run" / "final"), str(tmp_path / "run"), "--overwrite"])
    assert "holds the source" in err and (tmp_path / "run" / "final" / "model.safetensors").exists()
    assert main(["export", str(tmp_path / "run"), str(tmp_path / "taken"), "--overwrite"]) == 0
    assert "exported" in capsys.readouterr().out and not (tmp_path / "taken" / "x").exists()


def test_export_refuses_tensors_that_do_not_match_the_config(tmp_path, capsys):
    make_checkpoint(tmp_path / "ckpts", 1, dataclasses.replace(MICRO, ffn_dim=64), seed=0, stored_config=MICRO)
    err = one_line_error(capsys, ["export", str(tmp_path / "ckpts"), str(tmp_path / "out")])
    assert "'model/layers.0.feed_forward.w1.weight' has shape [64, 32] but the model config implies [48, 32]" in err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("edit, message", [
    (lambda d: d.update(rope_scaling={"rope_type": "linear", "factor": 2.0}), "rope_type 'linear' is not supported"),
    (lambda d: d.update(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4}),
     r"rope_type 'yarn' is not supported; only plain rotary embeddings \('default'\) and Llama 3.1's 'llama3'"),
    (lambda d: d.update(rope_scaling={"rope_type": "llama3", "factor": 8.0}), "rope scaling 'llama3' needs low_freq"),
    (lambda d: d.update(attention_bias=True), "attention_bias=true is not supported"),
    (lambda d: d.update(mlp_bias=True), "mlp_bias=true is not supported"),
    (lambda d: d.update(hidden_act="gelu"), "hidden_act 'gelu' is not supported"),
    (lambda d: d.update(model_type="mistral"), "model_type 'mistral'"),
    (lambda d: d.update(head_dim=16), "head_dim 16"),
    (lambda d: d.pop("hidden_size"), "hidden_size is missing"),
    (lambda d: d.update(num_key_value_heads=3), "n_kv_heads=3"),
])
def test_import_rejects_unsupported_configs(tmp_path, edit, message):
    out = broken_export(tmp_path, edit_config=edit)
    with pytest.raises(HFError, match=message):
        import_hf(out)


@pytest.mark.parametrize("edit, message", [
    (lambda s: s.update({"model.layers.1.mlp.up_proj.weight": torch.zeros(40, 32)}),
     r"'model.layers.1.mlp.up_proj.weight' has shape \[40, 32\] but config.json implies \[48, 32\]"),
    (lambda s: s.pop("lm_head.weight"), "'lm_head.weight' is missing"),
    (lambda s: s.update({"model.layers.0.self_attn.q_proj.bias": torch.zeros(32)}), "not part of a Llama model"),
])
def test_import_rejects_weights_that_do_not_match(tmp_path, edit, message):
    with pytest.raises(HFError, match=message):
        import_hf(broken_export(tmp_path, edit_weights=edit))


def test_train_init_from_bad_input(tmp_path, capsys):
    base = ["train", "--out", str(tmp_path / "run"), *TRAIN_ARGS]
    err = one_line_error(capsys, [*base, "--init-from", str(tmp_path / "missing")])
    assert err.startswith("paratrain train: error: --init-from:") and "is not a directory" in err
    shapes = broken_export(tmp_path, edit_weights=lambda s: s.update({"model.norm.weight": torch.ones(31)}))
    err = one_line_error(capsys, [*base, "--init-from", str(shapes)])
    assert "'model.norm.weight' has shape [31] but config.json implies [32]" in err
    (shapes / "model.safetensors").unlink()
    export_hf(tmp_path / "src", shapes, overwrite=True)
    err = one_line_error(capsys, [*base, "--init-from", str(shapes), "--dim", "64"])
    assert "--dim 64 disagrees with --init-from" in err
    err = one_line_error(capsys, [*base, "--init-from", str(shapes), "--seq-len", "128"])
    assert "exceeds the model's max_seq_len 64" in err
    assert not (tmp_path / "run").exists()


def test_hf_config_parsing_defaults_and_rope_parameters():
    base = {"model_type": "llama", "vocab_size": 10, "hidden_size": 8, "intermediate_size": 16,
            "num_hidden_layers": 1, "num_attention_heads": 2}
    cfg = model_config_from_hf(base)
    assert (cfg.n_kv_heads, cfg.norm_eps, cfg.rope_theta, cfg.max_seq_len, cfg.tie_embeddings) == \
        (2, 1e-6, 10000.0, 2048, False)
    v5 = model_config_from_hf({**base, "rope_parameters": {"rope_type": "default", "rope_theta": 5e5}})
    assert v5.rope_theta == 5e5
    with pytest.raises(HFError, match="disagree"):
        model_config_from_hf({**base, "rope_theta": 1e4, "rope_parameters": {"rope_theta": 5e5}})


def test_weights_read_lazily_under_our_names(tmp_path):
    weights = make_final(tmp_path / "run", TIED, seed=2)
    export_hf(tmp_path / "run", tmp_path / "hf")
    hf = HFWeights(tmp_path / "hf")
    assert hf.names == list(weights) and "output.weight" not in hf.names
    assert torch.equal(hf.read("output.weight"), weights["tok_embeddings.weight"])
    with pytest.raises(HFError, match="no parameter"):
        hf.read("layers.9.attention.wq.weight")
