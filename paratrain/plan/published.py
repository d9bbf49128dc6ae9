"""Published large-scale training runs, and the planner's prediction of each one's per-GPU throughput.

Each `PublishedRun` is a run whose layout, batch, sequence length, GPU kind and count and
per-GPU throughput were published. The planner predicts its step time with the preset of its
GPU kind (one set of constants per kind, `paratrain.plan.hardware`, never one per run), and the
per-GPU throughput follows with the FLOP count the source itself uses (its convention: whether
recomputation counts, which attention FLOPs). `tests/plan/test_plan_published.py` checks every run
within ±15 %.

Every run used fused kernels (Megatron's, or a compiled stack): the planner's compiled stack
(`Layout.compile`). The runs' own conditions are modelled as far as they were published: tensor, pipeline and
data-parallel degrees, micro-batch, recomputation, sequence parallelism, interleaving, the
attention kernel, whether gradients are reduced during or after the backward. What a source
does not state is assumed, and `assumed` says what.

GPT-3-style blocks (LayerNorm, biases, a 4h GeLU MLP, learned positions) are modelled as the
planner's Llama-style blocks with the same matmul FLOPs: a SwiGLU MLP of width 8h/3 has the same
8h² weights and 16h² FLOPs per token as a 4h MLP, with matmuls of nearly the same shapes
(n = 2.7h instead of 4h), and the element-wise work of a fused stack is about the same. Biases
and positions (< 0.1 % of the FLOPs) are left out.

Runs considered and left out of the check, and why (`EXCLUDED_RUNS` keeps the first two, so
that `paratrain plan --published` shows how far off they are):
- BLOOM 176B (BigScience 2022) and MT-NLG 530B (Smith et al. 2022) ran on Megatron-DeepSpeed,
  whose pipeline engine (DeepSpeed's) ran 20-25 % below Megatron-LM's schedule in the published
  numbers: MT-NLG's 126 TFLOP/s against Narayanan et al.'s 163 for the same 530B model, degrees
  and nearly the same micro-batches per pipeline. No model of the layout alone tells the two
  stacks apart, and the presets describe Megatron-LM's; the planner predicts both 20-30 % above
  their figures.
- OPT-175B (Zhang et al. 2022, §2.4, "up to 147 TFLOP/s" on 992 A100s, FSDP + tp 8): a peak,
  not a run's throughput, and the 1,024-sequence batch does not divide over 124 data ranks,
  so the micro-batch layout is unknown.
- Llama 3 405B at 131,072 tokens (Dubey et al. 2024, Table 4, 380 TFLOP/s): it needs context
  parallelism (cp 16), which the planner does not model.
"""

from __future__ import annotations

from dataclasses import dataclass

from paratrain.models.configs import ModelConfig
from paratrain.plan.compute import step_time
from paratrain.plan.hardware import HARDWARE_PRESETS, Hardware
from paratrain.plan.memory import Layout, Recompute, Workload
from paratrain.plan.model_states import block_param_count
from paratrain.parallel.pipeline.schedules import ScheduleName

ONE_BUCKET_MB = 1e9  # every gradient in one collective after the backward: no overlap (Megatron-LM 2021)


def gpt_model(layers: int, hidden: int, heads: int, vocab: int, seq_len: int = 2048) -> ModelConfig:
    """A GPT-3-style model as the planner's equivalent: multi-head attention, SwiGLU of width 8h/3."""
    return ModelConfig(vocab_size=vocab, dim=hidden, n_layers=layers, n_heads=heads, n_kv_heads=heads,
                       ffn_dim=round(8 * hidden / 3), max_seq_len=seq_len, tie_embeddings=True)


def megatron_flops_per_token(layers: int, hidden: int, seq_len: int, vocab: int, recompute: bool) -> float:
    """Narayanan et al. 2021, eq. 3 (per token): 96·l·h²(1 + s/6h + V/16lh) with recomputation.

    Without recomputation, Korthikanti et al. 2022 §6.3's model FLOPs: 72·l·h²(1 + s/6h + V/12lh)
    (the logit layer counted three times, not four).
    """
    l, h, s, v = layers, hidden, seq_len, vocab
    if recompute:
        return 96.0 * l * h * h * (1 + s / (6 * h) + v / (16 * l * h))
    return 72.0 * l * h * h * (1 + s / (6 * h) + v / (12 * l * h))


@dataclass(frozen=True)
class PublishedRun:
    """One published training run: its conditions and its per-GPU throughput as the source counts it.

    Fields:
        name: short label.
        source: paper (or model card), table or section, and the exact figure used.
        gpu: the hardware preset of its GPU kind.
        model: the planner's equivalent model (see the module docstring for GPT-style blocks).
        seq_len, global_batch: tokens per sequence, sequences per optimizer step.
        gpus, tp, pp: GPU count and degrees (dp = gpus / (tp·pp)).
        micro_batch: sequences per forward/backward.
        tflops_per_gpu: the published per-GPU throughput (TFLOP/s).
        flops_per_token: the source's FLOP count per token (its convention).
        assumed: the conditions the source does not state, as modelled here.
    """

    name: str
    source: str
    gpu: str
    model: ModelConfig
    seq_len: int
    global_batch: int
    gpus: int
    tp: int
    pp: int
    micro_batch: int
    tflops_per_gpu: float
    flops_per_token: float
    precision: str = "bf16"
    recompute: Recompute = Recompute.NONE
    sequence_parallel: bool = False
    schedule: ScheduleName = ScheduleName.ONE_F_ONE_B
    virtual_stages: int = 1
    zero: int = 0
    flash_attention: bool = False
    bucket_mb: float = ONE_BUCKET_MB
    assumed: str = ""

    @property
    def dp(self) -> int:
        return self.gpus // (self.tp * self.pp)

    def workload(self) -> Workload:
        return Workload.for_model(self.model, seq_len=self.seq_len, global_batch=self.global_batch,
                                  precision=self.precision, flash_attention=self.flash_attention)

    def layout(self) -> Layout:
        return Layout(dp=self.dp, tp=self.tp, pp=self.pp, zero=self.zero, micro_batch=self.micro_batch,
                      sequence_parallel=self.sequence_parallel, recompute=self.recompute, schedule=self.schedule,
                      virtual_stages=self.virtual_stages, bucket_mb=self.bucket_mb, compile=True)

    def predicted_tflops(self, hardware: Hardware | None = None) -> float:
        """Per-GPU TFLOP/s the planner predicts, counted with the source's FLOPs per token."""
        hardware = hardware or HARDWARE_PRESETS[self.gpu]
        seconds = step_time(self.workload(), self.layout(), hardware).total
        return self.flops_per_token * self.global_batch * self.seq_len / (seconds * self.gpus) / 1e12


# -- Narayanan et al. 2021 ("Efficient Large-Scale Language Model Training on GPU Clusters Using
# Megatron-LM", SC'21), Table 1: GPT models on Selene (DGX A100 80 GB, 8 GPUs and 8 HDR
# InfiniBand NICs per node), s = 2048, V = 51,200, fp16, activation recomputation (the table's
# teraFLOP/s count it: eq. 3), scatter/gather boundaries, fused kernels without flash attention.
# Gradients were all-reduced after the backward in one pass (no overlap).
_NARAYANAN_ASSUMED = ("micro-batch 1 with pp > 1 (the table does not give it) and 4 with pp = 1; "
                      "non-interleaved 1F1B; fp16 gradients")
_NARAYANAN = [  # (billions, heads, hidden, layers, tp, pp, gpus, batch, TFLOP/s per GPU)
    ("1.7", 24, 2304, 24, 1, 1, 32, 512, 137), ("3.6", 32, 3072, 30, 2, 1, 64, 512, 138),
    ("7.5", 32, 4096, 36, 4, 1, 128, 512, 142), ("18.4", 48, 6144, 40, 8, 1, 256, 1024, 135),
    ("39.1", 64, 8192, 48, 8, 2, 512, 1536, 138), ("76.1", 80, 10240, 60, 8, 4, 1024, 1792, 140),
    ("145.6", 96, 12288, 80, 8, 8, 1536, 2304, 148), ("310.1", 128, 16384, 96, 8, 16, 1920, 2160, 155),
    ("529.6", 128, 20480, 105, 8, 35, 2520, 2520, 163), ("1008.0", 160, 25600, 128, 8, 64, 3072, 3072, 163),
]


def _narayanan(billions, heads, hidden, layers, tp, pp, gpus, batch, tflops) -> PublishedRun:
    return PublishedRun(
        name=f"GPT {billions}B (Megatron-LM 2021)",
        source=f"Narayanan et al. 2021, Table 1, {billions}B row: {tflops} teraFLOP/s per GPU",
        gpu="a100-80gb", model=gpt_model(layers, hidden, heads, 51200), seq_len=2048, global_batch=batch,
        gpus=gpus, tp=tp, pp=pp, micro_batch=1 if pp > 1 else 4, tflops_per_gpu=tflops,
        flops_per_token=megatron_flops_per_token(layers, hidden, 2048, 51200, recompute=True),
        precision="fp16", recompute=Recompute.FULL, assumed=_NARAYANAN_ASSUMED)


# -- Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models"),
# Table 3 (configurations) and §6.3 end-to-end results, "present work" rows: sequence parallelism +
# selective recomputation, s = 2048, V = 51,200, micro-batch 1, dp = 1, A100 80 GB (Selene);
# model FLOPs utilization (MFU, no recomputation counted) of 41.5 %, 51.4 %, 56.0 % and 56.3 %
# of the 312 TFLOP/s peak.
_KORTHIKANTI = [  # (name, heads, hidden, layers, tp, pp, gpus, batch, MFU %)
    ("22B", 64, 6144, 48, 8, 1, 8, 4, 41.5), ("175B", 96, 12288, 96, 8, 8, 64, 64, 51.4),
    ("530B", 128, 20480, 105, 8, 35, 280, 280, 56.0), ("1T", 160, 25600, 128, 8, 64, 512, 512, 56.3),
]


def _korthikanti(name, heads, hidden, layers, tp, pp, gpus, batch, mfu) -> PublishedRun:
    return PublishedRun(
        name=f"GPT {name} (SP + selective recompute)",
        source=f"Korthikanti et al. 2022, §6.3 / Table 3, {name}: MFU {mfu} % of 312 TFLOP/s",
        gpu="a100-80gb", model=gpt_model(layers, hidden, heads, 51200), seq_len=2048, global_batch=batch,
        gpus=gpus, tp=tp, pp=pp, micro_batch=1, tflops_per_gpu=3.12 * mfu,
        flops_per_token=megatron_flops_per_token(layers, hidden, 2048, 51200, recompute=False),
        precision="bf16", recompute=Recompute.SELECTIVE, sequence_parallel=True,
        assumed="non-interleaved 1F1B; bf16")


# BLOOM (BigScience 2022): 176B, 70 layers, h 14,336, 112 heads, V 250,880, s 2048, global batch
# 2048, 384 A100 80 GB (48 nodes), tp 4, pp 12, dp 8 with ZeRO-1, bf16, activation checkpointing
# (Megatron-DeepSpeed). Model card (bigscience/bloom, "Training throughput: About 150 TFLOP per
# GPU per second"), counted by Megatron-DeepSpeed's formula (eq. 3 above, with recomputation).
_BLOOM = PublishedRun(
    name="BLOOM 176B", source="BLOOM model card (bigscience/bloom): about 150 TFLOP per GPU per second",
    gpu="a100-80gb", model=gpt_model(70, 14336, 112, 250880), seq_len=2048, global_batch=2048, gpus=384,
    tp=4, pp=12, micro_batch=2, tflops_per_gpu=150,
    flops_per_token=megatron_flops_per_token(70, 14336, 2048, 250880, recompute=True),
    precision="bf16", recompute=Recompute.FULL, zero=1,
    assumed="micro-batch 2 (its Megatron-DeepSpeed launch script); non-interleaved 1F1B; gradients "
            "reduced after the backward")

# Llama 3 405B (Dubey et al. 2024, "The Llama 3 Herd of Models", Table 4): 126 layers, h 16,384,
# ffn 53,248, 128 heads, 8 kv heads, V 128,256, s 8192, 16M tokens per step (2048 sequences),
# H100 80 GB, tp 8, pp 16, cp 1, bf16, flash attention, interleaved pipeline schedule;
# 8,192 GPUs (dp 64, 32 sequences per data rank): 430 TFLOP/s per GPU (BF16 MFU 43 %);
# 16,384 GPUs (dp 128, 16 per data rank): 400 TFLOP/s (41 %).
_LLAMA3_405B = ModelConfig(vocab_size=128256, dim=16384, n_layers=126, n_heads=128, n_kv_heads=8,
                           ffn_dim=53248, max_seq_len=8192, rope_theta=500000.0)
_LLAMA3_ASSUMED = ("micro-batch 1; interleaving over v = 4 virtual stages per rank; selective recomputation "
                   "(flash attention keeps no scores, so it recomputes nothing); FSDP's per-layer gradient "
                   "reduce-scatter and parameter all-gather modelled as one all-reduce per layer (the same bytes), "
                   "overlapped with the backward; MFU counted as 6N + 12·L·h·s FLOPs per token")
# FSDP communicates one unit (a transformer layer) at a time: a layer's bf16 gradients per tp rank.
_LLAMA3_UNIT_MB = block_param_count(_LLAMA3_405B) / 8 * 2 / 2**20


def _llama3(gpus: int, tflops: float) -> PublishedRun:
    return PublishedRun(
        name=f"Llama 3 405B, {gpus:,} GPUs",
        source=f"Dubey et al. 2024, Table 4, {gpus:,} GPUs row: {tflops:g} TFLOPs/GPU",
        gpu="h100-80gb", model=_LLAMA3_405B, seq_len=8192, global_batch=2048, gpus=gpus, tp=8, pp=16,
        micro_batch=1, tflops_per_gpu=tflops, flops_per_token=float(_LLAMA3_405B.flops_per_token(8192)),
        precision="bf16", recompute=Recompute.SELECTIVE, sequence_parallel=True,
        schedule=ScheduleName.INTERLEAVED, virtual_stages=4, flash_attention=True, bucket_mb=_LLAMA3_UNIT_MB,
        assumed=_LLAMA3_ASSUMED)


# MT-NLG 530B (Smith et al. 2022, "Using DeepSpeed and Megatron to Train Megatron-Turing NLG 530B"):
# 105 layers, h 20,480, 128 heads, s 2048, batch 1920, 280 DGX A100 80 GB nodes (2,240 GPUs), tp 8,
# pp 35, dp 8, bf16, activation checkpointing; 126 teraFLOP/s per GPU at 280 nodes (recomputation
# counted, as in eq. 3).
_MT_NLG = PublishedRun(
    name="MT-NLG 530B", source="Smith et al. 2022, throughput at 280 DGX nodes: 126 teraFLOP/s per GPU",
    gpu="a100-80gb", model=gpt_model(105, 20480, 128, 51200), seq_len=2048, global_batch=1920, gpus=2240, tp=8,
    pp=35, micro_batch=1, tflops_per_gpu=126,
    flops_per_token=megatron_flops_per_token(105, 20480, 2048, 51200, recompute=True), precision="bf16",
    recompute=Recompute.FULL, zero=1, assumed="micro-batch 1; non-interleaved 1F1B")

PUBLISHED_RUNS: tuple[PublishedRun, ...] = (
    *(_narayanan(*row) for row in _NARAYANAN),
    *(_korthikanti(*row) for row in _KORTHIKANTI),
    _llama3(8192, 430),
    _llama3(16384, 400),
)
_DEEPSPEED = "Megatron-DeepSpeed's pipeline engine, a stack the presets do not describe (module docstring)"
EXCLUDED_RUNS: tuple[tuple[PublishedRun, str], ...] = ((_BLOOM, _DEEPSPEED), (_MT_NLG, _DEEPSPEED))


def published_rows(hardware: dict[str, Hardware] | None = None) -> list[dict]:
    """Every run, checked and excluded, with its predicted and published per-GPU throughput."""
    presets = hardware or HARDWARE_PRESETS
    rows = []
    for run, reason in [(r, None) for r in PUBLISHED_RUNS] + list(EXCLUDED_RUNS):
        predicted = run.predicted_tflops(presets[run.gpu])
        rows.append({"name": run.name, "gpu": run.gpu, "gpus": run.gpus, "layout": run.layout().label(),
                     "published_tflops": run.tflops_per_gpu, "predicted_tflops": predicted,
                     "ratio": predicted / run.tflops_per_gpu, "source": run.source, "assumed": run.assumed,
                     "excluded": reason})
    return rows


def format_published(rows: list[dict]) -> str:
    """The table `paratrain plan --published` prints."""
    lines = ["published runs: per-GPU TFLOP/s as each source counts it, against the planner's prediction",
             f"  {'run':<40} {'GPUs':>6}  {'layout':<52} {'published':>9} {'predicted':>9}  ratio"]
    for r in rows:
        mark = "  (not checked)" if r["excluded"] else ""
        lines.append(f"  {r['name']:<40} {r['gpus']:>6}  {r['layout']:<52} {r['published_tflops']:>9.1f} "
                     f"{r['predicted_tflops']:>9.1f}  {r['ratio']:.2f}{mark}")
    checked = [r for r in rows if not r["excluded"]]
    worst = max(checked, key=lambda r: abs(r["ratio"] - 1))
    lines.append(f"{sum(abs(r['ratio'] - 1) <= 0.15 for r in checked)} of {len(checked)} checked runs within ±15 % "
                 f"(worst: {worst['name']}, {worst['ratio']:.2f}); not checked: "
                 + "; ".join(f"{r['name']}: {r['excluded']}" for r in rows if r["excluded"]))
    return "\n".join(lines)
