"""The planner with the paper's runtime (`plan --attention materialized`) reproduces Korthikanti et al. 2022.

"Reducing Activation Recomputation in Large Transformer Models": Table 2 gives the activation bytes of one
transformer layer under six techniques, with s = 2048, 16-bit activations and 1-byte dropout masks; its Table 3
gives four GPT models and the layouts they were trained with, and §4.2.3/§5 the first pipeline stage's total
(it holds p micro-batches of L/p layers under 1F1B: L layers' worth). The paper's numbers are written out here
from its formulas, apart from the planner's code; the planner, asked for the paper's runtime (materialized
scores and masks, a GPT block, Megatron's selective recompute of attention's core), must give each within 5%.
paratrain's own kernels (flash attention, its selective policy) stay the default and give other numbers.
"""

import pytest

from paratrain.plan import Layout, Workload, estimate_memory, layer_activation_bytes
from paratrain.plan.memory import Recompute
from paratrain.plan.published import gpt_model

S, V = 2048, 51_200

# Table 3: heads a, hidden h, layers L, tensor parallel t, pipeline stages p, global batch, micro-batch b.
MODELS = {"22B": (64, 6144, 48, 8, 1, 4, 4), "175B": (96, 12288, 96, 8, 8, 64, 1),
          "530B": (128, 20480, 105, 8, 35, 280, 1), "1T": (160, 25600, 128, 8, 64, 512, 1)}


def _paper_cell(technique: str, a: int, h: int, t: int, b: int) -> float:
    """Table 2, bytes per layer."""
    sbh, scores = S * b * h, 5 * a * S / h
    return {"no parallelism": sbh * (34 + scores),
            "tensor parallel": sbh * (10 + 24 / t + scores / t),
            "tensor + sequence parallel": sbh / t * (34 + scores),
            "tensor parallel + selective": sbh * (10 + 24 / t),
            "tensor + sequence parallel + selective": sbh / t * 34,
            "full recompute": 2 * sbh}[technique]


# technique: (tp used, sequence parallel, recompute)
TECHNIQUES = {"no parallelism": (False, False, Recompute.NONE),
              "tensor parallel": (True, False, Recompute.NONE),
              "tensor + sequence parallel": (True, True, Recompute.NONE),
              "tensor parallel + selective": (True, False, Recompute.SELECTIVE),
              "tensor + sequence parallel + selective": (True, True, Recompute.SELECTIVE),
              "full recompute": (True, False, Recompute.FULL)}


@pytest.mark.parametrize("technique", list(TECHNIQUES))
@pytest.mark.parametrize("model", list(MODELS))
def test_table_2_per_layer_cells(model, technique):
    a, h, _, t, _, _, b = MODELS[model]
    use_tp, sp, recompute = TECHNIQUES[technique]
    planned = layer_activation_bytes(S, b, h, a, t if use_tp else 1, sp, recompute, "bf16", flash=False)
    assert planned == pytest.approx(_paper_cell(technique, a, h, t, b), rel=0.05)


@pytest.mark.parametrize("recompute", [Recompute.NONE, Recompute.SELECTIVE], ids=["eq5", "eq6"])
@pytest.mark.parametrize("model", list(MODELS))
def test_first_stage_totals_of_the_table_3_layouts(model, recompute):
    """The whole first stage, as `estimate_memory` sums it over its layers and 1F1B's micro-batches in flight
    (its logits too where the first stage is the last): sbhL/t·(34 + 5as/h) with tensor and sequence
    parallelism (eq. 5), sbhL/t·34 with selective recompute as well (eq. 6)."""
    a, h, layers, t, p, batch, b = MODELS[model]
    work = Workload.for_model(gpt_model(layers, h, a, V), seq_len=S, global_batch=batch, flash_attention=False)
    layout = Layout(tp=t, pp=p, sequence_parallel=True, micro_batch=b, recompute=recompute.value)
    first = estimate_memory(work, layout)
    assert first.stage == 0
    per_layer = S * b * h / t * (34 + (5 * a * S / h if recompute is Recompute.NONE else 0))
    assert first.activations == pytest.approx(per_layer * layers, rel=0.05)


def test_paratrains_own_kernels_stay_the_default():
    """The default runtime keeps no scores: the 22B layer without parallelism is a third of the paper's."""
    a, h, _, t, _, _, b = MODELS["22B"]
    work = Workload.for_model(gpt_model(48, h, a, V), seq_len=S, global_batch=4)
    assert work.flash_attention
    flash = layer_activation_bytes(S, b, h, a, 1, False, Recompute.NONE, "bf16", ffn_dim=round(8 * h / 3), flash=True)
    assert flash < _paper_cell("no parallelism", a, h, t, b) / 2
