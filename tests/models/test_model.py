"""Reference model: parameter counts, deterministic init, forward semantics, HF parity."""

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

from paratrain.models import (
    MODEL_CONFIGS,
    ModelConfig,
    ModelConfigError,
    Transformer,
    generate,
    get_model_config,
    init_parameter,
)
from paratrain.models.generate import GenerationError
from paratrain.interop.hf import HFNameError, from_hf_name, hf_name
from paratrain.models.llama import Attention, FeedForward, rotary_tables

MICRO = ModelConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, max_seq_len=64)

PUBLISHED = {
    "llama2-7b": 6_738_415_616,
    "llama2-13b": 13_015_864_320,
    "llama2-70b": 68_976_648_192,
    "llama3-8b": 8_030_261_248,
}


def build(config: ModelConfig, seed: int = 0, device="cpu") -> Transformer:
    with torch.device("meta"):
        model = Transformer(config)
    model.to_empty(device=device)
    model.init_weights(seed)
    return model


def variant(config: ModelConfig, **changes) -> ModelConfig:
    return dataclasses.replace(config, **changes)


# ---- parameter counts ----


@pytest.mark.parametrize(
    "config",
    [
        MODEL_CONFIGS["tiny"],
        MODEL_CONFIGS["small"],
        variant(MODEL_CONFIGS["tiny"], tie_embeddings=True),
        variant(MODEL_CONFIGS["small"], tie_embeddings=False),
        variant(MICRO, n_kv_heads=1),
        variant(MICRO, n_kv_heads=4),
    ],
    ids=["tiny", "small", "tiny-tied", "small-untied", "micro-mqa", "micro-mha"],
)
def test_analytic_count_matches_instantiated(config):
    model = Transformer(config)
    unique = {id(p): p.numel() for p in model.parameters()}
    assert config.num_params() == sum(unique.values()) == model.num_params()


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_big_configs_match_meta_count_and_published(name):
    config = get_model_config(name)
    with torch.device("meta"):
        model = Transformer(config)
    assert model.num_params() == config.num_params() == PUBLISHED[name]


def test_flops_per_token_palm_convention():
    config = get_model_config("llama2-7b")
    embedding = config.vocab_size * config.dim
    expected = 6 * (PUBLISHED["llama2-7b"] - embedding) + 12 * 32 * 4096 * 4096
    assert config.flops_per_token(4096) == expected
    # Tying drops a parameter but not a matmul: the output projection still counts.
    tied = variant(config, tie_embeddings=True)
    assert tied.flops_per_token(4096) == expected
    with pytest.raises(ModelConfigError, match="seq_len"):
        config.flops_per_token(0)


# ---- initialization ----


def test_init_is_independent_of_construction_device():
    on_meta = build(MICRO, seed=3)
    direct = Transformer(MICRO)
    direct.init_weights(3)
    for (name, a), (_, b) in zip(on_meta.state_dict().items(), direct.state_dict().items()):
        assert torch.equal(a, b), name


def test_init_seed_changes_every_random_parameter():
    a, b = build(MICRO, seed=0), build(MICRO, seed=1)
    for name, p in a.named_parameters():
        if "norm" not in name:
            assert not torch.equal(p, b.get_parameter(name)), name


def test_init_of_a_pipeline_stage_matches_full_model():
    full = build(MICRO, seed=5)
    with torch.device("meta"):
        stage = Transformer(MICRO)
    del stage.layers["0"]
    stage.tok_embeddings = None
    stage.to_empty(device="cpu")
    stage.init_weights(5)
    names = [n for n, _ in stage.named_parameters()]
    assert names and all(not n.startswith(("layers.0.", "tok_embeddings")) for n in names)
    for name, p in stage.named_parameters():
        assert torch.equal(p, full.get_parameter(name)), name


def test_init_is_dtype_independent():
    full = build(MICRO, seed=2)
    half = Transformer(MICRO).to(torch.bfloat16)
    half.init_weights(2)
    for name, p in half.named_parameters():
        assert torch.equal(p, full.get_parameter(name).to(torch.bfloat16)), name


def test_init_parameter_matches_model_and_std_scheme():
    config = MODEL_CONFIGS["tiny"]
    model = build(config, seed=7)
    for name, p in model.named_parameters():
        expected = init_parameter(name, tuple(p.shape), 7, std=model.param_init_std(name))
        assert expected.dtype == torch.float32 and expected.device.type == "cpu"
        assert torch.equal(p, expected), name
    residual_std = 0.02 / math.sqrt(2 * config.n_layers)
    assert model.param_init_std("layers.1.attention.wo.weight") == residual_std
    assert model.param_init_std("layers.1.feed_forward.w2.weight") == residual_std
    assert model.param_init_std("layers.1.attention.wq.weight") == 0.02
    assert model.param_init_std("layers.1.ffn_norm.weight") is None
    assert torch.equal(model.norm.weight, torch.ones(config.dim))
    assert model.tok_embeddings.weight.std().item() == pytest.approx(0.02, rel=0.02)
    assert model.layers["0"].feed_forward.w2.weight.std().item() == pytest.approx(residual_std, rel=0.02)


# ---- tied embeddings ----


def test_tied_embeddings_share_one_parameter_after_materialization():
    config = variant(MICRO, tie_embeddings=True)
    model = build(config)
    assert model.output.weight is model.tok_embeddings.weight
    names = [n for n, _ in model.named_parameters()]
    assert "output.weight" not in names and "tok_embeddings.weight" in names
    # (a last pipeline stage's copy of the table is initialized under the whole model's name by the split:
    # tests/parallel/pipeline/test_pipeline.py, the tied cases)


# ---- forward ----


def test_forward_shapes_and_pipeline_split():
    model = build(MICRO)
    tokens = torch.randint(0, MICRO.vocab_size, (3, 10))
    logits = model(tokens)
    assert logits.shape == (3, 10, MICRO.vocab_size)
    first, last = build(MICRO), build(MICRO)
    del first.layers["1"]
    first.norm, first.output = None, None
    del last.layers["0"]
    last.tok_embeddings = None
    hidden = first(tokens)
    assert hidden.shape == (3, 10, MICRO.dim)
    torch.testing.assert_close(last(hidden), logits, rtol=0, atol=0)


def test_causality():
    model = build(MICRO)
    tokens = torch.randint(0, MICRO.vocab_size, (2, 12))
    changed = tokens.clone()
    changed[:, 8] = (changed[:, 8] + 1) % MICRO.vocab_size
    a, b = model(tokens), model(changed)
    torch.testing.assert_close(a[:, :8], b[:, :8], rtol=0, atol=0)
    assert not torch.allclose(a[:, 8:], b[:, 8:])


def _reference_rotary(x, theta):
    """Rotary via complex numbers pairing (i, i + E/2): independent of the model's code."""
    b, s, h, e = x.shape
    inv_freq = 1.0 / theta ** (torch.arange(0, e, 2, dtype=torch.float64) / e)
    angles = torch.arange(s, dtype=torch.float64)[:, None] * inv_freq
    z = torch.complex(x[..., : e // 2].double(), x[..., e // 2 :].double())
    z = z * torch.polar(torch.ones_like(angles), angles)[None, :, None, :]
    return torch.cat((z.real, z.imag), dim=-1).float()


def _reference_attention(attn, x, theta):
    b, s, _ = x.shape
    e = attn.head_dim
    q = _reference_rotary(attn.wq(x).view(b, s, -1, e), theta).transpose(1, 2)
    k = _reference_rotary(attn.wk(x).view(b, s, -1, e), theta).transpose(1, 2)
    v = attn.wv(x).view(b, s, -1, e).transpose(1, 2)
    group = q.shape[1] // k.shape[1]
    k = torch.stack([k[:, h // group] for h in range(q.shape[1])], dim=1)
    v = torch.stack([v[:, h // group] for h in range(q.shape[1])], dim=1)
    scores = q @ k.transpose(-1, -2) / math.sqrt(e)
    mask = torch.ones(s, s, dtype=torch.bool).tril()
    probs = scores.masked_fill(~mask, float("-inf")).softmax(dim=-1)
    return attn.wo((probs @ v).transpose(1, 2).reshape(b, s, -1))


@pytest.mark.parametrize("n_kv_heads", [1, 2, 4])
def test_gqa_attention_matches_naive_reference(n_kv_heads):
    config = variant(MICRO, n_kv_heads=n_kv_heads, rope_theta=500.0)
    torch.manual_seed(0)
    attn = Attention(config)
    x = torch.randn(2, 9, config.dim)
    cos, sin = rotary_tables(9, config.head_dim, config.rope_theta, x.device, x.dtype)
    expected = _reference_attention(attn, x, config.rope_theta)
    torch.testing.assert_close(attn(x, cos, sin), expected, rtol=0, atol=1e-5)


def test_layers_work_on_weights_sliced_by_heads():
    """A tensor-parallel split (columns of wq/wk/wv/w1/w3, rows of wo/w2) needs no model change."""
    torch.manual_seed(0)
    attn, ffn = Attention(MICRO), FeedForward(MICRO)
    x = torch.randn(2, 7, MICRO.dim)
    cos, sin = rotary_tables(7, MICRO.head_dim, MICRO.rope_theta, x.device, x.dtype)
    full_attn, full_ffn = attn(x, cos, sin), ffn(x)
    tp, partial_attn, partial_ffn = 2, 0, 0
    for rank in range(tp):
        shard_a, shard_f = Attention(MICRO), FeedForward(MICRO)
        with torch.no_grad():
            for col in ("wq", "wk", "wv"):
                w = getattr(attn, col).weight
                getattr(shard_a, col).weight = torch.nn.Parameter(w.chunk(tp, dim=0)[rank].clone())
            shard_a.wo.weight = torch.nn.Parameter(attn.wo.weight.chunk(tp, dim=1)[rank].clone())
            for col in ("w1", "w3"):
                w = getattr(ffn, col).weight
                getattr(shard_f, col).weight = torch.nn.Parameter(w.chunk(tp, dim=0)[rank].clone())
            shard_f.w2.weight = torch.nn.Parameter(ffn.w2.weight.chunk(tp, dim=1)[rank].clone())
        partial_attn = partial_attn + shard_a(x, cos, sin)
        partial_ffn = partial_ffn + shard_f(x)
    torch.testing.assert_close(partial_attn, full_attn, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(partial_ffn, full_ffn, rtol=1e-5, atol=1e-6)


def test_tiny_overfits_one_batch():
    """The model learns: tiny's vocabulary and shape, at half its width and depth (a quarter of the work)."""
    torch.manual_seed(0)
    config = variant(MODEL_CONFIGS["tiny"], dim=128, n_layers=2, ffn_dim=344)
    model = build(config)
    tokens = torch.randint(0, config.vocab_size, (2, 33))
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(50):
        loss = F.cross_entropy(model(inputs).flatten(0, 1), labels.flatten())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[0] == pytest.approx(math.log(512), rel=0.05)
    # Best of the last steps: Adam at this rate oscillates by ~2x around the minimum.
    assert min(losses[-5:]) < 0.2 * losses[0]


def test_generate():
    config = variant(MICRO, max_seq_len=8)
    model = build(config)
    prompt = torch.randint(0, config.vocab_size, (2, 11))  # longer than max_seq_len: cropped
    greedy = generate(model, prompt, 5, temperature=0)
    assert greedy.shape == (2, 16) and torch.equal(greedy[:, :11], prompt)
    assert torch.equal(greedy[:, 11], model(prompt[:, -8:])[:, -1].argmax(-1))
    assert torch.equal(generate(model, prompt, 5, temperature=1.0, top_k=1), greedy)
    sample = lambda: generate(model, prompt, 5, generator=torch.Generator().manual_seed(4))
    assert torch.equal(sample(), sample())
    with pytest.raises(GenerationError, match="top_k"):
        generate(model, prompt, 1, top_k=0)


# ---- Hugging Face ----


def test_hf_names_round_trip():
    model = Transformer(MICRO)
    names = [n for n, _ in model.named_parameters()]
    hf = [hf_name(n) for n in names]
    assert "model.layers.1.mlp.gate_proj.weight" in hf and "lm_head.weight" in hf
    assert [from_hf_name(n) for n in hf] == names
    for bad in ("layers.0.attention.wz.weight", "model.rotary_emb.inv_freq"):
        with pytest.raises(HFNameError, match="no Llama counterpart"):
            hf_name(bad) if bad.startswith("layers") else from_hf_name(bad)


@pytest.mark.parametrize("tied", [False, True])
def test_logits_match_hugging_face_llama(tied):
    transformers = pytest.importorskip("transformers")
    config = variant(MICRO, tie_embeddings=tied, rope_theta=500000.0)
    ours = build(config, seed=1)
    hf_config = transformers.LlamaConfig(
        vocab_size=config.vocab_size, hidden_size=config.dim, intermediate_size=config.ffn_dim,
        num_hidden_layers=config.n_layers, num_attention_heads=config.n_heads,
        num_key_value_heads=config.n_kv_heads, max_position_embeddings=config.max_seq_len,
        rms_norm_eps=config.norm_eps, tie_word_embeddings=tied,
        rope_parameters={"rope_type": "default", "rope_theta": config.rope_theta},
        attn_implementation="eager",
    )
    theirs = transformers.LlamaForCausalLM(hf_config).eval()
    state = {hf_name(n): p for n, p in ours.named_parameters()}
    missing, unexpected = theirs.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= ({"lm_head.weight"} if tied else set())
    tokens = torch.randint(0, config.vocab_size, (2, 13))
    with torch.no_grad():
        torch.testing.assert_close(theirs(tokens).logits, ours(tokens), rtol=0, atol=1e-5)


# ---- config validation ----


@pytest.mark.parametrize(
    "changes, field",
    [
        ({"dim": 0}, "dim"),
        ({"vocab_size": 10.0}, "vocab_size"),
        ({"dim": 30}, "n_heads"),
        ({"n_kv_heads": 3}, "n_kv_heads"),
        ({"dim": 12, "n_heads": 4, "n_kv_heads": 2}, "odd"),
        ({"norm_eps": 0.0}, "norm_eps"),
        ({"rope_theta": -1.0}, "rope_theta"),
        ({"tie_embeddings": "yes"}, "tie_embeddings"),
    ],
)
def test_config_validation(changes, field):
    with pytest.raises(ValueError, match=field) as info:
        variant(MICRO, **changes)
    assert isinstance(info.value, ModelConfigError)
    assert "\n" not in str(info.value)


def test_unknown_model_lists_choices():
    with pytest.raises(ModelConfigError) as info:
        get_model_config("nope")
    message = str(info.value)
    assert message.startswith("unknown model 'nope'; choose one of: tiny, small, llama2-7b")
    assert get_model_config("tiny") is MODEL_CONFIGS["tiny"]
