"""Every layout of a transformers model against one process: the families of `hf_families` under dp2, dp2 ZeRO-3
(sharded loading from the directory), tp2 with sequence parallelism (the plan from the config's
`base_model_tp_plan`), cp2 (SDPA with position_ids) and pp2 (the model laid out for stages under its own names,
`paratrain.interop.hf_stages.LayeredCausalLM`), each through `parallelize` as the trainer calls it, against
plain PyTorch on transformers' model of the same directory: the same global batches, AdamW and clipping, under the
project's error model (`paratrain.error_model`). One launch of two ranks runs every case."""

from __future__ import annotations

import dataclasses
import functools
import tempfile
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from hf_families import VOCAB, hf_model
from paratrain import ContextParallel, DataParallel, PipelineParallel, TensorParallel, init_mesh, parallelize
from paratrain.interop.hf_weights import weight_initializer
from paratrain.models.hf import read_model_dir
from paratrain.run.hf_backend import meta_model
from paratrain.train import train_step
from paratrain.error_model import FP32_ADAMW_MODEL_STRAY, FP64_PARITY
from paratrain.precision import Precision
from parallel_cases import adamw, assert_matches_reference, batches, launch_once

SEQ, BATCH, STEPS, LR = 16, 4, 2, 1e-2
FP64 = Precision("fp64", torch.float64, torch.float64, torch.float64)


@dataclasses.dataclass(frozen=True)
class Case:
    family: str
    dp: int = 1
    tp: int = 1
    cp: int = 1
    pp: int = 1
    ep: int = 1
    zero: int = 0
    sp: bool = False
    fp64: bool = False  # model, optimizer and loss in fp64: the exact proof of a layout (`FP64_PARITY`)


CASES = {
    **{f"{f}_dp2": Case(f, dp=2) for f in ("qwen2", "qwen3", "mistral", "gemma2", "phi3", "qwen3_moe")},
    **{f"{f}_dp2_zero3": Case(f, dp=2, zero=3) for f in ("qwen2", "qwen3", "mistral", "gemma2", "phi3", "qwen3_moe")},
    **{f"{f}_tp2_sp": Case(f, tp=2, sp=True) for f in ("qwen2", "qwen3", "mistral", "gemma2", "phi3", "qwen3_moe")},
    "phi3_tp2_sp_fp64": Case("phi3", tp=2, sp=True, fp64=True),  # the fused qkv_proj and gate_up_proj split exactly
    **{f"{f}_cp2": Case(f, cp=2) for f in ("qwen2", "qwen3", "mistral", "mistral_window", "phi3", "qwen3_moe")},
    # (Gemma 2's head tied to its embedding: a copy on the last stage, its gradient summed with the first's over pp)
    **{f"{f}_pp2": Case(f, pp=2) for f in ("qwen2", "qwen3", "mistral", "gemma2", "phi3", "qwen3_moe")},
    "qwen3_moe_dp2_ep2": Case("qwen3_moe", dp=2, ep=2),
    "qwen3_moe_dp2_ep2_zero3": Case("qwen3_moe", dp=2, ep=2, zero=3),
}
_DIRS: dict[str, Path] = {}


def _directories() -> dict[str, Path]:
    """Each family's saved directory, written once by the test process (every rank and the reference read them)."""
    if not _DIRS:
        root = Path(tempfile.mkdtemp(prefix="paratrain-hf-layouts-"))
        for family in sorted({case.family for case in CASES.values()}):
            hf_model(family).save_pretrained(root / family)
            _DIRS[family] = root / family
    return _DIRS


def _run(case: Case, mesh, directory: Path):
    model = meta_model(read_model_dir(directory), case)  # as the trainer builds it for the layout
    if case.fp64:
        model = model.to(torch.float64)
    pmodel, optimizer = parallelize(
        model, mesh, optimizer=functools.partial(adamw, lr=LR), data=DataParallel(zero=case.zero, grad_reduction="sum"),
        tensor=TensorParallel(sequence_parallel=case.sp), context=ContextParallel() if case.cp > 1 else None,
        pipeline=PipelineParallel() if case.pp > 1 else None, init=weight_initializer(model, str(directory), seed=0),
        loss_chunk=0,  # the layout against one process on the same loss (the fused loss has its own equality tests)
        precision=FP64 if case.fp64 else "fp32")
    dp, rank = mesh.size("dp"), mesh.coord("dp")
    rows = BATCH // dp
    micro = 1 if case.pp > 1 else rows  # a pipeline runs its rows as micro-batches, at least one per stage
    losses = []
    for x, y in batches(vocab=VOCAB, steps=STEPS, batch=BATCH, seq=SEQ):
        xs, ys = x[rank * rows:(rank + 1) * rows], y[rank * rows:(rank + 1) * rows]
        outcome = train_step(pmodel, optimizer, [(xs[i:i + micro], ys[i:i + micro]) for i in range(0, rows, micro)],
                             1.0)
        losses.append(outcome.loss)
    return {"losses": losses, "params": pmodel.full_state_dict()}


def _all_cases(rank, world, directories):
    """Every case on this rank; a case that fails reports its error, and the others still run."""
    out = {}
    for name, case in CASES.items():
        try:
            out[name] = _run(case, init_mesh(dp=case.dp, tp=case.tp, cp=case.cp, pp=case.pp, ep=case.ep),
                             directories[case.family])
        except Exception as error:  # noqa: BLE001 - re-raised by the case's test
            out[name] = {"error": f"{type(error).__name__}: {error}"}
    return out


def _reference(family: str, dtype: torch.dtype = torch.float32) -> dict:
    """One process, plain PyTorch on transformers' model loaded from the same directory, in `dtype`."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(_directories()[family], dtype=dtype)
    optimizer = adamw(list(model.parameters()), lr=LR)
    losses = []
    for x, y in batches(vocab=VOCAB, steps=STEPS, batch=BATCH, seq=SEQ):
        logits = model(x).logits
        logits = logits.flatten(0, 1).to(torch.promote_types(dtype, torch.float32))
        loss = F.cross_entropy(logits, y.flatten(), ignore_index=-100, reduction="sum")
        loss = loss / (y != -100).sum()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return {"losses": losses, "params": {n: p.detach() for n, p in model.named_parameters()}}


_RESULTS: dict = {}


@pytest.mark.multirank
@pytest.mark.parametrize("name", list(CASES))
def test_a_transformers_model_matches_one_process(name):
    case = CASES[name]
    ref = _reference(case.family, torch.float64 if case.fp64 else torch.float32)
    for per_rank in launch_once(_RESULTS, 2, _all_cases, _directories(), timeout=900):
        got = per_rank[name]
        assert "error" not in got, got.get("error")
        assert_matches_reference(got["losses"], got["params"], ref["losses"], ref["params"],
                                 FP64_PARITY if case.fp64 else FP32_ADAMW_MODEL_STRAY)


def test_the_stages_of_a_transformers_model_compute_its_logits():
    """Each family laid out for pipeline stages (`LayeredCausalLM`, transformers' parameter names): whole, and split
    in two stages run one after the other, the logits of transformers' own forward, bit for bit; Gemma 2 over more
    tokens than its sliding window (its windowed layers' mask), soft-capped by the head stage, its tied head a copy
    of the embedding on the last stage under the embedding's name. With the documents kept apart (--document-mask),
    the later stage given the token ids, what the unpipelined model computes."""
    import dataclasses

    from paratrain.interop.hf_stages import LayeredCausalLM
    from paratrain.models.hf import HFCausalLM, summarize
    from paratrain.parallel.pipeline.stages import split_for_pipeline

    tokens = torch.randint(3, VOCAB, (2, 80), generator=torch.Generator().manual_seed(3))
    tokens[:, 30] = 2  # an end of text: two documents in each row
    for family in ("qwen2", "qwen3", "mistral", "gemma2", "phi3", "qwen3_moe"):
        hf = hf_model(family)
        config = summarize(hf.config, hf, "")
        with torch.no_grad():
            want = hf(tokens).logits
            layered = LayeredCausalLM(HFCausalLM(hf, config))
            assert [n for n, _ in layered.named_parameters()] == [n for n, _ in hf.named_parameters()], family
            assert torch.equal(layered(tokens), want), family
            first, last = (split_for_pipeline(LayeredCausalLM(HFCausalLM(hf, config)), 2, rank) for rank in (0, 1))
            assert {n for n, _ in first.module.named_parameters()}.isdisjoint(n for n, _ in last.module.named_parameters())
            assert torch.equal(last.shell(1)(first.shell(0)(tokens)), want), family
            tied = {"lm_head.weight": "model.embed_tokens.weight"} if config.tie_embeddings else {}
            assert last.shared == tied and (family != "gemma2" or tied), family
            documents = dataclasses.replace(config, document_eos=2)
            first, last = (split_for_pipeline(LayeredCausalLM(HFCausalLM(hf, documents)), 2, rank) for rank in (0, 1))
            got = last.shell(1)(first.shell(0)(tokens), documents=tokens)
            torch.testing.assert_close(got, HFCausalLM(hf, documents)(tokens), rtol=1e-5, atol=1e-5)
            assert not torch.allclose(got, want, rtol=1e-3, atol=1e-3), family  # the documents were kept apart


# -- the documentation's table, generated from the cases above ----------------------------------------------------

FAMILY_NAMES = {"qwen2": "Qwen2 / Qwen2.5", "qwen3": "Qwen3", "mistral": "Mistral", "gemma2": "Gemma 2",
                "phi3": "Phi-3", "qwen3_moe": "Qwen3-MoE"}
COLUMNS = {"dp2": dict(dp=2, zero=0), "dp2 ZeRO-3": dict(dp=2, zero=3), "tp2 + sp": dict(tp=2, sp=True),
           "cp2": dict(cp=2), "pp2": dict(pp=2), "dp2 ep2": dict(dp=2, ep=2, zero=0)}
# A family's variant whose case proves a layout the family itself is refused (its note says which).
VARIANTS = {"mistral_window": ("mistral", "=")}  # (a window covering the sequence: its cp2 case)
# What `tests/models/test_hf_backend.py` proves refused, in one line, before any process starts.
REFUSED = {("gemma2", "cp2"): "refused: eager attention (soft-capped scores), no SDPA for the ring"}
TABLE_MARK = "<!-- hf-support-table: generated by tests/parallel/test_hf_layouts.py (support_table) -->"


def support_table() -> str:
    """Families × layouts: "=" where a case above matches one process, the refusal where one is proven, else "·"."""
    head = ["family", "first-step loss = transformers'", "export → from_pretrained", *COLUMNS]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for family, title in FAMILY_NAMES.items():
        cells = [title, "= (1e-6)", "= (1e-5)"]
        for column, layout in COLUMNS.items():
            proven = {case.family for case in CASES.values() if case == dataclasses.replace(Case(case.family), **layout)}
            variant = next((note for v, (f, note) in VARIANTS.items() if f == family and v in proven), None)
            cells.append("=" if family in proven else variant or REFUSED.get((family, column), "·"))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def test_the_documented_table_is_the_one_these_tests_prove():
    page = (Path(__file__).parents[2] / "docs" / "hf-models.md").read_text()
    assert TABLE_MARK in page, "docs/hf-models.md lost its table marker"
    table = page.split(TABLE_MARK, 1)[1].strip().split("\n\n", 1)[0]
    assert table == support_table(), "regenerate: python -c 'import test_hf_layouts as t; print(t.support_table())'"


@pytest.mark.multirank
def test_verify_checks_a_model_directory(capsys):
    """`paratrain verify --model DIR`: the trainer on transformers' Qwen3 from scratch, dp2 ZeRO-3 against one
    process."""
    from paratrain.cli import main

    directory = _directories()["qwen3"]
    capsys.readouterr()
    assert main(["verify", "--model", str(directory), "--steps", "2", "--global-batch", "4", "--seq-len", "16",
                 "--layouts", "dp2,zero3"]) == 0
    row = capsys.readouterr().out.splitlines()[-1].split()
    assert row[0] == "dp2,zero3" and row[5] == "PASS", row
