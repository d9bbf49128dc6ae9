"""Every layout rule, decided in one place: which degrees and strategy options can run together.

A layout is the degrees (dp, tp, pp, cp, and dp_shard for hybrid sharding) and the strategies' options
(ZeRO stage, sequence parallelism, pipeline schedule, virtual stages); `LayoutSpec` holds it with
what the caller knows of the run around it: the world and its nodes, the model's shape, the batch,
the sequence length. A rule whose input is not known (None) waits: `parallelize` knows its mesh and
options, the trainer's preflight the model and batch too, the planner each candidate of a search.

`layout_violations` is the one list of the rules, in one fixed order; each broken rule is a
`Violation` (a rule name, for grouping, and a one-line reason naming the fix). `check_layout` raises
the first in the caller's error type and returns a `CheckedLayout`, which the caller carries down so
that one run decides its layout once (`paratrain train`: the preflight decides, `parallelize`
receives the verdict). Everyone asks this module, each caller converting its own kind of layout
into a `LayoutSpec` once (a `layout_spec` beside that kind) and asking `check_layout` (or
`layout_violations`) here:

    parallelize()        its mesh and options (`api._layout_spec`), or the caller's CheckedLayout
    paratrain train      the preflight: a Config (`paratrain.config.layout_spec`): world, model, batch, seq len
    paratrain plan       a planned Layout and Workload (`paratrain.plan.search.layout_spec`), every candidate
    paratrain verify     each layout, through the trainer's preflight, or for the user's own model a parsed
                         layout (`paratrain.verify.layout_spec`)

The rules of a schedule's own arguments stay with the schedules, whose generator checks them too
(`paratrain.parallel.pipeline.schedules.schedule_violations`); this module asks it.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from enum import Enum
from typing import Any

from paratrain.errors import ParatrainError, Violation
from paratrain.parallel.pipeline.schedules import DEFAULT_SCHEDULE, ScheduleName, schedule_violations

ZERO_STAGES = (0, 1, 2, 3)  # 0: DDP; 1: + optimizer state sharded; 2: + gradients; 3: + parameters
# With fp8 on CUDA, block linears with fewer input or output features than this stay in the compute dtype: the
# three casts per matmul cost memory traffic that a small matmul's faster FP8 throughput does not repay
# (`paratrain.parallel.fp8.convertible` applies it, the planner prices it; here so the planner needs no torch).
FP8_CUDA_MIN_FEATURES = 1024
# The default loss takes the head's matmul and the cross-entropy together in chunks of this many tokens
# (`paratrain.parallel.loss`; the planner prices it): 1024 × 128,256 × 4 B = 0.5 GB of fp32 logits at a time, a
# matmul still large enough to run at a GPU's full rate.
DEFAULT_LOSS_CHUNK = 1024
# LoRA's frozen base (`paratrain.parallel.lora`): how its adapted weights may be stored, and the NF4 format's blocks
# (`paratrain.parallel.nf4`): here so the planner needs no torch.
LORA_BASE_DTYPES = ("bf16", "nf4", "fp8")
NF4_BLOCK_SIZE = 64  # elements a block's absmax scales
NF4_SCALER_BLOCK_SIZE = 256  # block scales one double-quantization factor scales


def nf4_bytes_per_parameter(dtype_bytes: int, block_size: int = NF4_BLOCK_SIZE,
                            scaler_block_size: int = NF4_SCALER_BLOCK_SIZE) -> float:
    """Bytes of an NF4 weight per element: its codes (1/2), its int8 scales (1/block_size) and its factors in the
    weight's dtype (one per block of scales; the one mean is left out)."""
    return 0.5 + 1 / block_size + dtype_bytes / (block_size * scaler_block_size)


def unsupported_with_lora(ep: int = 1, fp8=None) -> list[str]:
    """The strategies of a layout that do not honour LoRA yet, by their options' names (empty: it runs).

    DDP and ZeRO-1/2/3 (hybrid sharding too) reduce and shard only the parameters that train, so the adapters
    alone (ZeRO-3 shards and gathers the frozen base too, at its stored bytes, and never reduces it), and so do the
    pipeline's stages, the context-parallel ring, the optimizer's offload to the host, full and selective
    recomputation and compiled blocks; tensor parallelism (with sequence parallelism) splits each adapter with its
    base linear (`paratrain.parallel.tensor.adapters`; each tested against one process). Expert parallelism is
    untested with frozen parameters; FP8 converts the same linears.
    """
    asked = {"--ep": ep > 1, "--fp8": bool(fp8)}
    return [name for name, on in asked.items() if on]


def lora_refusal(names: list[str]) -> str:
    """The one-line refusal of LoRA with the strategies `unsupported_with_lora` named."""
    return (f"LoRA with {', '.join(names)} is not supported yet (it runs with DDP, ZeRO-1/2/3, tensor, sequence, "
            f"pipeline and context parallelism, offload, recomputation and compile); drop "
            f"{'it' if len(names) == 1 else 'them'}")


class Recompute(str, Enum):
    """Activation checkpointing (Korthikanti et al. 2022 §5), as paratrain runs it (`parallel/recompute.py`)."""

    NONE = "none"
    SELECTIVE = "selective"  # keep the matmuls' and attention's outputs, recompute the element-wise rest
    FULL = "full"  # keep each layer's input, recompute the whole layer in backward


class RecomputeError(ParatrainError, ValueError):
    """An activation-checkpointing setting that is not one of the modes; the message names them."""


@dataclass(frozen=True)
class Checkpointing:
    """Which blocks recompute (every `every`-th one) and how (`mode`)."""

    mode: Recompute = Recompute.NONE
    every: int = 1

    @classmethod
    def parse(cls, value) -> Checkpointing:
        """From `activation_checkpointing`: 0 / "none", "full", "selective", or k ≥ 1 (full, every k-th block)."""
        if isinstance(value, Checkpointing):
            return value
        if isinstance(value, str) and value.strip().isdigit():
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, (int, str, Recompute)):
            value = repr(value)
        elif isinstance(value, int) and value >= 0:
            return cls(Recompute.FULL, value) if value else cls()
        elif not isinstance(value, int):
            try:
                return cls(Recompute(value))
            except ValueError:
                pass
        raise RecomputeError(f"--activation-checkpointing {value} is not one of none, full, selective or k ≥ 1 "
                             f"(every k-th block fully)")

    @property
    def enabled(self) -> bool:
        return self.mode is not Recompute.NONE

    @property
    def planned(self) -> Recompute:
        """What the planner counts: every block's mode; every k-th block (k > 1) keeps most activations,
        counted as none (an over-estimate, never an under-estimate)."""
        return self.mode if self.every == 1 else Recompute.NONE


def spelled(values) -> str:
    """'0, 1, 2 or 3': a short list of choices as a message writes it."""
    values = [str(v) for v in values]
    return values[0] if len(values) == 1 else f"{', '.join(values[:-1])} or {values[-1]}"


class LayoutRuleError(ParatrainError, ValueError):
    """A layout breaks a rule; the message names the rule and the fix (callers may ask for their own type)."""


@dataclass(frozen=True)
class LayoutSpec:
    """A layout as the rules read it, with what is known of the run around it (None: unknown here).

    dp, tp, pp, cp: the degrees; dp_shard: ranks of a ZeRO shard group (0 or dp: the whole data axis);
    ep: data ranks that split the experts of MoE layers (expert parallelism).
    zero, sequence_parallel, schedule, virtual_stages: the strategies' options.
    world_size: ranks of the job; gpus_per_node: devices of one node (tp must fit in one).
    model: the reference model's shape (a `ModelConfig`: heads, kv heads, ffn, vocabulary, layers).
    params_only: only the parameter count is known (the planner's --params), so tp and pp, which
        split the model's shape, cannot be estimated.
    global_batch, micro_batch: sequences per step (all data ranks) and per forward/backward.
    batch_defaulted: the user set neither: both are the trainer's defaults for this dp, which it would resolve
        again for another (so another dp is not held to them).
    seq_len: tokens per sequence.
    activation_checkpointing: 0 / "none" off, "full", "selective", or k (every k-th block, full).
    precision, fp8, offload: the compute precision's name ("fp32", "bf16", "fp16"), the FP8 recipe and the
        offload mode (None: off, or not known here).
    chunked_document_mask: the documents are masked by a model that builds its mask from the tokens a rank
        holds (transformers' models), not from whole sequences.
    compile: the blocks are compiled (`paratrain.parallel.compile`; False, True, or a torch.compile backend).
    """

    dp: int
    tp: int = 1
    pp: int = 1
    dp_shard: int = 0
    zero: int = 0
    sequence_parallel: bool = False
    schedule: str | ScheduleName = DEFAULT_SCHEDULE
    virtual_stages: int = 1
    world_size: int | None = None
    gpus_per_node: int | None = None
    model: Any = None
    params_only: bool = False
    global_batch: int | None = None
    micro_batch: int | None = None
    seq_len: int | None = None
    cp: int = 1
    activation_checkpointing: int | str = 0
    ep: int = 1
    batch_defaulted: bool = False
    precision: str | None = None
    fp8: str | None = None
    offload: str | None = None
    chunked_document_mask: bool = False
    compile: bool | str = False

    @property
    def num_microbatches(self) -> int | None:
        """Micro-batches per step on each data rank (at least 1), when the batch is known."""
        if self.global_batch is None or self.micro_batch is None:
            return None
        return max(1, self.global_batch // (self.dp * self.micro_batch))

    @property
    def chunks(self) -> int:
        """Model chunks per pipeline rank: the virtual stages under the interleaved schedule, else 1."""
        return self.virtual_stages if self.schedule == ScheduleName.INTERLEAVED else 1


@dataclass(frozen=True)
class CheckedLayout:
    """A layout that passed every rule `check_layout` could decide: carried down so nothing decides it again."""

    spec: LayoutSpec

    @property
    def dp(self) -> int:
        return self.spec.dp

    @property
    def accumulation(self) -> int:
        """Micro-batches per data rank per step (the batch rule holds: it divides exactly)."""
        s = self.spec
        return s.global_batch // (s.micro_batch * s.dp)

    def describes(self, other: LayoutSpec) -> bool:
        """Whether this verdict is about `other`'s degrees and options (what `parallelize` knows of a layout)."""
        mine, theirs = self.spec, other
        return ((mine.dp, mine.tp, mine.pp, mine.cp, mine.dp_shard or mine.dp, mine.zero, mine.sequence_parallel,
                 ScheduleName.parse(mine.schedule), mine.virtual_stages, mine.ep, mine.fp8, mine.offload,
                 bool(mine.compile))
                == (theirs.dp, theirs.tp, theirs.pp, theirs.cp, theirs.dp_shard or theirs.dp, theirs.zero,
                    theirs.sequence_parallel, ScheduleName.parse(theirs.schedule), theirs.virtual_stages, theirs.ep,
                    theirs.fp8, theirs.offload, bool(theirs.compile)))


# -- the list ----------------------------------------------------------------------------------

def layout_violations(layout: LayoutSpec) -> list[Violation]:
    """Every rule `layout` breaks, in one fixed order (empty when it can run). Memory is not a rule here.

    The order: where the ranks sit (tp within a node), then what another (dp, tp, pp) of the same
    world could fix (`divisibility_violations`), then the shard groups, ZeRO-3 with pipelines,
    sequence and context parallelism, the features that plug into the strategies (FP8, offload, a
    document mask under cp), and the schedule.
    """
    s = layout
    return (node_violations(s.tp, s.gpus_per_node) + divisibility_violations(s)
            + shard_group_violations(s.dp, s.dp_shard, s.zero) + zero_stage_violations(s.zero, s.pp)
            + sequence_parallel_violations(s.sequence_parallel, s.tp, s.seq_len)
            + context_parallel_violations(s.cp, s.seq_len, s.dp_shard, s.dp)
            + fp8_violations(s.fp8, s.precision) + offload_violations(s.offload, s.zero)
            + document_mask_violations(s.cp, s.chunked_document_mask) + compile_violations(s.compile, s.cp)
            + expert_parallel_violations(s)
            + recompute_violations(s.activation_checkpointing, s.schedule, s.pp)
            # layers % pp is a divisibility rule; the schedule adds the chunks of interleaving
            + schedule_violations(s.schedule, s.pp, s.virtual_stages, s.num_microbatches,
                                  s.model.n_layers if s.model is not None and s.chunks > 1 else None))


def divisibility_violations(layout: LayoutSpec) -> list[Violation]:
    """The rules on the degrees that another (dp, tp, pp) of the same world may satisfy: the world
    size, the model's shape under tp and pp, the batch over the data ranks (`nearest_layouts`)."""
    s = layout
    out = world_violations(s.world_size, s.dp, s.tp, s.pp, s.cp) + shape_violations(s.params_only, s.tp, s.pp)
    if s.model is not None:
        out += (llama_tp_violations(s.model, s.tp) + layer_violations(s.model.n_layers, s.pp)
                + pipeline_model_violations(s.model, s.pp))
    return out + batch_violations(s.global_batch, s.micro_batch, s.dp)


def check_layout(layout: LayoutSpec, error: type[Exception] = LayoutRuleError) -> CheckedLayout:
    """The layout's verdict: `error` with the first broken rule's message (`explain`), else a CheckedLayout."""
    broken = layout_violations(layout)
    if broken:
        raise error(explain(layout, broken[0]))
    return CheckedLayout(layout)


def explain(layout: LayoutSpec, violation: Violation) -> str:
    """The one-line message of a broken rule; a divisibility rule also names the nearest valid layouts."""
    if violation not in divisibility_violations(layout):
        return violation.message
    s = layout
    near = nearest_layouts(layout)
    hint = ("; nearest valid layouts: " + ", ".join(f"dp={d} tp={t} pp={p}" for d, t, p in near) if near else
            f"; no layout of {s.world_size or s.dp * s.tp * s.pp * s.cp} ranks fits global batch {s.global_batch} with "
            f"micro-batch {s.micro_batch} (change the batch sizes)")
    return f"invalid layout dp={s.dp} tp={s.tp} pp={s.pp}: {violation.message}{hint}"


def nearest_layouts(layout: LayoutSpec, count: int = 3) -> list[tuple[int, int, int]]:
    """Valid (dp, tp, pp) of the same world, closest to the layout's degrees (log-distance).

    Valid for the divisibility rules; without the model's shape only tp = pp = 1 is offered (the
    shape would have to say whether tp and pp divide it).
    """
    world = layout.world_size or layout.dp * layout.tp * layout.pp * layout.cp
    valid = []
    for t in _divisors(world // layout.cp):  # cp stays: it answers the sequence length, not the world
        for p in _divisors(world // (layout.cp * t)):
            d = world // (layout.cp * t * p)
            candidate = dataclasses.replace(layout, dp=d, tp=t, pp=p, world_size=world,
                                            params_only=layout.params_only or layout.model is None)
            if layout.batch_defaulted and d != layout.dp:  # the defaults resolve again for another dp
                candidate = dataclasses.replace(candidate, global_batch=None, micro_batch=None)
            if not divisibility_violations(candidate):
                distance = (abs(math.log2(d / layout.dp)) + abs(math.log2(t / layout.tp))
                            + abs(math.log2(p / layout.pp)))
                valid.append((distance, -d, (d, t, p)))
    return [degrees for _, _, degrees in sorted(valid)[:count]]


# -- the rules, one function each ----------------------------------------------------------------

def node_violations(tp: int, gpus_per_node: int | None) -> list[Violation]:
    """A tensor-parallel group communicates in every layer, forward and backward: it stays inside a node."""
    if gpus_per_node is not None and tp > gpus_per_node:
        return [Violation("tp_node", f"tp {tp} exceeds {gpus_per_node} GPUs per node")]
    return []


def world_violations(world_size: int | None, dp: int, tp: int, pp: int, cp: int = 1) -> list[Violation]:
    """pp × dp × cp × tp is the world size (when it is known)."""
    if world_size is not None and dp * tp * pp * cp != world_size:
        if cp == 1:
            return [Violation("world", f"dp × tp × pp = {dp} × {tp} × {pp} = {dp * tp * pp} ≠ {world_size} ranks")]
        return [Violation("world", f"dp × cp × tp × pp = {dp} × {cp} × {tp} × {pp} = {dp * cp * tp * pp} ≠ "
                                   f"{world_size} ranks")]
    return []


def shard_group_violations(dp: int, dp_shard: int, zero: int | None) -> list[Violation]:
    """A shard group (--dp-shard) divides the data axis, and only ZeRO has shards to group."""
    if dp_shard and (dp_shard < 1 or dp % dp_shard):
        return [Violation("dp_shard", f"--dp-shard {dp_shard} does not divide dp = {dp} "
                                      f"(choose among {_divisors(dp)})")]
    if dp_shard and dp_shard < dp and zero == 0:
        return [Violation("dp_shard", f"--dp-shard {dp_shard} < dp = {dp} splits ZeRO shards into replicas; "
                                      f"it needs --zero {spelled(ZERO_STAGES[1:])} (DDP shards nothing)")]
    return []


def degree_violations(world_size: int | None, dp: int, tp: int, pp: int, dp_shard: int = 0,
                      zero: int | None = None) -> list[Violation]:
    """The rules of the degrees themselves: the world size, and the shard groups of hybrid sharding."""
    return world_violations(world_size, dp, tp, pp) + shard_group_violations(dp, dp_shard, zero)


def shape_violations(params_only: bool, tp: int, pp: int) -> list[Violation]:
    """tp and pp split the model's layers and matrices: a parameter count alone cannot say how."""
    if params_only and (tp > 1 or pp > 1):
        return [Violation("shape", "tp and pp need the model's shape; give --model or --layers/--hidden/--heads "
                                   "instead of --params")]
    return []


def llama_tp_violations(model_cfg, tp: int) -> list[Violation]:
    """The reference model under `LLAMA_TP_PLAN`: tp must divide the heads, the kv heads, the ffn width
    and the vocabulary (Megatron's partitioning); the plan's styles check the same on the modules."""
    checks = (("heads", "heads", model_cfg.n_heads), ("kv_heads", "kv heads", model_cfg.n_kv_heads),
              ("ffn", "ffn", model_cfg.ffn_dim), ("vocab", "vocab", model_cfg.vocab_size))
    return [Violation(f"{rule}_tp", f"{name} {size} not divisible by tp {tp}") for rule, name, size in checks
            if size % tp]


def layer_violations(n_layers: int, pp: int) -> list[Violation]:
    """Each pipeline stage holds the same number of layers."""
    if n_layers % pp:
        return [Violation("layers_pp", f"layers {n_layers} not divisible by pp {pp}")]
    return []


def pipeline_model_violations(model, pp: int) -> list[Violation]:
    """What of the model pipeline stages cannot split: a transformers family they do not lay out (its
    `pipeline_refusal`, `paratrain.models.hf.check_layable`'s reason), and a head tied to the embedding on
    more than 2 stages (the copies of the table on the first and last stage have their gradients summed over the
    pp axis, `paratrain.parallel.pipeline.stages.StageSplit.shared`, which then holds only them)."""
    if pp == 1:
        return []
    refusal = getattr(model, "pipeline_refusal", None)
    if refusal:
        return [Violation("pp_model", f"{refusal}; use pp 1")]
    if pp > 2 and getattr(model, "tie_embeddings", False):
        return [Violation("pp_tied", f"the output head is tied to the embedding, whose two copies (first and last "
                                     f"stage) pp {pp} would not hold alone; use pp 2 (or untie the head)")]
    return []


def batch_violations(global_batch: int | None, micro_batch: int | None, dp: int) -> list[Violation]:
    """The global batch must split into micro-batches over the data ranks (accumulation = global / (micro × dp))."""
    if global_batch is None or micro_batch is None or global_batch % (micro_batch * dp) == 0:
        return []
    per_step = micro_batch * dp
    lower = global_batch - global_batch % per_step
    options = [b for b in (lower, lower + per_step) if b > 0]
    hint = " or ".join(f"--global-batch {b}" for b in options)
    divisors = [m for m in range(1, global_batch + 1) if global_batch % (m * dp) == 0]
    if divisors:
        hint += f", or --micro-batch in {divisors}"
    return [Violation("batch", f"--global-batch {global_batch} is not divisible by --micro-batch {micro_batch} x "
                               f"{dp} data rank(s); use {hint}")]


def zero_stage_violations(zero: int, pp: int) -> list[Violation]:
    """ZeRO-3 is refused with pipeline parallelism.

    A stage runs the forward and the backward of every micro-batch at different times,
    interleaved with other micro-batches, so ZeRO-3 would all-gather the stage's parameters for
    each micro-batch's forward and again for its backward (4·m gathers per step, m× plain
    ZeRO-3's traffic) and could not defer its gradient reduce-scatter across micro-batches; or it
    would keep them gathered between uses, which gives back the memory ZeRO-3 saves. DeepSpeed's
    pipeline engine refuses it for the same reason; ZeRO-1/2 shard the optimizer state, most of
    the saving.
    """
    if zero == 3 and pp > 1:
        return [Violation("zero3_pp", f"--zero 3 with --pp {pp} is refused: ZeRO-3 would re-gather every stage's "
                                      "parameters for each micro-batch; use --zero 1 or 2, which shard the "
                                      "optimizer state")]
    return []


def sequence_parallel_violations(sequence_parallel: bool, tp: int, seq_len: int | None = None) -> list[Violation]:
    """Sequence parallelism splits the sequence over the tp ranks: it needs tp > 1 and a length tp divides."""
    if not sequence_parallel:
        return []
    if tp == 1:
        return [Violation("sp_tp", "--sequence-parallel needs tensor parallelism (--tp > 1)")]
    if seq_len is not None and seq_len % tp:
        return [Violation("sp_seq", f"--seq-len {seq_len} is not divisible by --tp {tp}, which sequence "
                                    f"parallelism needs; use --seq-len {seq_len - seq_len % tp or tp}")]
    return []


def recompute_violations(activation_checkpointing: int | str, schedule: str | ScheduleName,
                         pp: int) -> list[Violation]:
    """Selective recomputation answers one backward per block (torch's selective-checkpoint contexts replay
    the saved outputs once); zb-h1 runs two per block, the input gradients and later the weight gradients.
    Full recomputation composes with every schedule (it recomputes the block for each)."""
    if (pp > 1 and ScheduleName.parse(schedule) is ScheduleName.ZB_H1
            and Checkpointing.parse(activation_checkpointing).mode is Recompute.SELECTIVE):
        return [Violation("recompute_schedule", "--activation-checkpointing selective with --schedule zb-h1 is "
                                                "refused (zb-h1 runs two backwards per block, selective "
                                                "recomputation answers one); use --activation-checkpointing full "
                                                "or --schedule 1f1b")]
    return []


def context_parallel_violations(cp: int, seq_len: int | None, dp_shard: int = 0, dp: int = 1) -> list[Violation]:
    """Context parallelism splits every sequence into 2·cp chunks (rank i holds chunks i and 2·cp−1−i, so
    causal attention costs each rank the same): the length must divide into them.

    Composes with data parallelism (DDP, ZeRO-1/2/3) and tensor parallelism (with sequence parallelism
    too: each tp rank then holds 1/tp of this rank's chunks between the attention regions), with pipeline
    parallelism (every schedule: each stage runs on this rank's chunks with their positions, its
    attention a ring over the cp ranks of its stage) and with activation checkpointing (the recompute
    runs its attention through the ring again). Not yet composed (refused here, one home for the
    refusal): hybrid sharding, whose shard groups would have to span dp_shard × cp ranks (cp ranks hold
    partial gradients of the same shards) and its replicas the dp_replicate ranks of one cp coordinate,
    groups the mesh does not build. That cp needs causal SDPA attention is found in the forward
    (`paratrain.parallel.context`): only then is the attention seen.
    """
    if cp == 1:
        return []
    if seq_len is not None and seq_len % (2 * cp):
        fit = seq_len - seq_len % (2 * cp) or 2 * cp
        return [Violation("cp_seq", f"--seq-len {seq_len} is not divisible by 2 × --cp = {2 * cp} (each rank holds "
                                    f"2 load-balanced chunks); use --seq-len {fit}")]
    if dp_shard and dp_shard < dp:
        return [Violation("cp_dp_shard", f"--cp {cp} with --dp-shard {dp_shard} is not supported yet (cp ranks' "
                                         "gradients must join the shard groups); drop --dp-shard")]
    return []


def fp8_violations(fp8: str | None, precision: str | None) -> list[Violation]:
    """FP8 computes the blocks' matmuls from bf16 operands and keeps bf16 for everything it does not cast
    (`paratrain.parallel.fp8`); which recipes and devices it runs on is that module's to check."""
    if fp8 and precision is not None and precision != "bf16":
        return [Violation("fp8_precision", f"--fp8 {fp8} needs --precision bf16 (not {precision}): FP8 keeps bf16 "
                                           f"for what it does not cast (parallelize: use precision='bf16')")]
    return []


def offload_violations(offload: str | None, zero: int | None) -> list[Violation]:
    """Offloading the parameters moves ZeRO-3's parameter shards to the host (`paratrain.parallel.data.offload`):
    below ZeRO-3 there are none, every rank holds the whole parameters it computes with."""
    if offload == "params" and zero is not None and zero != 3:
        return [Violation("offload_zero", f"--offload params needs --zero 3 (got --zero {zero}): offloading the "
                                          f"parameters needs ZeRO-3, whose parameters are sharded; use --offload "
                                          f"optimizer below ZeRO-3")]
    return []


def document_mask_violations(cp: int, chunked_document_mask: bool) -> list[Violation]:
    """Under context parallelism each rank holds chunks of every sequence: a document mask built from the tokens a
    rank holds (transformers' models build theirs so) would cut the documents at the chunks' edges. The reference
    model masks the whole sequences' documents, which every cp rank holds the token ids of."""
    if cp > 1 and chunked_document_mask:
        return [Violation("cp_document_mask", f"--document-mask with --cp {cp}: transformers' model builds its "
                                              "document mask from the chunks a rank holds, not the whole sequences; "
                                              "use the reference model (--backend reference, a llama/mixtral "
                                              "directory), --cp 1, or --no-document-mask")]
    return []


def compile_violations(compile: bool | str, cp: int) -> list[Violation]:
    """Context parallelism answers the blocks' SDPA calls through a function mode (`paratrain.parallel.context`),
    which a compiled block bypasses: the two do not compose yet."""
    if compile and cp > 1:
        return [Violation("compile_cp", f"compile with context parallelism (cp > 1) is not supported yet; drop one "
                                        f"(--compile or --cp {cp})")]
    return []


def expert_parallel_violations(layout: LayoutSpec) -> list[Violation]:
    """Expert parallelism splits the experts of every MoE layer over ep neighbouring data ranks.

    ep divides dp, and the model (when known) has MoE layers whose expert count ep divides. ZeRO-3
    composes: each expert block is sharded over the `ep_replicate` ranks that hold it, every other
    parameter over the data axis. Not yet composed (refused here, one home for the refusal): hybrid
    sharding and context parallelism (the data axis split twice), sequence parallelism (each tp
    rank would route a different part of a sequence, so the auxiliary loss and the experts'
    gradients would be partial over tp).
    """
    s, ep = layout, layout.ep
    model = s.model
    if ep == 1:
        return []
    if ep < 1 or s.dp % ep:
        return [Violation("ep_dp", f"--ep {ep} does not divide dp = {s.dp} (expert ranks are data ranks); "
                                   f"choose --ep among {_divisors(s.dp)}")]
    if model is not None and not getattr(model, "n_experts", 0):
        return [Violation("ep_dense", f"--ep {ep} needs a mixture-of-experts model, which this one is not "
                                      "(n_experts = 0); use --ep 1 or an MoE model such as tiny-moe")]
    if model is not None and model.n_experts % ep:
        return [Violation("ep_experts", f"--ep {ep} does not divide the model's {model.n_experts} experts; "
                                        f"choose --ep among {[d for d in _divisors(model.n_experts) if s.dp % d == 0]}")]
    refused = [(bool(s.dp_shard) and s.dp_shard < s.dp, f"--dp-shard {s.dp_shard}", "drop --dp-shard"),
               (s.cp > 1, f"--cp {s.cp}", "drop --cp"),
               (s.sequence_parallel, "--sequence-parallel", "drop --sequence-parallel")]
    return [Violation("ep_compose", f"--ep {ep} with {what} is not supported yet; {fix}")
            for bad, what, fix in refused if bad][:1]


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


# -- Muon -----------------------------------------------------------------------------------------------

MUON_NS_STEPS = 5  # torch.optim.Muon's Newton–Schulz steps (its default; the planner's assumption)


def newton_schulz_flops(shape, steps: int = MUON_NS_STEPS) -> int:
    """FLOPs of Muon's Newton–Schulz iteration on one matrix of `shape` (its last two dims) in one optimizer step:
    per step, for m ≤ n, X Xᵀ (2m²n), the Gram polynomial bA + cA² (2m³) and its product with X (2m²n). The optimizer
    (`paratrain.parallel.muon`) counts what it runs with it, the planner (`paratrain.plan.muon`) prices it."""
    m, n = sorted(tuple(shape)[-2:])
    return steps * (4 * m * m * n + 2 * m ** 3)
