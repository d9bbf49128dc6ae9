"""Context parallelism: the load-balanced split, and ring attention equal to one process's causal SDPA."""

import dataclasses
import functools

import pytest
import torch
import torch.nn.functional as F

from paratrain.comm import Comm
from paratrain.mesh import MeshShape, build_mesh
from paratrain.parallel.context.ring import Ring, ring_attention
from paratrain.parallel.context.split import (
    ContextSplitError, causal_pairs, positions, shard_sequence, unshard_sequence,
)
from paratrain.testing import run_on_ranks
from parallel_cases import Layout, variant


def test_each_rank_holds_chunk_i_and_its_mirror_and_the_causal_work_is_even():
    assert positions(16, 2, 0).tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert positions(16, 2, 1).tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    x = torch.arange(3 * 24).view(3, 24)
    pieces = [shard_sequence(x, 3, r) for r in range(3)]
    for r, piece in enumerate(pieces):
        assert torch.equal(piece, x[:, positions(24, 3, r)])
    assert torch.equal(unshard_sequence(pieces), x)
    assert len({causal_pairs(4096, 4, r) for r in range(4)}) == 1
    with pytest.raises(ContextSplitError, match="use --seq-len 18"):
        shard_sequence(x[:, :23], 3, 0)


def _attention_case(rank, world, heads, kv_heads, rendezvous, kernel="cpu flash", documents=False):
    from paratrain.parallel.context import kernels, ring as ring_module

    if kernel.startswith("cuda"):  # the CUDA calls, through CPU emulations of the ops' memory layouts
        import cuda_ops_emulation

        cuda_ops_emulation.install()
    # "explicit": the fallback for devices and dtypes without a fused kernel, on the same ring
    chosen = {k.name: k for k in (kernels.CPU_FLASH, kernels.EXPLICIT, kernels.CUDA_EFFICIENT, kernels.CUDA_FLASH)}
    ring_module.attention_kernel = lambda *_, **__: chosen[kernel]
    mesh = build_mesh(MeshShape(cp=world))
    comm = Comm(mesh, rendezvous=rendezvous)
    g = torch.Generator().manual_seed(7)
    b, s, e = 2, 8 * world, 8
    q, k, v = (torch.randn(b, n, s, e, generator=g) for n in (heads, kv_heads, kv_heads))
    grad = torch.randn(b, heads, s, e, generator=g)
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    mask = None
    if documents:  # documents across the chunks' bounds, one starting a later chunk: rows a block hides wholly
        from paratrain.models.llama import document_layout

        ends = torch.zeros(b, s, dtype=torch.long)
        ends[0, [2, 7, 8 * world - 9, 8 * world - 3]] = 1
        ends[1, [4 * world - 1, 5 * world]] = 1
        mask = document_layout(ends, 1)[1]
    expected = F.scaled_dot_product_attention(*full, attn_mask=mask, is_causal=mask is None,
                                              enable_gqa=heads != kv_heads)
    expected.backward(grad)
    local = [shard_sequence(t, world, rank, dim=2).requires_grad_() for t in (q, k, v)]
    ring = Ring(comm, seq_len=s)
    out = ring_attention(*local, ring, mask=None if mask is None else mask[:, :, positions(s, world, rank)])
    forward_bytes = comm.bytes_by_axis().get("cp", 0)
    out.backward(shard_sequence(grad, world, rank, dim=2))
    errors = [(out - shard_sequence(expected, world, rank, dim=2)).abs().max().item()]
    errors += [(t.grad - shard_sequence(f.grad, world, rank, dim=2)).abs().max().item() for t, f in zip(local, full)]
    return errors, forward_bytes, comm.bytes_by_axis()["cp"] - forward_bytes


@pytest.mark.parametrize("world, heads, kv_heads, rendezvous, kernel, documents",
                         [(2, 4, 2, False, "cpu flash", False), (2, 2, 2, True, "cpu flash", False),
                          (4, 4, 1, False, "cpu flash", False), (4, 4, 2, False, "explicit", False),
                          (2, 4, 2, False, "cuda efficient", False), (2, 4, 2, False, "cuda flash", False),
                          (2, 4, 2, False, "cpu flash", True), (4, 4, 2, False, "explicit", True)])
def test_ring_attention_equals_causal_sdpa_forward_and_backward(world, heads, kv_heads, rendezvous, kernel, documents):
    """fp32 within 1e-5, with the fused CPU kernel, the explicit fallback and the CUDA calls (emulated with
    their kernels' memory layouts), and with a document mask (the kernels that take one); K/V bytes on the cp
    axis as the ring's formula: forward cp−1 K/V blocks, backward cp−1 K/V blocks and cp fp32 dK/dV sums
    (rendezvous: each transfer acknowledged, as NCCL's sends wait)."""
    results = run_on_ranks(_attention_case, world, heads, kv_heads, rendezvous, kernel, documents, timeout=120)
    block = 2 * 2 * kv_heads * 8 * 8 * 4  # K and V, B=2, Hk, 2c = 8 local tokens (of 8·cp), E=8, fp32
    for errors, forward_bytes, backward_bytes in results:
        assert max(errors) < 1e-5, errors
        assert forward_bytes == (world - 1) * block
        assert backward_bytes == (world - 1) * block + world * block


def _kernel_calls(rank, world):
    """(queries, keys, causal) of every kernel call of one ring attention, forward then backward."""
    from paratrain.parallel.context import kernels, ring as ring_module

    calls = []
    chosen = kernels.attention_kernel("cpu", torch.float32, 8)

    def forward(q, k, v, causal, scale):
        calls.append(("F", q.shape[2], k.shape[2], causal))
        return chosen.forward(q, k, v, causal, scale)

    def backward(dout, q, k, v, out, lse, causal, scale):
        calls.append(("B", q.shape[2], k.shape[2], causal))
        return chosen.backward(dout, q, k, v, out, lse, causal, scale)

    ring_module.attention_kernel = lambda *_, **__: kernels.BlockKernel("recorded", forward, backward)
    q, k, v = (torch.randn(1, 2, 2 * 4, 8, requires_grad=True) for _ in range(3))  # 2c = 8 local tokens
    ring_attention(q, k, v, Ring(Comm(build_mesh(MeshShape(cp=world))), seq_len=8 * world)).sum().backward()
    return calls


def test_each_ring_step_computes_only_the_unmasked_half_of_another_ranks_block():
    """cp 4, 2c = 8 local tokens: step 0 one causal 8×8 call; an earlier rank's block 8 queries × its first 4
    keys, a later rank's 4 queries × 8 keys: half a block's work each, forward and backward alike."""
    c, world = 4, 4
    for rank, calls in enumerate(run_on_ranks(_kernel_calls, world, timeout=120)):
        sources = [(rank - step) % world for step in range(world)]
        expected = [(2 * c, 2 * c, True)] + [(2 * c, c, False) if j < rank else (c, 2 * c, False) for j in sources[1:]]
        assert calls == [("F", *e) for e in expected] + [("B", *e) for e in expected], (rank, calls)
        assert sum(q * k for _, q, k, causal in calls if not causal) == 2 * (world - 1) * 2 * c * c


def _hf_model():
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                                   attn_implementation="sdpa")
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg)


def _make(kind):
    import dataclasses

    from tests.parallel_cases import TINY, make_model

    if kind == "hf":
        return _hf_model()
    return make_model(dataclasses.replace(TINY, n_layers=4)) if kind == "ref4" else make_model()


@dataclasses.dataclass(frozen=True)
class Case(Layout):
    """An entry of the layout matrix with a model kind: "ref" (the tiny Transformer), "ref4" (with 4 layers), "hf"."""

    kind: str = "ref"


def _train_case(case: Case, world: int):
    from paratrain.parallel.api import DataParallel, PipelineParallel, parallelize
    from paratrain.train import train_step
    from tests.parallel_cases import adamw, batches, parallel_run

    assert case.world == world, (case, world)
    mesh = build_mesh(case.mesh_shape())
    if case.pp == 1:
        model, optimizer = parallelize(_make(case.kind), mesh, optimizer=adamw, data=DataParallel(zero=case.zero),
                                       activation_checkpointing=case.recompute)
        # The engine averages over the dp × cp ranks; each backward is of a token-loss sum over the global count.
        losses = parallel_run(model, optimizer, batches(steps=3), mesh.coord("dp"), case.dp,
                              lambda t: model.comm.all_reduce(t, "dp_cp"), loss_scale=world)
    else:  # the trainer's step: micro-batches of 2 sequences through the schedule, gradients summed
        pipeline = PipelineParallel(schedule=case.schedule, virtual_stages=case.virtual_stages)
        model, optimizer = parallelize(_make(case.kind), mesh, optimizer=adamw, pipeline=pipeline,
                                       data=DataParallel(grad_reduction="sum"),
                                       activation_checkpointing=case.recompute)
        rows = 8 // case.microbatches
        losses = [train_step(model, optimizer, [(x[i:i + rows], y[i:i + rows]) for i in range(0, 8, rows)], 1.0).loss
                  for x, y in batches(steps=3)]
    return losses, model.full_state_dict(), model.comm.summary().get("cp", {})


def _train_cases(rank, world, cases):
    return {name: _train_case(case, world) for name, case in cases.items()}


_RESULTS = {}


def _results(world):
    if world not in _RESULTS:
        cases = {name: case for name, case in CASES.items() if case.world == world}
        _RESULTS[world] = run_on_ranks(_train_cases, world, cases, timeout=300)
    return _RESULTS[world]


def _cases(*names: str, kind: str = "ref") -> dict[str, Case]:
    return {(f"{kind}_" if kind != "ref" else "") + name: variant(Case, name, kind=kind) for name in names}


CASES = {**_cases("cp2", "cp2_ac-full", "cp2_ac-selective", "cp2_ac-2", "dp2_cp2_zero3"), **_cases("cp2", kind="hf"),
         **_cases("pp2_gpipe_m4_cp2", "pp2_interleaved_v2_m4_cp2", "pp2_zb-h1_m4_cp2_ac-full", kind="ref4")}


@functools.cache
def _reference(kind: str):
    """One process's 3 steps of a model kind, once for every case of that kind."""
    from tests.parallel_cases import batches, reference_run

    return reference_run(_make(kind), batches(steps=3))


@pytest.mark.parametrize("name", list(CASES))
def test_training_with_cp_equals_one_process(name):
    """Losses and parameters after 3 steps (fp32) equal one process's on the same global batches: the
    reference model and a Hugging Face Llama with SDPA attention at cp2; cp2 with activation checkpointing
    (full, selective, every 2nd block), whose recompute runs attention through the ring again; dp2 × cp2
    under ZeRO-3; pp2 × cp2 under GPipe, interleaved (2 virtual stages) and ZB-H1 with full recomputation."""
    from paratrain.error_model import FP32_ADAMW
    from tests.parallel_cases import assert_matches_reference

    case = CASES[name]
    ref_losses, ref_params = _reference(case.kind)
    for per_rank in _results(case.world):
        losses, params, cp_traffic = per_rank[name]
        assert_matches_reference(losses, params, ref_losses, ref_params, FP32_ADAMW)
        assert cp_traffic["send"]["calls"] > 0  # the ring ran, on the cp axis


def test_a_recompute_sends_the_kv_blocks_around_the_ring_again():
    """Recomputing a block in backward runs its ring forward again: each recomputed layer adds one forward's
    K/V sends per step, (cp − 1) blocks of 2·B·Hk·2c·E·4 bytes; selective keeps the matmuls' outputs but
    no communication, so it re-sends them too."""
    plain = _results(2)[0]["cp2"][2]["send"]["bytes"]
    # K and V; B = 8, 4 heads (on the CPU the reference model repeats its 2 kv heads before SDPA), 2c = 8 local
    # tokens of 16, E = 8; fp32
    block = 2 * 8 * 4 * 8 * 8 * 4
    steps, layers = 3, 3
    for checkpointing, recomputed in (("full", layers), ("selective", layers), (2, 2)):
        sent = _results(2)[0][f"cp2_ac-{checkpointing}"][2]["send"]["bytes"]
        assert sent - plain == steps * recomputed * block, checkpointing


def _fake_cp_comm(cp=2):
    from paratrain.mesh import Mesh

    return Comm(Mesh(shape=MeshShape(cp=cp), rank=0, groups={}))


def test_attention_the_ring_cannot_run_ends_in_one_line_naming_the_fix():
    from paratrain.parallel.context.sdpa import ContextParallelError, ContextSharding, RingSDPA

    q = torch.randn(1, 2, 4, 8)
    with pytest.raises(ContextParallelError, match=r"is_causal=False and no mask; call it with is_causal=True"):
        with RingSDPA(None):
            F.scaled_dot_product_attention(q, q, q)
    ring = Ring(_fake_cp_comm(), seq_len=8)  # rank 0 of cp 2 holds positions 0, 1, 6, 7
    with pytest.raises(ContextParallelError, match=r"takes an attn_mask that is boolean, \[batch, 1, this rank's 4 "
                                                   r"queries, the sequence's 8 keys\]"):
        with RingSDPA(ring):
            F.scaled_dot_product_attention(q, q, q, attn_mask=torch.ones(4, 4, dtype=torch.bool))
    later = torch.ones(8, 8, dtype=torch.bool).tril()[positions(8, 2, 0)]
    later[1, 2] = True  # position 1 shown position 2
    with pytest.raises(ContextParallelError, match="shows a query a key after it"):
        with RingSDPA(ring):
            F.scaled_dot_product_attention(q, q, q, attn_mask=later[None, None])
    with pytest.raises(ContextParallelError, match="dropout_p=0.1"):
        with RingSDPA(None):
            F.scaled_dot_product_attention(q, q, q, dropout_p=0.1, is_causal=True)

    class NoPositions(torch.nn.Module):
        def forward(self, tokens):
            return tokens

    class NoSdpa(torch.nn.Module):
        def forward(self, tokens, positions=None):
            return tokens.float()

    with pytest.raises(ContextParallelError, match="takes neither positions nor position_ids"):
        ContextSharding(NoPositions(), _fake_cp_comm())
    with pytest.raises(ContextParallelError, match="take positions or position_ids by keyword, and none of this "
                                                   "one's does; give its attention blocks one"):
        ContextSharding(torch.nn.Sequential(torch.nn.Linear(4, 4)), _fake_cp_comm())  # also as pipeline stages
    # A Sequential's layers that take positions get them; the stage without one (here only the embedding) does
    # not look for an SDPA call, the stage with one does.
    sequential = torch.nn.Sequential(torch.nn.Embedding(4, 4), NoSdpa())
    sharding = ContextSharding(sequential, _fake_cp_comm())
    assert sharding.position_keyword == "positions" and sharding.positioned == {"1"}
    assert sharding.forward(sequential[:1], (torch.zeros(1, 8, dtype=torch.long),), {}).shape == (1, 4, 4)
    with pytest.raises(ContextParallelError, match="found no F.scaled_dot_product_attention call in Sequential"):
        sharding.forward(sequential, (torch.zeros(1, 8, dtype=torch.long),), {})
    with pytest.raises(ContextParallelError, match="found no F.scaled_dot_product_attention call in NoSdpa"):
        ContextSharding(NoSdpa(), _fake_cp_comm()).forward(NoSdpa(), (torch.zeros(1, 8, dtype=torch.long),), {})


def _steps_under_the_meta_trap(rank, world):
    """Two training steps at cp2 with the default device set to meta (as `tests/parallel/test_gpu_traps.py` sets it):
    a split, ring buffer or exchange tensor made without naming a device lands on meta and fails."""
    import functools

    from paratrain.parallel.api import parallelize
    from paratrain.train import train_step
    from tests.parallel_cases import batches, make_model

    mesh = build_mesh(MeshShape(cp=world))
    model, optimizer = parallelize(make_model(), mesh, optimizer=functools.partial(torch.optim.SGD, lr=0.1))
    losses, data = [], batches(steps=2)
    with torch.device("meta"):
        for x, y in data:
            losses.append(train_step(model, optimizer, [(x, y)], float(y.numel())).loss)
    return losses


def test_the_ring_allocates_nothing_on_the_default_device():
    losses = run_on_ranks(_steps_under_the_meta_trap, 2, timeout=120)
    assert losses[0] == losses[1] and len(losses[0]) == 2 and all(loss == loss for loss in losses[0])


def _bf16_case(rank, world):
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, n, 64, 16, generator=g) for n in (4, 2, 2))
    grad = torch.randn(2, 4, 64, 16, generator=g)
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    expected = F.scaled_dot_product_attention(*full, is_causal=True, enable_gqa=True)
    expected.backward(grad)
    local = [shard_sequence(t, world, rank, dim=2).bfloat16().requires_grad_() for t in (q, k, v)]
    out = ring_attention(*local, Ring(Comm(build_mesh(MeshShape(cp=world))), seq_len=64))
    out.backward(shard_sequence(grad, world, rank, dim=2).bfloat16())
    dtypes = [out.dtype] + [t.grad.dtype for t in local]
    errors = [(out.float() - shard_sequence(expected, world, rank, dim=2)).abs().max().item()]
    errors += [(t.grad.float() - shard_sequence(f.grad, world, rank, dim=2)).abs().max().item()
               for t, f in zip(local, full)]
    return dtypes, errors


def test_ring_attention_in_bf16_is_fp32_sdpa_within_bf16_rounding():
    """The fused kernel in bf16 (merges and dK/dV sums in fp32): output and gradients in bf16, within 3e-2 of
    one process's fp32 SDPA on O(1) values (bf16 keeps 8 bits of mantissa)."""
    for dtypes, errors in run_on_ranks(_bf16_case, 2, timeout=120):
        assert dtypes == [torch.bfloat16] * 4
        assert max(errors) < 3e-2, errors


def hf_sequential_factory():
    """What `paratrain verify --model-factory test_context_parallel:hf_sequential_factory` builds: a transformers
    Llama with SDPA attention laid out as an nn.Sequential of its own modules, with its tensor-parallel plan."""
    from paratrain import ModelSpec
    from paratrain.interop.hf_stages import as_sequential, sequential_plan
    from paratrain.models.tp_plans import HF_LLAMA_PLAN

    model = _hf_model()
    model.config.tie_word_embeddings = False
    sequential = as_sequential(model)
    return ModelSpec(sequential, plan=sequential_plan(HF_LLAMA_PLAN, sequential))


def test_verify_passes_the_cp_layouts_on_a_hugging_face_llama_through_the_model_factory(capsys, monkeypatch):
    """The acceptance layouts of context parallelism, pipelined one included, on a transformers Llama with SDPA."""
    from paratrain.cli import main
    from paratrain.faults import FAULT_ENV

    monkeypatch.delenv(FAULT_ENV, raising=False)
    layouts = ["cp2", "dp2,cp2,zero3", "cp2,tp2", "pp2,cp2,1f1b"]
    assert main(["verify", "--model-factory", "test_context_parallel:hf_sequential_factory", "--steps", "3",
                 "--seq-len", "128", "--layouts", ";".join(layouts)]) == 0
    rows = capsys.readouterr().out.split("layout ")[-1].splitlines()[1:]
    assert [r.split()[0] for r in rows] == layouts and all(r.split()[5] == "PASS" for r in rows), rows


def test_as_sequential_computes_the_hugging_face_models_logits():
    from paratrain.interop.hf_stages import as_sequential
    from paratrain.models.hf import SequentialError

    model = _hf_model()
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(as_sequential(model)(tokens), model(tokens).logits, rtol=0, atol=0)
    import transformers

    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=1, n_head=4))
    with pytest.raises(SequentialError, match="as_sequential lays out llama, .* models, not gpt2; write the model"):
        as_sequential(gpt2)
