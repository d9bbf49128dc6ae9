"""The mixture-of-experts model: routing, the batched experts against a per-token loop, the auxiliary losses
and their gradients, parameter counts, initialization by expert blocks."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from paratrain import compat
from paratrain.models import MODEL_CONFIGS, ModelConfig, ModelConfigError, Transformer
from paratrain.models.moe import MoE, load_balancing_loss, route

MICRO_MOE = ModelConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=48, max_seq_len=64,
                        n_experts=4, top_k=2, expert_ffn_dim=16)


def build(config: ModelConfig, seed: int = 0) -> Transformer:
    with torch.device("meta"):
        model = Transformer(config)
    model.to_empty(device="cpu")
    model.init_weights(seed)
    return model


def moe_layer(shared: bool = False, aux: float = 0.01, z: float = 0.0) -> MoE:
    config = dataclasses.replace(MICRO_MOE, shared_expert=shared, aux_loss_coef=aux, z_loss_coef=z)
    return build(config).layers["0"].feed_forward


def naive(moe: MoE, x_BSD: torch.Tensor) -> torch.Tensor:
    """One token at a time: its top-k experts by the softmax, weights renormalized, expert by expert."""
    out = torch.zeros_like(x_BSD)
    w1, w2, w3 = moe.experts.w1, moe.experts.w2, moe.experts.w3
    for b in range(x_BSD.shape[0]):
        for s in range(x_BSD.shape[1]):
            x = x_BSD[b, s]
            probs = (moe.router.weight @ x).softmax(-1)
            top = probs.topk(moe.top_k).indices
            for e in top.tolist():
                y = w2[e] @ (F.silu(w1[e] @ x) * (w3[e] @ x))
                out[b, s] += probs[e] / probs[top].sum() * y
            if moe.shared is not None:
                out[b, s] += moe.shared(x)
    return out


@pytest.fixture(params=["grouped", "loop"])
def expert_path(request, monkeypatch):
    """Run a test on both paths of GroupedExperts: torch's grouped GEMM (where it works) and the loop."""
    if request.param == "loop":
        monkeypatch.setattr(compat, "grouped_mm", lambda *args: None)
    else:
        assert compat.grouped_mm(torch.ones(2, 8), torch.ones(1, 8, 4), torch.tensor([2], dtype=torch.int32)) \
            is not None, "this torch runs no grouped GEMM on the CPU in fp32"
    return request.param


def test_route_picks_the_top_k_and_renormalizes():
    logits = torch.tensor([[0.0, 1.0, 3.0, 2.0], [5.0, 0.0, 0.0, 4.0]])
    weights, experts = route(logits, 2)
    assert experts.tolist() == [[2, 3], [0, 3]]
    probs = logits.softmax(-1)
    torch.testing.assert_close(weights[0], probs[0, [2, 3]] / probs[0, [2, 3]].sum())
    torch.testing.assert_close(weights.sum(-1), torch.ones(2))


@pytest.mark.parametrize("shared", [False, True], ids=["routed", "shared"])
def test_moe_equals_a_per_token_loop(expert_path, shared):
    torch.manual_seed(0)
    moe = moe_layer(shared=shared)
    x = torch.randn(2, 5, MICRO_MOE.dim, requires_grad=True)
    got = moe(x)
    x_ref = x.detach().clone().requires_grad_()
    want = naive(moe, x_ref)
    torch.testing.assert_close(got, want)
    grad = torch.randn_like(got)
    moe.aux_loss_coef = 0.0  # the loop has no auxiliary loss: compare the output's gradients alone
    got_grads = torch.autograd.grad(moe(x), [x, moe.experts.w1, moe.experts.w2, moe.router.weight], grad)
    want_grads = torch.autograd.grad(want, [x_ref, moe.experts.w1, moe.experts.w2, moe.router.weight], grad)
    for a, b in zip(got_grads, want_grads):
        torch.testing.assert_close(a, b)


def test_every_token_to_one_expert_drops_none(expert_path):
    """Dropless: with the router forcing expert 3 first for every token, each token still gets all k experts."""
    torch.manual_seed(0)
    moe = moe_layer()
    with torch.no_grad():
        moe.router.weight.zero_()
        moe.router.weight[3] = 1.0
        moe.router.weight[1] = 0.5
    x = torch.rand(2, 6, MICRO_MOE.dim) + 0.1  # positive: expert 3 and then 1 win for every token
    out = moe(x)
    assert moe.last_tokens_per_expert.tolist() == [0, 12, 0, 12]
    torch.testing.assert_close(out, naive(moe, x))


def test_tokens_per_expert_counts_every_assignment():
    torch.manual_seed(1)
    moe = moe_layer()
    x = torch.randn(3, 7, MICRO_MOE.dim)
    moe(x)
    _, experts = route(moe.router(x.reshape(-1, MICRO_MOE.dim)), moe.top_k)
    assert moe.last_tokens_per_expert.dtype == torch.int64
    assert moe.last_tokens_per_expert.tolist() == torch.bincount(experts.flatten(), minlength=4).tolist()
    assert int(moe.last_tokens_per_expert.sum()) == 3 * 7 * moe.top_k


def switch_loss(logits_SE: torch.Tensor, k: int) -> torch.Tensor:
    """Switch's E·Σ_e f_e·P_e of one sequence, written out: f_e the share of its k·S assignments to e."""
    num_tokens, num_experts = logits_SE.shape
    probs = logits_SE.softmax(-1)
    chosen = probs.topk(k).indices
    loss = 0.0
    for e in range(num_experts):
        f_e = (chosen == e).sum() / (num_tokens * k)
        loss = loss + f_e * probs[:, e].mean()
    return num_experts * loss


def test_aux_loss_is_switchs_per_sequence_mean_and_its_gradient_reaches_the_router():
    torch.manual_seed(2)
    moe = moe_layer(aux=0.1)
    x = torch.randn(3, 8, MICRO_MOE.dim)
    out = moe(x)
    logits = moe.router(x).detach()
    want = 0.1 * torch.stack([switch_loss(logits[b], 2) for b in range(3)]).mean()
    torch.testing.assert_close(moe.last_aux_loss, want)
    (0.0 * out).sum().backward()  # the output contributes nothing: the router's gradient is the aux loss's
    weight = moe.router.weight.detach().clone().requires_grad_()
    logits = x @ weight.T
    chosen = logits.softmax(-1).topk(2).indices  # f has no gradient: the same choice, held fixed
    f = F.one_hot(chosen.flatten(1), 4).float().mean(1)
    (0.1 * 4 * (f * logits.softmax(-1).mean(1)).sum(-1).mean()).backward()
    assert moe.router.weight.grad.abs().sum() > 0
    torch.testing.assert_close(moe.router.weight.grad, weight.grad)


def test_aux_rows_spreads_the_mean_over_a_larger_batch():
    """Two halves of a batch, each averaged over the whole batch's rows, give the whole batch's gradient."""
    torch.manual_seed(3)
    moe = moe_layer(aux=0.5, z=0.01)
    x = torch.randn(4, 6, MICRO_MOE.dim)
    (0.0 * moe(x)).sum().backward()
    whole = moe.router.weight.grad.clone()
    moe.router.weight.grad = None
    moe.aux_rows = 4
    for half in x.split(2):
        (0.0 * moe(half)).sum().backward()
    torch.testing.assert_close(moe.router.weight.grad, whole)


def test_z_loss_value():
    torch.manual_seed(4)
    moe = moe_layer(aux=0.0, z=0.01)
    x = torch.randn(2, 5, MICRO_MOE.dim)
    moe(x)
    torch.testing.assert_close(moe.last_aux_loss, 0.01 * moe.router(x).logsumexp(-1).square().mean())


def test_balanced_routing_loss_is_one():
    """Uniform probabilities and an even spread of assignments: E·Σ (1/E)(1/E) = 1."""
    logits = torch.zeros(1, 4, 4)
    experts = torch.tensor([[[0, 1], [2, 3], [0, 1], [2, 3]]])
    torch.testing.assert_close(load_balancing_loss(logits, experts), torch.ones(1))


@pytest.mark.parametrize("config", [MICRO_MOE, dataclasses.replace(MICRO_MOE, shared_expert=True),
                                    MODEL_CONFIGS["tiny-moe"]], ids=["micro", "micro-shared", "tiny-moe"])
def test_counts_match_instantiated(config):
    model = Transformer(config)
    assert model.num_params() == config.num_params()
    per_expert = 3 * config.dim * config.expert_hidden_dim
    unused = config.n_layers * (config.n_experts - config.top_k) * per_expert
    assert config.num_active_params() == model.num_params() - unused


def test_mixtral_counts():
    """Mixtral 8x7B: 46.7B parameters, 12.9B active (Jiang et al. 2024: "47B", "13B active")."""
    config = MODEL_CONFIGS["mixtral-8x7b"]
    assert config.num_params() == 46_702_792_704
    assert config.num_active_params() == 12_879_925_248


def test_expert_blocks_initialize_as_slices_of_the_whole():
    """The expert dimension comes first and each expert has its own generator: a block is a slice of the whole."""
    model = Transformer(MICRO_MOE)
    name, shape = "layers.1.feed_forward.experts.w1", (4, 16, 32)
    whole = model.param_init(name, shape, seed=7)
    block = model.param_init_experts(name, shape, 7, range(2, 4))
    torch.testing.assert_close(block, whole[2:4], rtol=0, atol=0)
    assert not torch.equal(whole[0], whole[1])


def test_tiny_moe_forward_backward():
    model = build(MODEL_CONFIGS["tiny-moe"])
    tokens = torch.randint(0, 512, (2, 16))
    logits = model(tokens)
    F.cross_entropy(logits.flatten(0, 1), tokens.flatten()).backward()
    assert logits.shape == (2, 16, 512)
    for name, p in model.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name
    for layer in model.layers.values():
        assert layer.feed_forward.last_aux_loss.dtype == torch.float32
        assert int(layer.feed_forward.last_tokens_per_expert.sum()) == 2 * 16 * 2


@pytest.mark.parametrize("changes, message", [
    ({"n_experts": 2, "top_k": 3}, "top_k=3 exceeds n_experts=2"),
    ({"n_experts": -1}, "n_experts=-1 is invalid"),
    ({"aux_loss_coef": -0.1}, "aux_loss_coef=-0.1 is invalid"),
])
def test_bad_expert_fields_end_in_one_line(changes, message):
    with pytest.raises(ModelConfigError, match=message) as info:
        dataclasses.replace(MICRO_MOE, **changes)
    assert "\n" not in str(info.value)
