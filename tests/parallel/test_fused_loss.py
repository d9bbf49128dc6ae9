"""The loss with the output head fused in (`paratrain.parallel.loss`): the head's matmul and the cross-entropy in chunks
of tokens equal the unfused loss, value and every gradient (fp32, 1e-6 relative), alone and inside `parallelize`:
ignored labels (a chat loss mask), tied embeddings, ZeRO-3, a Hugging Face model, tp2 vocabulary-parallel with and
without sequence parallelism, and the last stage of pp2."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import paratrain
from paratrain.models import ModelConfig, Transformer
from paratrain.parallel.loss import LossChunkError, head_name, linear_cross_entropy
from paratrain.precision import cross_entropy
from paratrain.testing import run_on_ranks

TOL = 1e-6
CFG = ModelConfig(vocab_size=96, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, max_seq_len=16)
ROWS, SEQ = 4, 12


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.detach().double(), want.detach().double()
    return float((got - want).norm() / want.norm().clamp_min(1e-30))


def _operands(n: int, d: int, v: int, dtype=torch.float32, bias: bool = True, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g, dtype=dtype).requires_grad_()
    w = (torch.randn(v, d, generator=g, dtype=dtype) * 0.5).requires_grad_()
    b = torch.randn(v, generator=g, dtype=dtype).requires_grad_() if bias else None
    targets = torch.randint(0, v, (n,), generator=g)
    targets[torch.rand(n, generator=g) < 0.3] = -100  # a loss mask: these tokens are ignored
    return x, w, b, targets


def _grads(loss: torch.Tensor, *tensors):
    return torch.autograd.grad(loss, [t for t in tensors if t is not None])


@pytest.mark.parametrize("chunk", [1, 5, 16, 37, 1000])
@pytest.mark.parametrize("reduction", ["sum", "mean", "none"])
def test_chunks_equal_the_whole_logits(chunk, reduction):
    x, w, b, targets = _operands(37, 16, 101)
    want = cross_entropy(F.linear(x, w, b), targets, reduction=reduction)
    got = linear_cross_entropy(x, w, targets, b, chunk=chunk, reduction=reduction)
    assert _relative(got, want) < TOL
    weights = torch.rand(want.shape) if reduction == "none" else torch.ones(())  # any upstream gradient
    for g, r in zip(_grads((got * weights).sum(), x, w, b), _grads((want * weights).sum(), x, w, b)):
        assert _relative(g, r) < TOL


def test_ignored_tokens_get_no_gradient_and_no_loss():
    x, w, _, targets = _operands(20, 8, 30, bias=False)
    targets[:] = -100
    targets[3] = 7
    loss = linear_cross_entropy(x, w, targets, chunk=6, reduction="none")
    assert (loss[targets == -100] == 0).all() and loss[3] > 0
    (grad_x,) = torch.autograd.grad(loss.sum(), [x])
    assert (grad_x[targets == -100] == 0).all() and grad_x[3].abs().sum() > 0


def test_bf16_is_the_unfused_loss_within_bf16_rounding():
    x, w, _, targets = _operands(64, 32, 200, dtype=torch.bfloat16, bias=False)
    want = cross_entropy(F.linear(x, w), targets)
    got = linear_cross_entropy(x, w, targets, chunk=16)
    assert got.dtype == torch.float32 and _relative(got, want) < 1e-6  # the same bf16 logits, the loss in fp32
    for g, r in zip(_grads(got, x, w), _grads(want, x, w)):
        assert g.dtype == torch.bfloat16 and _relative(g, r) < 2e-2


def test_compiles():
    x, w, b, targets = _operands(37, 16, 101)
    compiled = torch.compile(functools.partial(linear_cross_entropy, chunk=8), backend="aot_eager", fullgraph=True)
    got, want = compiled(x, w, targets, b), linear_cross_entropy(x, w, targets, b, chunk=8)
    assert _relative(got, want) < TOL
    for g, r in zip(_grads(got, x, w, b), _grads(want, x, w, b)):
        assert _relative(g, r) < TOL


def test_labels_of_another_length_are_refused():
    x, w, _, targets = _operands(10, 8, 20, bias=False)
    with pytest.raises(LossChunkError, match="labels hold 9"):
        linear_cross_entropy(x, w, targets[:9])


# -- which head a model has -------------------------------------------------------------------------

def test_the_head_of_each_kind_of_model():
    assert head_name(Transformer(CFG)) == ("output", "")
    assert head_name(nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 10))) == ("1", "")
    name, why = head_name(nn.Sequential(nn.Embedding(10, 4), nn.ReLU()))
    assert name is None and "ReLU, not an nn.Linear" in why
    name, why = head_name(nn.Embedding(10, 4))
    assert name is None and "names no output head" in why


def test_a_model_that_caps_its_logits_is_refused():
    transformers = pytest.importorskip("transformers")
    config = transformers.Gemma2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                       num_attention_heads=2, num_key_value_heads=1, head_dim=16)
    name, why = head_name(transformers.Gemma2ForCausalLM(config))
    assert name is None and "final_logit_softcapping" in why


# -- inside parallelize, one process -----------------------------------------------------------------

@pytest.fixture
def mesh():
    yield paratrain.init_mesh()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def _batch(vocab: int = CFG.vocab_size, rows: int = ROWS, seq: int = SEQ, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, vocab, (rows, seq), generator=g)
    y = torch.randint(0, vocab, (rows, seq), generator=g)
    y[torch.rand(rows, seq, generator=g) < 0.25] = -100
    return x, y


def _step(module_fn, mesh, loss_chunk: int, micro: int = 2, **options):
    """(loss sum, master gradients, eval loss) of one step of two micro-batches through `parallelize`."""
    torch.manual_seed(0)
    model, _ = paratrain.parallelize(module_fn(), mesh, loss_chunk=loss_chunk, **options)
    x, y = _batch()
    rows = ROWS // micro
    result = model.train_step([(x[i:i + rows], y[i:i + rows]) for i in range(0, ROWS, rows)], 40.0)
    model.finish_gradients()
    return model, result.loss_sum, [g.clone() for g in model.grads()], model.eval_loss_sum(x, y)


def _assert_same(fused, whole):
    (m1, loss1, grads1, eval1), (m2, loss2, grads2, eval2) = fused, whole
    assert m1.loss_head is not None and m2.loss_head is None
    assert _relative(loss1, loss2) < TOL and _relative(eval1, eval2) < TOL
    assert len(grads1) == len(grads2)
    for g1, g2 in zip(grads1, grads2):
        assert _relative(g1, g2) < TOL


def _reference(cfg: ModelConfig = CFG):
    with torch.device("meta"):
        return Transformer(cfg)


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("zero", [0, 3])
def test_reference_model_fused_equals_whole_logits(mesh, tied, zero):
    module = functools.partial(_reference, ModelConfig(**{**CFG.__dict__, "tie_embeddings": tied}))
    data = paratrain.DataParallel(zero=zero)
    _assert_same(_step(module, mesh, 5, data=data), _step(module, mesh, 0, data=data))


def test_default_fuses_the_head(mesh):
    model, _ = paratrain.parallelize(_reference(), mesh)
    assert model.loss_head is not None and model.loss_head.chunk == paratrain.parallel.rules.DEFAULT_LOSS_CHUNK
    x, _ = _batch()
    assert model(x).shape == (ROWS, SEQ, CFG.vocab_size)  # unarmed, the head gives the logits


def test_hugging_face_model_fused_equals_whole_logits(mesh):
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=CFG.vocab_size, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)

    def build():
        torch.manual_seed(0)
        return transformers.LlamaForCausalLM(config)

    _assert_same(_step(build, mesh, 7), _step(build, mesh, 0))


def test_nn_sequential_fused_equals_whole_logits(mesh):
    def build():
        torch.manual_seed(0)
        return nn.Sequential(nn.Embedding(CFG.vocab_size, 16), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, CFG.vocab_size))

    _assert_same(_step(build, mesh, 3), _step(build, mesh, 0))


def test_a_chunk_for_a_model_without_a_head_is_refused(mesh):
    with pytest.raises(LossChunkError, match=r"--loss-chunk 64: .*names no output head.*--loss-chunk 0"):
        paratrain.parallelize(nn.Embedding(10, 4), mesh, loss_chunk=64)
    model, _ = paratrain.parallelize(nn.Embedding(10, 4), mesh)  # the default: whole logits, no refusal
    assert model.loss_head is None


# -- tp2 and pp2 -----------------------------------------------------------------------------------

def _layout_case(rank, world, layout: str):
    mesh = paratrain.init_mesh(dp=1, tp=2 if layout.startswith("tp") else 1, pp=2 if layout == "pp2" else 1)
    options = {"tensor": paratrain.TensorParallel(sequence_parallel=layout == "tp2_sp")} if layout != "pp2" else \
        {"pipeline": paratrain.PipelineParallel(schedule="1f1b")}
    module = functools.partial(_reference, ModelConfig(**{**CFG.__dict__, "tie_embeddings": layout == "tp2"}))
    fused, whole = _step(module, mesh, 5, **options), _step(module, mesh, 0, **options)
    last = layout != "pp2" or mesh.coord("pp") == 1
    assert (fused[0].loss_head is not None) == last and whole[0].loss_head is None
    assert _relative(fused[1], whole[1]) < TOL if last else fused[1] == whole[1] == 0
    assert _relative(fused[3], whole[3]) < TOL
    for g1, g2 in zip(fused[2], whole[2]):
        assert _relative(g1, g2) < TOL
    return float(fused[1])


@pytest.mark.multirank
@pytest.mark.parametrize("layout", ["tp2", "tp2_sp", "pp2"])
def test_layouts_fused_equal_whole_logits(layout):
    losses = run_on_ranks(_layout_case, 2, layout, timeout=120)
    assert losses[0] == losses[1] if layout != "pp2" else losses[1] > 0
