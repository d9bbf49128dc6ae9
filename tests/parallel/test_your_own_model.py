"""Models nobody here wrote, through the public API only, against a live single process.

- A plain `nn.Sequential` of a user's own blocks under pipeline parallelism: every schedule,
  pp2×dp2 ZeRO-1, pp2×tp2 with a user plan, and a custom loss (label-smoothed cross-entropy).
- Hugging Face `LlamaForCausalLM` (GQA) under `HF_LLAMA_PLAN` (region styles, modules called with
  keyword arguments): tp2, dp2×tp2 ZeRO-1 and ZeRO-3; one collective per region per pass, as the
  reference model pays. GPT-2 under `HF_GPT2_PLAN` (Conv1D layers).
- `paratrain verify --model-factory` on a module defined in this file.

Every run is 5 AdamW steps of the same global batches with clipping; one launch per world size.
"""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from paratrain import DataParallel, ModelSpec, PipelineParallel, TensorParallel, init_mesh, parallelize
from paratrain.cli import main
from paratrain.faults import FAULT_ENV
from paratrain.parallel.pipeline.stages import PipelineError
from paratrain.parallel.tensor import TensorParallelError
from paratrain.models.tp_plans import HF_GPT2_PLAN, HF_LLAMA_PLAN
from paratrain.parallel.tensor import Colwise, OutputHead, Rowwise, TPRegion, VocabEmbedding, apply_tensor_parallel
from paratrain.testing import run_on_ranks
from paratrain.train import train_step
from paratrain.error_model import FP32_ADAMW_MODEL
from parallel_cases import Layout, adamw, assert_matches_reference, batches, launch_once, variant

V, H, SEQ, BATCH, STEPS, LR = 64, 32, 16, 8, 5, 1e-2


# -- a user's own model: an nn.Sequential of their own blocks ------------------------------------------

class Residual(nn.Module):
    """The user's block: pre-norm MLP with a residual connection."""

    def __init__(self, dim: int):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x):
        return x + self.mlp(self.norm(x))


def sequential_model() -> nn.Sequential:
    torch.manual_seed(0)  # every process builds the same weights
    return nn.Sequential(nn.Embedding(V, H), *(Residual(H) for _ in range(4)), nn.LayerNorm(H), nn.Linear(H, V))


# The user's tensor-parallel plan over the Sequential's module names (layer 6 is the head).
SEQUENTIAL_PLAN = {"0": VocabEmbedding(), "*.mlp": TPRegion(), "*.mlp.0": Colwise(), "*.mlp.2": Rowwise(),
                   "6": OutputHead()}


def smoothed_loss(output, labels):
    """A loss other than plain cross-entropy: label smoothing, summed over the target tokens."""
    return F.cross_entropy(output.flatten(0, 1).float(), labels.flatten(), ignore_index=-100, reduction="sum",
                           label_smoothing=0.1)


def model_factory() -> ModelSpec:
    """What `paratrain verify --model-factory test_your_own_model:model_factory` builds in every process."""
    return ModelSpec(sequential_model(), plan=SEQUENTIAL_PLAN)


@dataclasses.dataclass(frozen=True)
class Case(Layout):
    builder: str = "sequential"  # "sequential", "llama", "gpt2"
    custom_loss: bool = False


def hf_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=V, hidden_size=H, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
                         tie_word_embeddings=False, attn_implementation="eager")
    return LlamaForCausalLM(config)


def hf_gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=V, n_embd=H, n_layer=2, n_head=4, n_positions=SEQ, bos_token_id=0, eos_token_id=0,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, attn_implementation="eager")
    return GPT2LMHeadModel(config)


BUILDERS = {"sequential": sequential_model, "llama": hf_llama, "gpt2": hf_gpt2}
PLANS = {"sequential": SEQUENTIAL_PLAN, "llama": HF_LLAMA_PLAN, "gpt2": HF_GPT2_PLAN}
CASES = {  # pipelines run 2·pp micro-batches per data rank
    **{f"pp2_{s}": variant(Case, f"pp2_{s}_m4") for s in ("gpipe", "1f1b", "zb-h1")},
    "pp2_interleaved_v2": variant(Case, "pp2_interleaved_v2_m4"),
    "pp2_custom_loss": variant(Case, "pp2_1f1b_m4", custom_loss=True),
    "pp2_dp2_zero1": variant(Case, "pp2_1f1b_m4_dp2_zero1"),
    "pp2_tp2_user_plan": variant(Case, "pp2_1f1b_m4_tp2"),
    "llama_tp2": variant(Case, "tp2", builder="llama"),
    "llama_dp2_tp2_zero1": variant(Case, "dp2_tp2_zero1", builder="llama"),
    "llama_dp2_tp2_zero3": variant(Case, "dp2_tp2_zero3", builder="llama"),
    "gpt2_tp2": variant(Case, "tp2", builder="gpt2"),
}
PROBE = torch.randint(0, V, (2, SEQ), generator=torch.Generator().manual_seed(99))


def _loss_fn(case: Case):
    return smoothed_loss if case.custom_loss else None


def _run(case: Case, mesh):
    model, optimizer = parallelize(
        BUILDERS[case.builder](), mesh, optimizer=functools.partial(adamw, lr=LR),
        data=DataParallel(zero=case.zero, grad_reduction="sum"),
        tensor=TensorParallel(plan=PLANS[case.builder] if case.tp > 1 else None),
        pipeline=PipelineParallel(schedule=case.schedule, virtual_stages=case.virtual_stages))
    dp, rank = mesh.size("dp"), mesh.coord("dp")
    rows = BATCH // dp
    micro = rows // case.microbatches
    losses, tp_calls = [], []
    for step, (x, y) in enumerate(batches(vocab=V, steps=STEPS, batch=BATCH, seq=SEQ), start=1):
        x, y = x[rank * rows:(rank + 1) * rows], y[rank * rows:(rank + 1) * rows]
        model.comm.reset()
        outcome = train_step(model, optimizer, [(x[i:i + micro], y[i:i + micro]) for i in range(0, rows, micro)],
                             1.0, loss_fn=_loss_fn(case))
        losses.append(outcome.loss)
        tp_calls.append(model.comm.summary().get("tp", {}).get("all_reduce", {}).get("calls", 0))
    logits = None if case.pp > 1 else model.full_logits(model(PROBE).logits).detach()
    return {"losses": losses, "params": model.full_state_dict(), "logits": logits, "tp_all_reduces": tp_calls}


def _all_cases(rank, world):
    out = {}
    for name, case in CASES.items():
        if case.world == world:
            out[name] = _run(case, init_mesh(dp=case.dp, tp=case.tp, pp=case.pp, dp_shard=case.dp_shard or None))
    return out


def _reference(case: Case) -> dict:
    """One process, plain PyTorch: the whole global batch, the same loss, AdamW and clipping (once per model and
    loss: every layout of it compares with the same run)."""
    return _one_process(case.builder, case.custom_loss)


@functools.cache
def _one_process(builder: str, custom_loss: bool) -> dict:
    case = Case(builder=builder, custom_loss=custom_loss)
    model = BUILDERS[case.builder]()
    optimizer = adamw(list(model.parameters()), lr=LR)
    loss_fn = _loss_fn(case) or (lambda out, y: F.cross_entropy(out.flatten(0, 1).float(), y.flatten(),
                                                               ignore_index=-100, reduction="sum"))
    losses = []
    for x, y in batches(vocab=V, steps=STEPS, batch=BATCH, seq=SEQ):
        out = model(x)
        loss = loss_fn(getattr(out, "logits", out), y) / (y != -100).sum()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    logits = model(PROBE).logits.detach() if case.builder != "sequential" else None
    return {"losses": losses, "params": {n: p.detach() for n, p in model.named_parameters()}, "logits": logits}


_RESULTS: dict = {}


@pytest.mark.parametrize("name", list(CASES))
def test_a_model_nobody_here_wrote_matches_one_process(name):
    case = CASES[name]
    ref = _reference(case)
    for per_rank in launch_once(_RESULTS, case.world, _all_cases, timeout=600):
        got = per_rank[name]
        assert_matches_reference(got["losses"], got["params"], ref["losses"], ref["params"], FP32_ADAMW_MODEL)
        if ref["logits"] is not None:
            torch.testing.assert_close(got["logits"], ref["logits"], rtol=1e-4, atol=1e-4)


def _reference_model_calls(rank, world):
    """tp all-reduces per step of paratrain's own Transformer of the same shape as the HF Llama above."""
    from paratrain.models import ModelConfig, Transformer

    cfg = ModelConfig(vocab_size=V, dim=H, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, max_seq_len=SEQ)
    torch.manual_seed(0)
    model, optimizer = parallelize(Transformer(cfg), init_mesh(tp=2), optimizer=adamw,
                                   data=DataParallel(grad_reduction="sum"))
    x, y = batches(vocab=V, steps=1, batch=BATCH, seq=SEQ)[0]
    model.comm.reset()
    train_step(model, optimizer, [(x, y)], 1.0)
    return model.comm.summary()["tp"]["all_reduce"]["calls"]


def test_hugging_face_llama_pays_one_collective_per_region_per_pass():
    """2 layers × (attention, MLP) regions × 2 passes, + embedding, head's input grad, loss: as the reference."""
    ours = launch_once(_RESULTS, 2, _all_cases, timeout=600)[0]["llama_tp2"]["tp_all_reduces"]
    reference = run_on_ranks(_reference_model_calls, 2, timeout=120)[0]
    assert ours == [reference] * STEPS
    # + the embedding's sum, the head's input gradient, the loss's max and sum (the clip norm's sum of
    # squares travels in the step's agreement, over the whole mesh)
    assert reference == 2 * 2 * 2 + 1 + 1 + 2


def _gpt2_fused(rank, world):
    mesh = init_mesh(tp=2)
    from paratrain.comm import Comm

    try:
        apply_tensor_parallel(hf_gpt2(), {"transformer.h.*.attn.c_attn": Colwise()}, Comm(mesh))
    except TensorParallelError as error:
        return str(error)


def test_a_fused_qkv_projection_is_refused_naming_the_module():
    message = run_on_ranks(_gpt2_fused, 2, timeout=60)[0]
    assert message.startswith("transformer.h.0.attn.c_attn is a fused projection: its module splits the 96 "
                              "outputs into 3 parts of 32"), message


class _TupleOut(nn.Module):
    def forward(self, x):
        return x, x.sum()


def _tuple_boundary(rank, world):
    model = nn.Sequential(nn.Embedding(V, H), _TupleOut(), nn.Linear(H, V))
    pmodel, _ = parallelize(model, init_mesh(pp=2), pipeline=PipelineParallel(boundaries=(2,)))
    x, y = batches(vocab=V, steps=1, batch=2, seq=SEQ)[0]
    try:
        pmodel.train_step([(x, y)], 1.0)
    except PipelineError as error:  # on stage 0's rank, before it sends anything
        return str(error)
    except RuntimeError:  # stage 1's rank waited for the activation: its peer is gone
        return "peer failed"


def test_a_stage_boundary_that_is_not_one_tensor_is_a_one_line_error():
    message = run_on_ranks(_tuple_boundary, 2, timeout=60)[0]
    assert message.startswith("pipeline stage 0 (layers 0..1) returned a tuple, but a stage boundary carries "
                              "one tensor"), message
    assert "\n" not in message


VERIFY = ["verify", "--model-factory", "test_your_own_model:model_factory", "--steps", "3", "--global-batch", "8",
          "--seq-len", "16", "--layouts", "dp2;tp2;pp2,1f1b"]


def test_verify_checks_the_users_own_model(capsys, monkeypatch):
    monkeypatch.delenv(FAULT_ENV, raising=False)
    assert main(VERIFY) == 0
    rows = capsys.readouterr().out.split("layout ")[-1].splitlines()[1:]
    assert [r.split()[0] for r in rows] == ["dp2", "tp2", "pp2,1f1b"] and all(r.split()[5] == "PASS" for r in rows)


def test_verify_fails_a_wrong_layout_of_the_users_own_model(capsys, monkeypatch):
    monkeypatch.setenv(FAULT_ENV, "negate_grads@rank1:step*")
    assert main([*VERIFY[:-1], "dp2"]) == 1
    row = capsys.readouterr().out.splitlines()[-1].split()
    assert row[0] == "dp2" and row[5] == "FAIL", row


def test_verify_refuses_a_bad_factory_in_one_line(capsys):
    assert main(["verify", "--model-factory", "test_your_own_model:nothing", "--layouts", "dp2"]) == 2
    assert capsys.readouterr().err.strip() == ("paratrain verify: error: --model-factory "
                                               "'test_your_own_model:nothing': test_your_own_model has no function "
                                               "'nothing'")


# -- the documentation's recipes, run verbatim ----------------------------------------------------------

def documented_recipes() -> dict[str, str]:
    """The code block after each `<!-- recipe: NAME -->` marker of the README and the pages under docs/."""
    import pathlib
    import re

    root = pathlib.Path(__file__).parents[2]
    recipes = {}
    for page in [root / "README.md", *sorted((root / "docs").glob("*.md"))]:
        text = page.read_text()
        found = re.findall(r"<!-- recipe: (\w+) -->\n```python\n(.*?)```", text, flags=re.S)
        assert len(found) == text.count("<!-- recipe:"), f"{page.name}: a recipe marker not followed by a python block"
        for name, code in found:
            assert name not in recipes, f"recipe {name} written twice ({page.name})"
            recipes[name] = code
    return recipes


def _run_recipes(rank, world, recipes):
    import contextlib
    import io

    printed = {}
    for name, code in recipes.items():
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            exec(compile(code, f"recipe {name}", "exec"), {"__name__": "__main__"})
        printed[name] = [float(line.rsplit(" ", 1)[1]) for line in out.getvalue().splitlines()]
    return printed


def test_the_documented_recipes_run_as_written():
    recipes = documented_recipes()
    assert sorted(recipes) == ["hf_llama_tp", "sequential_pp", "zero3"]
    for rank, losses in enumerate(run_on_ranks(_run_recipes, 2, recipes, timeout=300)):
        for name, values in losses.items():
            assert len(values) == 5 and all(v == v for v in values), (name, values)
            assert values[-1] < values[0], f"{name}: the loss goes down ({values})"
