"""Per-rank memory of a training layout: model states, activations, communication buffers.

Everything here is arithmetic on a `Workload` (what is trained) and a `Layout`
(how it is split). Bytes are exact products of the formulas below; GB means
10⁹ bytes, as in the ZeRO paper.

Model states (parameters, gradients and optimizer state at each ZeRO stage, and the
parameters each tensor/pipeline rank holds) are `paratrain.plan.model_states`'s.

Activations (Korthikanti et al. 2022, "Reducing Activation Recomputation in
Large Transformer Models", §4 and Table 2), see `layer_activation_bytes`.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from enum import Enum

from paratrain.models.configs import ModelConfig
from paratrain.parallel.pipeline.schedules import ScheduleName, chunks_per_rank
from paratrain.parallel.pipeline.simulator import ScheduleTraits, traits_of
from paratrain.parallel.rules import FP8_CUDA_MIN_FEATURES, ZERO_STAGES, spelled
from paratrain.plan.model_states import (
    DTYPE_BYTES,
    ModelStates,
    layers_on_stage,
    model_state_bytes,
    stage_param_count,
)
from paratrain.parallel.rules import Recompute  # the modes; what each keeps is parallel/recompute.py's rule
from paratrain.plan import lora, moe
from paratrain.plan.activations import layer_activation_bytes, loss_stage_bytes
from paratrain.plan.muon import check_optimizer, stage_muon_params
from paratrain.plan.buffers import comm_buffer_parts
from paratrain.plan.ops import Shape, fp8_weight_params
from paratrain.plan.errors import PlanError  # (raised here, and named by the planner's callers from here)
from paratrain.plan.ring import ring_in_flight_bytes

GB = 10**9
DEFAULT_BUCKET_BYTES = 25 * 2**20  # PyTorch DDP's bucket_cap_mb, and paratrain's bucket_mb


class LayoutError(PlanError):
    """A layout that cannot run; the message names the rule and the nearest valid layouts."""


class PipelineBoundary(str, Enum):
    """How a stage boundary's activation (and its gradient) crosses between pipeline stages under tp > 1.

    SCATTER_GATHER (Narayanan et al. 2021, §4.1 "scatter/gather optimization"), paratrain's runtime:
    the tensor-parallel ranks of a stage hold the same b·s·h boundary tensor; each sends its 1/t
    slice to its peer of the next stage, which all-gathers the t slices over tp (inside the node).
    Under sequence parallelism paratrain first gathers the sequence shards into that whole tensor
    (and the gradient's shards again backward), so a crossing costs two all-gathers; Megatron-LM
    instead sends each rank's sequence shard as it is (no all-gather), a difference of one
    in-node all-gather of b·s·h per crossing that the planner charges to both.
    FULL: every tensor-parallel rank sends the whole b·s·h (under sequence parallelism gathered
    over tp before the send, and its gradient gathered backward).
    """

    SCATTER_GATHER = "scatter-gather"
    FULL = "full"


def _enum(cls, value, flag: str):
    try:
        return cls(value)
    except ValueError:
        choices = ", ".join(member.value for member in cls)
        raise PlanError(f"{flag} {value!r} is not one of: {choices}") from None


def _positive_int(value, flag: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise PlanError(f"{flag} must be a positive integer, got {value!r}")
    return value


@dataclass(frozen=True)
class Workload:
    """What is trained: a model (its shape, or only its parameter count) and the batch.

    Fields:
        model: the model's shape; None when only `num_params` is known (model states only,
            no activations, no tensor or pipeline parallelism).
        num_params: Ψ of the whole model (a tied embedding counted once).
        seq_len: tokens per sequence.
        global_batch: sequences per optimizer step over all data ranks; None means one
            micro-batch per data rank.
        precision: "bf16" or "fp16" (mixed precision with fp32 master weights) or "fp32".
        reduce_dtype: dtype of gradients and their reduction; None means the parameter dtype.
        flash_attention: the attention core runs as one kernel that keeps the s×s scores on
            chip and skips the causal half (FlashAttention, PyTorch's scaled_dot_product_attention,
            and paratrain's ring, whose blocks are such kernels), and blocks are counted as
            paratrain runs them; False: the runtime of Korthikanti et al. 2022 (`plan --attention
            materialized`), the scores materialized and softmaxed in memory with 1-byte dropout masks,
            a GPT block, and Megatron's selective recompute of attention's core only
            (`layer_activation_bytes`).
        fp8: None, or the FP8 recipe ("tensorwise", "rowwise") of the blocks' linears: their matmuls at the
            hardware's FP8 rate, plus their casts (`paratrain.plan.ops.fp8_times`); memory as bf16 plus the
            step's tensorwise weight casts (`fp8_cast_bytes`).
        fp8_min_features: linears with fewer whole-layer in or out features stay in the compute dtype, as
            `parallelize(fp8_min_features=...)` keeps them (the default: its CUDA default, 1,024; a CPU run: 0).
        loss_chunk: the loss fused into the head in chunks of this many tokens (`parallelize(loss_chunk=...)`, the
            trainer's default; `loss_stage_bytes`); 0: the whole logits, as a loop calling the model takes them.
        optimizer: "adamw", or "muon": the blocks' matrices stepped by Muon (`paratrain.plan.muon`).
        lora: None, or the rank of low-rank adapters on every block linear of a frozen model (`paratrain.plan.lora`:
            only the adapters train; the base costs its stored bytes).
        base_dtype: with `lora`, how the adapted linears' frozen weights are stored: None (the compute dtype),
            "bf16", "nf4" (QLoRA) or "fp8" (e4m3 bytes, a scale per row).
        moe_imbalance: the load imbalance a MoE model's routing is assumed to have: tokens the
            busiest expert rank receives over the mean (`paratrain.plan.moe`); ≥ 1, unused by a
            dense model.
    """

    model: ModelConfig | None
    num_params: int
    seq_len: int = 2048
    global_batch: int | None = None
    precision: str = "bf16"
    reduce_dtype: str | None = None
    flash_attention: bool = True
    moe_imbalance: float = moe.DEFAULT_IMBALANCE
    fp8: str | None = None
    fp8_min_features: int = FP8_CUDA_MIN_FEATURES
    loss_chunk: int = 0
    optimizer: str = "adamw"
    lora: int | None = None
    base_dtype: str | None = None

    def __post_init__(self):
        _positive_int(self.num_params, "--params")
        if isinstance(self.loss_chunk, bool) or not isinstance(self.loss_chunk, int) or self.loss_chunk < 0:
            raise PlanError(f"--loss-chunk must be 0 (whole logits) or a number of tokens, got {self.loss_chunk!r}")
        if isinstance(self.moe_imbalance, bool) or not isinstance(self.moe_imbalance, (int, float)) \
                or not self.moe_imbalance >= 1:
            raise PlanError(f"--moe-imbalance must be a number ≥ 1 (max/mean tokens per expert rank), "
                            f"got {self.moe_imbalance!r}")
        _positive_int(self.seq_len, "--seq")
        if self.global_batch is not None:
            _positive_int(self.global_batch, "--global-batch")
        for flag, value in (("--precision", self.precision), ("--reduce-dtype", self.reduce_dtype)):
            if value is not None and value not in DTYPE_BYTES:
                raise PlanError(f"{flag} {value!r} is not one of: {', '.join(DTYPE_BYTES)}")
        check_optimizer(self.optimizer, self.model)
        lora.check_lora(self.lora, self.base_dtype, self.model)
        if self.model is not None and self.model.num_params() != self.num_params:
            raise PlanError(f"num_params={self.num_params} differs from the model's {self.model.num_params()}")

    @classmethod
    def for_model(cls, model: ModelConfig, seq_len: int = 2048, **kwargs) -> Workload:
        return cls(model=model, num_params=model.num_params(), seq_len=seq_len, **kwargs)

    @classmethod
    def for_params(cls, num_params: float, seq_len: int = 2048, **kwargs) -> Workload:
        return cls(model=None, num_params=int(round(num_params)), seq_len=seq_len, **kwargs)

    @property
    def mixed(self) -> bool:
        return self.precision != "fp32"

    @property
    def param_bytes(self) -> int:
        return DTYPE_BYTES[self.precision]

    @property
    def grad_bytes(self) -> int:
        return DTYPE_BYTES[self.reduce_dtype or self.precision]


@dataclass(frozen=True)
class Layout:
    """How the work is split: degrees, ZeRO stage, micro-batch, recomputation, schedule.

    Fields:
        dp, tp, pp: data-, tensor- and pipeline-parallel degrees (ranks laid out pp × dp × cp × tp).
        cp: context-parallel degree: every sequence split over cp ranks (s/cp tokens each, attention
            by paratrain's ring, `paratrain.parallel.context`); they hold the same parameters for
            other tokens, so gradients are reduced and ZeRO shards over dp × cp (the runtime's
            "dp_cp" axis, `paratrain.mesh.Mesh.data_axis`).
        zero: ZeRO stage 0 (plain DDP) to 3.
        dp_shard: hybrid sharding (HSDP): ZeRO shards over groups of this many neighbouring data
            ranks and keeps dp / dp_shard replicas of the shards (dp = dp_replicate × dp_shard,
            dp_shard inner, as `paratrain.mesh.MeshShape` splits the data axis); 0 means dp (no
            split). It must divide dp and needs zero ≥ 1 (`layout_violations` says so).
        micro_batch: sequences per forward/backward on one data rank.
        virtual_stages: model chunks per pipeline rank (v > 1 only with an interleaving schedule).
        sequence_parallel: shard the norm/dropout regions along the sequence over tp.
        recompute: activation checkpointing mode.
        schedule: pipeline schedule (irrelevant when pp = 1).
        boundary: how stage boundaries travel under tp > 1 (`PipelineBoundary`).
        bucket_mb: gradient bucket size of DDP and ZeRO-1/2 in MiB (one collective per bucket;
            the last bucket of the backward cannot overlap with it).
        compile: each block runs `torch.compile`d (the run's `parallel.compile`): its element-wise
            operators fused (`KernelStack.FUSED`), else one kernel each (EAGER). Time only.
        ep: expert-parallel degree: a MoE model's experts split over groups of ep neighbouring data
            ranks (`paratrain.plan.moe`); it divides dp. 1: every data rank holds every expert.
        offload: None, "optimizer": each rank's masters and optimizer state in host memory, stepped by
            the host (`paratrain.parallel.data.offload`); "params" (ZeRO-3): the parameter shards too.
    """

    dp: int = 1
    tp: int = 1
    pp: int = 1
    zero: int = 0
    dp_shard: int = 0
    micro_batch: int = 1
    virtual_stages: int = 1
    sequence_parallel: bool = False
    recompute: Recompute = Recompute.NONE
    schedule: ScheduleName = ScheduleName.ONE_F_ONE_B
    boundary: PipelineBoundary = PipelineBoundary.SCATTER_GATHER
    bucket_mb: float = DEFAULT_BUCKET_BYTES / 2**20
    compile: bool = False
    cp: int = 1
    ep: int = 1
    offload: str | None = None

    def __post_init__(self):
        for name in ("dp", "tp", "pp", "cp", "micro_batch", "virtual_stages", "ep"):
            _positive_int(getattr(self, name), "--" + name.replace("_", "-"))
        if isinstance(self.dp_shard, bool) or not isinstance(self.dp_shard, int) or self.dp_shard < 0:
            raise PlanError(f"--dp-shard must be 0 (the whole data axis) or a positive integer, got {self.dp_shard!r}")
        if isinstance(self.bucket_mb, bool) or not isinstance(self.bucket_mb, (int, float)) or not self.bucket_mb > 0:
            raise PlanError(f"--bucket-mb must be a positive number, got {self.bucket_mb!r}")
        object.__setattr__(self, "boundary", _enum(PipelineBoundary, self.boundary, "--pipeline-boundary"))
        if self.zero not in ZERO_STAGES:
            raise PlanError(f"--zero {self.zero!r} is not a ZeRO stage; use {spelled(ZERO_STAGES)}")
        object.__setattr__(self, "recompute", _enum(Recompute, self.recompute, "--recompute"))
        object.__setattr__(self, "schedule", _enum(ScheduleName, self.schedule, "--schedule"))
        if self.offload not in (None, "optimizer", "params") or (self.offload == "params" and self.zero != 3):
            raise PlanError(f"--offload {self.offload!r}: the planner models 'optimizer', and 'params' with --zero 3")

    @property
    def world_size(self) -> int:
        return self.dp * self.cp * self.tp * self.pp

    @property
    def data_ranks(self) -> int:
        """Ranks holding the same parameters for different tokens: dp × cp (gradients are reduced over them)."""
        return self.dp * self.cp

    @property
    def shard_ranks(self) -> int:
        """Ranks ZeRO shards model state over: dp_shard (× cp), or the whole data axis (dp × cp) unsplit."""
        return (self.dp_shard or self.dp) * self.cp

    @property
    def dp_replicate(self) -> int:
        """Replicas of each ZeRO shard group on the data axis (1: no hybrid sharding)."""
        return max(1, self.data_ranks // self.shard_ranks)

    @property
    def data_axes(self) -> tuple[str, ...]:
        """The mesh axes the data-parallel collectives run on, named as paratrain's runtime names them.

        ("dp",) when the data axis is whole, ("dp_cp",) with context parallelism (the dp × cp ranks,
        `paratrain.mesh.DATA_CP`); ("dp_shard", "dp_replicate") under hybrid sharding
        (`paratrain.mesh.Mesh.shard_axis`), where ZeRO's reduce-scatters and all-gathers stay in
        the shard group and the reduced shards are all-reduced between replicas.
        """
        if self.dp_replicate > 1:
            return ("dp_shard", "dp_replicate")
        return ("dp",) if self.cp == 1 else ("dp_cp",)

    @property
    def chunks(self) -> int:
        """Model chunks per pipeline rank: v for a schedule that interleaves chunks, else 1."""
        return chunks_per_rank(self.schedule, self.virtual_stages)

    def num_microbatches(self, global_batch: int | None) -> int:
        """Micro-batches per step on each data rank: global / (dp × micro-batch), at least 1."""
        if global_batch is None:
            return 1
        return max(1, global_batch // (self.dp * self.micro_batch))

    def label(self) -> str:
        """Short one-line description, e.g. 'dp=8 tp=8 pp=1 zero=1 mb=1 recompute=selective sp'.

        A hybrid-sharded layout adds its shard group after dp: 'dp=32 dp_shard=8 tp=1 ...'; context
        parallelism its degree: 'dp=4 cp=2 tp=8 ...'; an expert-parallel one its ep degree: 'dp=64 ep=8 tp=1 ...'.
        """
        shard = f" dp_shard={self.shard_ranks}" if self.dp_replicate > 1 else ""
        shard += f" cp={self.cp}" if self.cp > 1 else ""
        shard += f" ep={self.ep}" if self.ep > 1 else ""
        text = f"dp={self.dp}{shard} tp={self.tp} pp={self.pp} zero={self.zero} mb={self.micro_batch} " \
               f"recompute={self.recompute.value}"
        if self.sequence_parallel:
            text += " sp"
        if self.compile:
            text += " compiled"
        if self.offload:
            text += f" offload={self.offload}"
        if self.pp > 1:
            text += f" {self.schedule.value}" + (f" v={self.chunks}" if self.chunks > 1 else "")
        return text


# pp = 1 runs no schedule: micro-batches one after another (gradient accumulation), never idle
_NO_PIPELINE = ScheduleTraits(in_flight=(1.0,), split_backward=False, bubble=0.0)


def pipeline_traits(schedule: ScheduleName, pp: int, num_microbatches: int, virtual_stages: int = 1) -> ScheduleTraits:
    """What the pipeline schedule does to memory and time, read off its actions (`traits_of`).

    The planner asks the schedule's data, never its name, so a new schedule needs no edit here.
    With pp = 1 no schedule runs: one micro-batch in flight, no bubble, one whole backward.
    """
    return _NO_PIPELINE if pp == 1 else traits_of(schedule, pp, num_microbatches, virtual_stages)


def in_flight_microbatches(schedule: ScheduleName, pp: int, num_microbatches: int, virtual_stages: int = 1,
                           stage: int = 0) -> float:
    """Micro-batches whose activations pipeline stage `stage` holds at its peak, in whole-stage units.

    With one stage (pp = 1) micro-batches run one after another (gradient accumulation): 1.
    Otherwise what the schedule's actions hold (`paratrain.parallel.pipeline.simulator.ScheduleTraits`):
    a micro-batch is held from its forward until its backward (its weight-grad pass W under a split
    backward), each of v chunks 1/v of the stage. So GPipe holds m; 1F1B min(p − i, m) on stage i
    (Narayanan et al. 2021 §2.2); interleaved 1F1B min(2·(p − i − 1) + (v − 1)·p + 1, v·m)/v, rank 0
    p + (p − 1)/v stages' worth, Korthikanti et al.'s factor 1 + (p − 1)/(p·v) on the L layers;
    ZB-H1 min(p, m) on every stage (its deferred weight gradients keep the inputs alive).
    """
    return pipeline_traits(schedule, pp, num_microbatches, virtual_stages).in_flight[stage]


@dataclass(frozen=True)
class MemoryBreakdown:
    """Peak bytes on one rank (the worst pipeline stage), by kind."""

    stage: int
    params: float
    grads: float
    master_weights: float
    adam_moments: float
    activations: float
    comm_buffers: float
    model_states_only: bool = False
    gradients_meet_activations: bool = True  # see `gradients_meet_activations`
    backward_tail: float = 0.0  # activations still alive when the last gradient is made (a recomputed layer)
    gathered_params: float = 0.0  # the part of comm_buffers alive as backward begins (ZeRO-3's gathered units)
    host: float = 0.0  # host memory of the offloaded optimizer (`Layout.offload`), not in `total`
    fp8_casts: float = 0.0  # the step's tensorwise FP8 weight casts (`fp8_cast_bytes`), alive through the step

    @property
    def optimizer_state(self) -> float:
        """fp32 master weights + Adam moments (K·Ψ, sharded from ZeRO-1)."""
        return self.master_weights + self.adam_moments

    @property
    def total(self) -> float:
        """The peak: everything at once, or, where the gradients are born as backward frees the activations,
        the larger of the two moments: backward beginning (activations, no gradient) and ending (every
        gradient, the activations of `backward_tail`)."""
        resident = self.params + self.optimizer_state + self.fp8_casts
        if self.gradients_meet_activations:
            return resident + self.comm_buffers + self.grads + self.activations
        return resident + max(self.activations + self.gathered_params,
                              self.grads + self.comm_buffers + self.backward_tail)

    def as_dict(self) -> dict[str, int | bool]:
        """Integer bytes per kind (JSON-ready); `optimizer_state` includes `master_weights`."""
        keys = ("params", "grads", "optimizer_state", "activations", "comm_buffers", "total",
                "master_weights", "adam_moments", "host", "fp8_casts")
        out: dict[str, int | bool] = {key: int(round(getattr(self, key))) for key in keys}
        out["stage"] = self.stage
        out["model_states_only"] = self.model_states_only
        return out


def stage_activation_bytes(workload: Workload, layout: Layout, stage: int) -> float:
    """Activations of one rank of `stage`: layers × in-flight micro-batches, logits, recompute working set.

    Per layer `layer_activation_bytes`; times the layers on the stage and the micro-batches the
    schedule keeps in flight there (`in_flight_microbatches`), a MoE layer's routed copies added
    (`paratrain.plan.moe.layer_activation_delta_bytes`); plus, on the last stage, the final norm and
    the fp32 log-probabilities of those micro-batches (`loss_stage_bytes`; under a kernel that
    materializes the scores, or cp, the fp32 logits; a fused loss keeps none); plus the larger of two
    transients that never meet: the loss's (its backward's buffers; fused, one chunk's logits) and, with full recomputation,
    one layer's activations rebuilt during its backward (Korthikanti et al. §5); plus, with
    context parallelism, the K/V blocks the ring of one layer has in flight (`ring_in_flight_bytes`).
    Under cp every rank holds s/cp tokens of each sequence, its logits included.
    """
    model, lay = workload.model, layout
    if model is None:
        return 0.0
    s, b = workload.seq_len, lay.micro_batch
    m = lay.num_microbatches(workload.global_batch)
    in_flight = in_flight_microbatches(lay.schedule, lay.pp, m, lay.chunks, stage)
    per_layer = _layer_bytes(workload, b, lay.tp, lay.cp, lay.sequence_parallel, lay.recompute, lay.compile)
    total = per_layer * layers_on_stage(model.n_layers, lay.pp, stage) * in_flight
    transient = max(recompute_working_bytes(workload, layout),
                    lora.decode_bytes(workload, lay.tp) if workload.lora else 0.0)
    if stage == lay.pp - 1:  # the loss's transient comes before any block's backward: never beside a recomputed one
        kept, loss_transient = loss_stage_bytes(s // lay.cp * b, model.dim, model.vocab_size, lay.tp,
                                                lay.sequence_parallel, workload.precision,
                                                workload.flash_attention and lay.cp == 1, workload.loss_chunk)
        if workload.lora:
            kept += lora.final_norm_bytes(workload, s // lay.cp * b, lay.tp if lay.sequence_parallel else 1)
        total, transient = total + kept * in_flight, max(transient, loss_transient)
    total += transient
    if lay.cp > 1:
        total += ring_in_flight_bytes(model, b, s // lay.cp, lay.tp, workload.param_bytes, workload.flash_attention)
    return total


@functools.lru_cache(maxsize=4096)
def _layer_bytes(workload: Workload, b: int, tp: int, cp: int, sequence_parallel: bool, recompute: Recompute,
                 compiled: bool) -> float:
    """One layer's activations for one micro-batch of `b` sequences (`stage_activation_bytes`): the same on every
    stage, and for every layout of a search that splits the same way."""
    model, s = workload.model, workload.seq_len
    per_layer = layer_activation_bytes(s, b, model.dim, model.n_heads, tp, sequence_parallel, recompute,
                                       workload.precision, kv_heads=model.n_kv_heads, ffn_dim=model.ffn_dim, cp=cp,
                                       flash=workload.flash_attention, compiled=compiled)
    per_layer += moe.layer_activation_delta_bytes(model, s // cp * b, tp, recompute is Recompute.SELECTIVE,
                                                  recompute is Recompute.FULL, DTYPE_BYTES[workload.precision],
                                                  workload.moe_imbalance)
    if workload.lora:
        per_layer += lora.activation_bytes_per_layer(workload, s // cp * b, recompute, compiled,
                                                     tp if sequence_parallel else 1)
    return per_layer


def recompute_working_bytes(workload: Workload, layout: Layout) -> float:
    """Under full recomputation, the one layer whose activations are rebuilt for its backward (Korthikanti §5);
    0 under any other mode, or with no model shape."""
    model, lay = workload.model, layout
    if model is None or lay.recompute is not Recompute.FULL:
        return 0.0
    return layer_activation_bytes(workload.seq_len, lay.micro_batch, model.dim, model.n_heads, lay.tp,
                                  lay.sequence_parallel, Recompute.NONE, workload.precision, kv_heads=model.n_kv_heads,
                                  ffn_dim=model.ffn_dim, cp=lay.cp, flash=workload.flash_attention,
                                  compiled=lay.compile)


def gradients_meet_activations(workload: Workload, layout: Layout) -> bool:
    """Whether a step's gradients are alive while its activations peak (as backward begins).

    They are under gradient accumulation and pipelines (the earlier micro-batches' gradients), and where
    DDP and ZeRO-1 keep their buckets for the whole run (data ranks > 1). Otherwise they are born during
    backward as the activations it reads die: on one data rank (added into the fp32 masters' as autograd
    leaves them) and in ZeRO-2/3 (reduced shards), with one micro-batch per step.
    """
    lay = layout
    if lay.pp > 1 or lay.num_microbatches(workload.global_batch) > 1:
        return True
    return lay.data_ranks > 1 and lay.zero <= 1


def stage_expert_params(workload: Workload, layout: Layout, stage: int) -> float:
    """Routed-expert parameters one rank of `stage` holds: its layers' E/ep experts, 3·h·f each (0 if dense)."""
    return _expert_params(workload, layout.pp, layout.ep, stage)


@functools.lru_cache(maxsize=4096)
def _expert_params(workload: Workload, pp: int, ep: int, stage: int) -> float:
    model = workload.model
    if not moe.is_moe(model):
        return 0.0
    layers = layers_on_stage(model.n_layers, pp, stage)
    return float(layers * model.n_experts // ep * moe.one_expert_params(model))


def stage_dense_params(workload: Workload, layout: Layout, stage: int) -> float:
    """Parameters one rank of `stage` holds outside the routed experts, tp-split as `stage_param_count` says."""
    return _dense_params(workload, layout.tp, layout.pp, stage)


@functools.lru_cache(maxsize=4096)
def _dense_params(workload: Workload, tp: int, pp: int, stage: int) -> float:
    if workload.model is None:
        return workload.num_params / (tp * pp)
    model = workload.model
    routed = layers_on_stage(model.n_layers, pp, stage) * -(-moe.routed_params_per_layer(model) // tp)
    return float(stage_param_count(model, tp, pp, stage) - routed)


def stage_model_states(workload: Workload, layout: Layout, stage: int) -> ModelStates:
    """Model states of one rank of `stage`: the dense parameters ZeRO-sharded over the shard group, the
    routed experts (E/ep per layer) over their replica group (`paratrain.plan.moe.expert_shard_ranks`)."""
    w, lay = workload, layout
    if w.lora:  # (without expert parallelism: `lora.lora_violation`)
        return lora.stage_states(w, lay, stage)
    experts = stage_expert_params(w, lay, stage)
    muon = stage_muon_params(w, lay, stage, experts)  # (every routed weight is an expert's matrix)
    dense = model_state_bytes(stage_dense_params(w, lay, stage), lay.shard_ranks, lay.zero, w.precision,
                              w.reduce_dtype, lay.offload, muon - experts if muon else 0.0)
    if not experts:
        return dense
    shards = moe.expert_shard_ranks(lay.shard_ranks, lay.ep)
    return dense + model_state_bytes(experts, shards, lay.zero, w.precision, w.reduce_dtype, lay.offload,
                                     experts if muon else 0.0)


def stage_fp8_weights(workload: Workload, layout: Layout, stage: int) -> float:
    """Weight elements one rank of `stage` holds in tensorwise FP8 linears (the ones the run converts); else 0."""
    if workload.fp8 != "tensorwise" or workload.model is None:
        return 0.0
    x = Shape.of(workload.model, layout.micro_batch, workload.seq_len, layout.tp, layout.sequence_parallel,
                 workload.precision, True, fp8="tensorwise", fp8_min_features=workload.fp8_min_features)
    return layers_on_stage(workload.model.n_layers, layout.pp, stage) * fp8_weight_params(x)


def fp8_cast_bytes(workload: Workload, layout: Layout, stage: int) -> float:
    """Tensorwise FP8 weight casts one rank of `stage` holds through a step under ZeRO-0..2: 1 byte per converted
    weight, cast at the step's first forward, kept to the optimizer step (`paratrain.parallel.fp8.Fp8Casts`; saved
    for the backward anyway). ZeRO-3 gathers the casts unit by unit (its gathers count them); rowwise keeps none."""
    return stage_fp8_weights(workload, layout, stage) if layout.zero < 3 else 0.0


# What a stage's model states and communication buffers read of a layout: its degrees and its ZeRO and bucket
# options, which every micro-batch size, recomputation mode and sequence-parallel choice of a search shares.
_STATE_FIELDS = ("dp", "cp", "tp", "pp", "ep", "dp_shard", "zero", "offload", "bucket_mb")
_STATES: dict[tuple, tuple[ModelStates, float, float]] = {}
_STATES_KEPT = 4096


def stage_states_and_buffers(workload: Workload, layout: Layout, stage: int) -> tuple[ModelStates, float, float]:
    """(`stage_model_states`, gathered parameters, gradient buffers (`comm_buffer_parts`)) of one rank of `stage`,
    computed once per workload, stage and `_STATE_FIELDS` of the layout (a search asks for them per candidate)."""
    key = (workload, stage, *(getattr(layout, name) for name in _STATE_FIELDS))
    found = _STATES.get(key)
    if found is None:
        psi = stage_dense_params(workload, layout, stage) + stage_expert_params(workload, layout, stage)
        if workload.lora:  # only the adapters have gradients to reduce
            psi = lora.stage_adapters(workload, layout, stage)
        found = (stage_model_states(workload, layout, stage), *comm_buffer_parts(workload, layout, psi))
        if len(_STATES) >= _STATES_KEPT:
            _STATES.clear()
        _STATES[key] = found
    return found


def clear_caches() -> None:
    """Forget every quantity computed once and kept (`stage_states_and_buffers`, the stages' parameter counts, a
    layer's activations)."""
    _STATES.clear()
    _dense_params.cache_clear()
    _expert_params.cache_clear()
    _layer_bytes.cache_clear()


def stage_memory(workload: Workload, layout: Layout, stage: int) -> MemoryBreakdown:
    """Memory of one rank of pipeline stage `stage`."""
    states, gathered, gradient_buffers = stage_states_and_buffers(workload, layout, stage)
    return MemoryBreakdown(
        stage=stage, params=states.params, grads=states.grads, master_weights=states.master_weights,
        adam_moments=states.adam_moments, activations=stage_activation_bytes(workload, layout, stage),
        comm_buffers=gathered + gradient_buffers, model_states_only=workload.model is None,
        gathered_params=gathered,
        gradients_meet_activations=workload.model is None or gradients_meet_activations(workload, layout),
        backward_tail=recompute_working_bytes(workload, layout), host=states.host,
        fp8_casts=fp8_cast_bytes(workload, layout, stage),
    )


def estimate_memory(workload: Workload, layout: Layout) -> MemoryBreakdown:
    """Peak memory per rank: the breakdown of the pipeline stage with the largest total."""
    return max((stage_memory(workload, layout, stage) for stage in range(layout.pp)), key=lambda m: m.total)
