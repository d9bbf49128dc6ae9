"""parallelize(): apply paratrain's strategies to a plain module, in one fixed order.

    mesh = paratrain.init_mesh(dp=4)
    model, optimizer = paratrain.parallelize(model, mesh, optimizer=partial(torch.optim.AdamW, lr=3e-4),
                                             data=DataParallel(zero=3), precision="bf16")
    loss = loss_fn(model(x), y); loss.backward(); optimizer.step(); optimizer.zero_grad()

Options come grouped by strategy, each a small frozen dataclass: `DataParallel` (ZeRO stage,
buckets, gradient reduction, ZeRO-3 units), `TensorParallel` (the plan, sequence parallelism),
`PipelineParallel` (schedule, virtual stages, stage boundaries); precision and activation
checkpointing (`recompute`) and compilation (`compile`) apply to every layout. The returned model is a `ParallelModel`
(`paratrain.parallel.model`, one type for every layout); the returned optimizer is the stock
torch optimizer the caller asked for, built over the master weights the engine owns (ZeRO: this
rank's shard), with a pre-step hook that finishes the gradients and agrees on the step when the
caller did not, and a post-step hook that brings the parameters up to date.

The body of `parallelize_run` (the one entry: `parallelize` is it without the trainer's own
communication layer and layout verdict) is a checklist of `_apply_…` steps, each taking the model,
the mesh's communication layer and its own option group: the model as the user built it (LoRA,
context parallelism's reading of the forward), this rank's share of it (pipeline split, experts,
tensor parallelism, FP8, materialization), how each block runs (recomputation, compilation, the
fused loss), and how the ranks train it together (the data-parallel engine, the pipeline runner,
offload, the model and its optimizer). One `Initializer` carries each parameter's value through the
steps that change what a rank holds.
"""

from __future__ import annotations

import functools
import warnings
from dataclasses import dataclass
from typing import Callable, Iterable, Mapping

import torch
from torch import nn

from paratrain.comm import Comm
from paratrain.errors import ParatrainError
from paratrain.parallel.materialize import Initializer, to_empty
from paratrain.mesh import Axis, Mesh
from paratrain.parallel import rules
from paratrain.parallel.blocks import UnitSpec
from paratrain.parallel.data.ddp import DataParallelEngine
from paratrain.parallel.data.engine import GradReduction
from paratrain.parallel.data.offload import check_offload
from paratrain.parallel.lora import LoRA
from paratrain.parallel.loss import fuse_head, loss_head_name
from paratrain.parallel.model import ParallelModel
from paratrain.parallel.pipeline.schedules import DEFAULT_SCHEDULE, ScheduleName
from paratrain.parallel.recompute import Checkpointing, checkpoint_blocks
from paratrain.parallel.rules import ZERO_STAGES, CheckedLayout, LayoutSpec
from paratrain.parallel.tensor.info import TensorParallelInfo
from paratrain.parallel.tensor.plan import PlannedModel, apply_tensor_parallel
from paratrain.precision import Precision, precision_policy

ELEMENTWISE_OPTIMIZERS = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adamax,
                          torch.optim.Adagrad, torch.optim.RMSprop, torch.optim.NAdam, torch.optim.RAdam,
                          torch.optim.Adadelta)


class ParallelConfigError(ParatrainError, ValueError):
    """parallelize() was asked for something it cannot do; the message says what instead."""


@dataclass(frozen=True)
class DataParallel:
    """Data parallelism over the mesh's dp axis.

    A mesh whose data axis is split (`init_mesh(dp_shard=...)`: hybrid sharding) makes ZeRO shard
    over each group of dp_shard ranks and all-reduce the shards between the groups.

    zero: 0 (DDP), 1 (shard optimizer state), 2 (+ gradients), 3 (+ parameters).
    bucket_mb: gradient bucket size of DDP and ZeRO-1/2, in MB of the reduce dtype.
    grad_reduction: `GradReduction.MEAN` (or "mean") or `GradReduction.SUM` (or "sum").
    units: ZeRO-3 wrapping units: None (the blocks of ModuleLists/ModuleDicts/Sequentials, and
        each other module with parameters of its own: embedding, final norm, head), "blocks" (the
        blocks only; the rest gathered for the whole forward), module classes, or a predicate
        (qualified name, module) -> bool.
    prefetch: ZeRO-3 gathers the next unit while the current one computes (one more unit held).
        None: where communication overlaps compute (`paratrain.comm.Comm.overlaps_compute`: on CUDA,
        not on the CPU).
    offload: None, "optimizer": this rank's fp32 masters and optimizer state in host memory, stepped there
        (`paratrain.parallel.data.offload`), or "params" (ZeRO-3): the parameter shards too, copied to the
        device for each gather.
    """

    zero: int = 0
    bucket_mb: float = 25.0
    grad_reduction: GradReduction = GradReduction.MEAN
    units: UnitSpec = None
    prefetch: bool | None = None
    offload: str | None = None

    def __post_init__(self):
        if self.zero not in ZERO_STAGES:
            raise ParallelConfigError(f"--zero must be {rules.spelled(ZERO_STAGES)}, got {self.zero}")
        if not self.bucket_mb > 0:
            raise ParallelConfigError(f"--bucket-mb must be positive, got {self.bucket_mb}")
        object.__setattr__(self, "grad_reduction", _enum(GradReduction, self.grad_reduction, "grad_reduction"))
        object.__setattr__(self, "offload", self.offload or None)
        check_offload(self.offload)


@dataclass(frozen=True)
class TensorParallel:
    """Tensor parallelism over the mesh's tp axis.

    plan: module-name pattern → style (`paratrain.parallel.tensor.plan`), applied in place; None takes
        the model's own (`model.tensor_parallel_plan(sequence_parallel)`: the reference model's is
        `LLAMA_TP_PLAN`, or `LLAMA_SP_PLAN` with sequence parallelism).
        The logits are then split along the vocabulary: use `model.loss_fn`.
    sequence_parallel: split norms and residuals along the sequence (needs tp > 1).
    """

    plan: Mapping | None = None
    sequence_parallel: bool = False


@dataclass(frozen=True)
class PipelineParallel:
    """Pipeline parallelism over the mesh's pp axis (paratrain's Transformer or any nn.Sequential).

    schedule: `ScheduleName` (or its value: "gpipe", "1f1b", "interleaved", "zb-h1").
    virtual_stages: model chunks per rank (more than one with "interleaved").
    boundaries: the first layer of each stage after the first (None: balanced by parameter count).
    """

    schedule: ScheduleName = DEFAULT_SCHEDULE
    virtual_stages: int = 1
    boundaries: tuple[int, ...] | None = None

    def __post_init__(self):
        object.__setattr__(self, "schedule", ScheduleName.parse(self.schedule))
        if self.boundaries is not None:
            object.__setattr__(self, "boundaries", tuple(self.boundaries))


@dataclass(frozen=True)
class ContextParallel:
    """Context parallelism over the mesh's cp axis (`paratrain.parallel.context`): each rank holds 2 of
    the 2·cp load-balanced chunks of every sequence; causal SDPA attention runs as a ring over the cp ranks.

    The model is called with whole sequences (token ids [batch, seq], the same on every cp rank) and
    returns this rank's chunks' outputs; labels given whole are split the same way by `loss_fn` and
    `train_step`. Its attention must call `F.scaled_dot_product_attention(..., is_causal=True)`.
    positions: the keyword the model's forward takes token positions by (None: `positions`, as
        paratrain's Transformer, or `position_ids`, as Hugging Face models, whichever it has).
    """

    positions: str | None = None


@dataclass
class ModelSpec:
    """A user's model and what paratrain needs to parallelize and train it, e.g. from `verify --model-factory`.

    module: the model: token ids [batch, seq] in, logits [batch, seq, vocab] out (or an object with
        `.logits`, as Hugging Face models return); an `nn.Sequential` for pipeline parallelism.
    plan: its tensor-parallel plan (`paratrain.parallel.tensor.plan`), needed for tp > 1.
    loss_fn: (output, labels) -> the sum of the per-token losses; None: cross-entropy ignoring -100.
    """

    module: nn.Module
    plan: Mapping | None = None
    loss_fn: Callable | None = None


def _enum(cls, value, name: str):
    try:
        return cls(value)
    except ValueError:
        raise ParallelConfigError(f"{name}={value!r} is not one of {', '.join(m.value for m in cls)}") from None


def parallelize(model: nn.Module, mesh: Mesh, optimizer: Callable[[Iterable[torch.Tensor]], torch.optim.Optimizer] | None = None,
                *, data: DataParallel = DataParallel(), tensor: TensorParallel | None = None,
                pipeline: PipelineParallel | None = None, context: ContextParallel | None = None,
                precision: str | Precision = "fp32", reduce_dtype: str | None = None,
                activation_checkpointing: int | str = 0, compile: bool | str = False, init: Callable | None = None,
                fp8: str | None = None, fp8_min_features: int | None = None, loss_chunk: int | None = None,
                lora: LoRA | None = None):
    """Wrap `model` for the mesh; return (model, optimizer) (optimizer None if no factory was given).

    optimizer: a factory called with the master tensors (e.g. partial(AdamW, lr=3e-4)); ZeRO
        needs an element-wise optimizer, or Muon: `partial(torch.optim.Muon, ...)` over a model whose
        parameters are all matrices, or a `paratrain.MuonRecipe` (Muon for the blocks' matrices, AdamW for the
        rest), each matrix orthogonalized whole on one rank (`paratrain.parallel.muon`).
    data / tensor / pipeline / context: each strategy's options (see the dataclasses); tensor, pipeline
        and context apply when the mesh has tp > 1, pp > 1 or cp > 1 (tensor and pipeline also when given).
    precision: "fp32", "bf16" or "fp16" compute (or a `Precision`), fp32 master weights;
        reduce_dtype: gradient communication dtype (default fp32). In bf16 and fp16 the model's
        floating-point inputs are cast to the compute dtype where its forward begins (each
        pipeline stage's, under pipeline parallelism), as FSDP2's `cast_forward_inputs`; integer
        inputs (token ids) are left alone.
    activation_checkpointing: 0 or "none" off; "full" (or 1) every block, k > 1 every k-th block, recomputed
        whole; "selective" every block keeps its matmuls' and attention's outputs and recomputes the rest
        (`paratrain.parallel.recompute`).
    compile: torch.compile each block's forward, paratrain's hooks and collectives outside the compiled
        regions (`paratrain.parallel.compile`): True with inductor, a string with that torch.compile backend
        (e.g. "aot_eager": the same graphs, run by eager kernels, no code generated).
    init: the initializer `init(name, full_shape)` of a model built on the meta device (each rank
        then materializes only its slices); by default the model's own `param_init`.
    fp8: None, or "tensorwise" / "rowwise": the linears of the model's blocks compute their matmuls in FP8
        (`paratrain.parallel.fp8`; with precision "bf16"); the converted names are `model.fp8_linears`.
    fp8_min_features: linears with fewer input or output features stay in the compute dtype (None: 1024 on
        CUDA, `fp8.CUDA_MIN_FEATURES`; 0 elsewhere).
    loss_chunk: the model's loss taken inside its output head, this many tokens at a time (`paratrain.parallel.loss`);
        0: whole logits; None: `DEFAULT_LOSS_CHUNK` where the head can be fused (a number where not is refused).
    lora: a `paratrain.parallel.lora.LoRA`: the model frozen and low-rank adapters added to its target linears
        (the base stored in the compute dtype, bf16 or NF4) before any strategy applies; only the adapters train
        (their names: `model.lora_targets`). Refused in one line with a strategy that does not honour it yet
        (`paratrain.parallel.rules.unsupported_with_lora`).

    The module is moved to the mesh's device (`mesh.device`: this process's GPU under CUDA), a meta
    module materialized there; under ZeRO-3 each rank's shards are allocated there directly.
    """
    return parallelize_run(model, mesh, optimizer, data=data, tensor=tensor, pipeline=pipeline, context=context,
                           precision=precision, reduce_dtype=reduce_dtype,
                           activation_checkpointing=activation_checkpointing, compile=compile, init=init, fp8=fp8,
                           fp8_min_features=fp8_min_features, loss_chunk=loss_chunk, lora=lora)


def parallelize_run(model: nn.Module, mesh: Mesh, optimizer=None, *, data: DataParallel = DataParallel(),
                    tensor: TensorParallel | None = None, pipeline: PipelineParallel | None = None,
                    context: ContextParallel | None = None, precision: str | Precision = "fp32",
                    reduce_dtype: str | None = None, activation_checkpointing: int | str = 0,
                    compile: bool | str = False, init: Callable | None = None, fp8: str | None = None,
                    fp8_min_features: int | None = None, loss_chunk: int | None = None, lora: LoRA | None = None,
                    comm: Comm | None = None, checked: CheckedLayout | None = None):
    """`parallelize` for a caller that owns more of the run than the model (the trainer, a test reading counters):
    the user's choices as `parallelize` takes them, and

    comm: the communication layer (`paratrain.comm.Comm` over `mesh`) the model runs its collectives
        through, for a caller that reads its counters or listens to it (the trainer's metrics, step
        timer and guard); None: the model makes its own, which it does not hand out. Every strategy
        is handed this one object and reads its process groups from `comm.mesh`.
    checked: the caller's verdict on this layout (`paratrain.parallel.rules.check_layout`, as the
        trainer's preflight gives it, knowing the model and the batch too), so that no rule is
        decided twice; it must describe this mesh and these options. None: the rules that the
        mesh and the options decide are checked here.
    """
    policy = precision if isinstance(precision, Precision) else precision_policy(precision, reduce_dtype)
    checkpointing = Checkpointing.parse(activation_checkpointing)
    tensor, pipeline = tensor or TensorParallel(), pipeline or PipelineParallel()
    _check_layout(mesh, data, tensor, pipeline, checked, activation_checkpointing, policy.name, fp8, compile)
    comm = comm or Comm(mesh)
    if comm.mesh is not mesh:  # each strategy below is handed the comm alone and reads its groups from comm.mesh
        raise ParallelConfigError("comm= talks over another mesh than the one given; build it as Comm(mesh)")
    init = Initializer(init)  # each parameter's value, read through what the steps below change

    # -- the model as the user built it ------------------------------------------------------------------------
    # 1. LoRA converts it before any strategy: each sees the frozen base and the adapters.
    lora_targets = _apply_lora(model, lora, comm, policy, init, fp8)
    # 2. Context parallelism reads its forward's signature (how it takes positions), which no step below changes;
    #    it never touches the parameters. The head the loss fuses into is named on the whole model too (the
    #    pipeline's split keeps names: the last stage holds it).
    sharding = _apply_context_parallel(model, comm, context)
    head, loss_chunk = loss_head_name(model, loss_chunk)

    # -- this rank's share of it -----------------------------------------------------------------------------------
    # 3. Pipeline split first: a rank keeps only its stages' layers (still on meta when built there), and
    #    everything after works on that smaller module under the same names.
    split = _apply_pipeline_split(model, mesh, pipeline)
    model = split.module if split is not None else model
    init.default_to(model, _default_init)
    if split is not None and split.shared:  # a copy of a tied table on the last stage starts as the table
        init.through(lambda inner, name, shape: inner(split.shared.get(name, name), shape))
    # 4. Expert parallelism before tensor parallelism: tp materializes a meta model, and by then each MoE layer
    #    must hold only this rank's block of experts.
    expert_info = _apply_expert_parallel(model, comm, init)
    # 5. Tensor parallelism next: it swaps modules for twins holding this rank's slices, and everything after
    #    (FP8, recomputation, compilation, gradient buckets, ZeRO shards) must see those slices.
    tp_info = _apply_tensor_parallel(model, comm, tensor, data, split, init)
    # 6. FP8 swaps the class of the blocks' linears as tp left them (their parameters stay what they are).
    fp8_linears, fp8_casts = _apply_fp8(model, comm, fp8, data, fp8_min_features)
    # 7. Materialize what is still on meta (ZeRO-3 allocates its shards itself, in the engine).
    _apply_materialization(model, init, mesh.device, data)

    # -- how each block runs -----------------------------------------------------------------------------------------
    # 8. Recomputation and compilation of each block: both wrap the forward of the blocks as tensor parallelism
    #    left them, below the module hooks the engine registers after (ZeRO-3 gathers in them, outside the
    #    compiled regions; a recompute finds whole parameters through the engine's saved-tensor hooks).
    _apply_recompute_and_compile(model, comm, checkpointing, compile)
    # 9. The loss fused into the head as tp left it, before the engine hooks onto it (ZeRO-3 gathers around it).
    loss_head = fuse_head(model, head, loss_chunk)

    # -- how the ranks train it together ---------------------------------------------------------------------------
    # 10. The data-parallel engine: it sees the final parameters it has to reduce.
    engine = _apply_data_parallel(model, comm, policy, data, init, expert_info, gathers_fp8=fp8 == "tensorwise")
    # 11. The pipeline runner: a stage's shell shares the modules the steps above may have replaced.
    runner = _apply_pipeline_runner(split, comm, policy, pipeline, tp_info, sharding)
    # 12. Offload: the masters the engine owns stepped in host memory.
    offload = _apply_offload(engine, mesh, data, model if runner is None else None)
    # 13. The model, complete, and the optimizer over the masters, built by it with its hooks around the step.
    build_optimizer = functools.partial(_optimizer, optimizer, data, fp8_casts) if optimizer is not None else None
    wrapped = ParallelModel(model, engine, comm, policy, tp_info, runner, context=sharding, expert_info=expert_info,
                            offload=offload, loss_head=loss_head, fp8_linears=fp8_linears, lora_targets=lora_targets,
                            optimizer=build_optimizer)
    return wrapped, wrapped.optimizer


def _apply_lora(model: nn.Module, lora: LoRA | None, comm: Comm, policy: Precision, init: Initializer,
                fp8) -> list[str]:
    """The names of the linears given adapters, their values read through `init` (`LoRAValues`): none without
    `lora`; refused in one line with a strategy that does not honour it yet."""
    if lora is None:
        return []
    from paratrain.parallel.lora import LoRAError, LoRAValues, convert_to_lora

    mesh = comm.mesh
    unsupported = rules.unsupported_with_lora(ep=mesh.size(Axis.EP), fp8=fp8)
    if unsupported:
        raise ParallelConfigError(rules.lora_refusal(unsupported))
    init.default_to(model, _default_init)
    try:
        names = convert_to_lora(model, lora, policy.param_dtype, mesh.device)
    except LoRAError as e:
        raise ParallelConfigError(str(e)) from None
    init.through(LoRAValues(lora.seed, model, mesh.device))
    return names


def _apply_fp8(model: nn.Module, comm: Comm, recipe: str | None, data: DataParallel, minimum: int | None):
    """(the names of the linears converted to FP8, where their weight casts are kept for a step): none without a
    recipe; casts kept under ZeRO-0..2, whose weights stay whole between optimizer steps."""
    if recipe is None:
        return [], None
    from paratrain.parallel.fp8 import CUDA_MIN_FEATURES, Fp8Casts, check_fp8, convert_to_fp8

    check_fp8(recipe, comm.mesh.device)
    casts = Fp8Casts() if data.zero < 3 else None
    # a sequence's tokens are split over cp: one scale for the whole micro-batch, as one process casts it
    agree = functools.partial(_max_over, comm, Axis.CP) if comm.mesh.size(Axis.CP) > 1 else None
    if minimum is None:
        minimum = CUDA_MIN_FEATURES if comm.mesh.device.type == "cuda" else 0
    return convert_to_fp8(model, recipe, minimum, casts, agree), casts


def _max_over(comm: Comm, axis: Axis, amax: torch.Tensor) -> torch.Tensor:
    comm.all_reduce(amax, axis, op=torch.distributed.ReduceOp.MAX)
    return amax


def _apply_pipeline_split(model: nn.Module, mesh: Mesh, pipeline: PipelineParallel):
    """This rank's pipeline stages of `model` (a `PipelineSplit`), or None without pipeline parallelism."""
    if mesh.size(Axis.PP) == 1:
        return None
    from paratrain.parallel.pipeline.stages import split_for_pipeline

    return split_for_pipeline(model, mesh.size(Axis.PP), mesh.coord(Axis.PP), pipeline.virtual_stages,
                              list(pipeline.boundaries) if pipeline.boundaries is not None else None)


def _apply_expert_parallel(model: nn.Module, comm: Comm, init: Initializer):
    """Expert parallelism over the mesh's ep axis: what it did (None without), `init` read through the local blocks."""
    mesh = comm.mesh
    if mesh.size(Axis.EP) == 1:
        return None
    from paratrain.parallel.expert.sharding import apply_expert_parallel

    info = apply_expert_parallel(model, comm)
    if not info.names:
        raise ParallelConfigError(f"the mesh has ep={mesh.size(Axis.EP)} but {type(model).__name__} has no MoE layer; "
                                  "use ep=1 for a dense model")
    init.through(info.local_init)
    return info


def _apply_tensor_parallel(model: nn.Module, comm: Comm, tensor: TensorParallel, data: DataParallel, split,
                           init: Initializer):
    """Tensor parallelism applied in place: what the plan did (None without), `init` read through the local
    slices where the model stays on meta (ZeRO-3 shards it next)."""
    if comm.mesh.size(Axis.TP) == 1 and tensor.plan is None:
        return None
    tp_info = _apply_plan(model, comm, tensor.plan, tensor.sequence_parallel, init,
                          materialize=data.zero < 3, whole_model=split is None)
    if split is not None and tensor.sequence_parallel:
        from paratrain.parallel.pipeline.stages import sequence_parallel_boundaries

        tp_info.handles += sequence_parallel_boundaries(split, comm, tp_info.axis)
    return tp_info


def _apply_materialization(model: nn.Module, init: Initializer, device: torch.device, data: DataParallel) -> None:
    if data.zero < 3:
        _materialize(model, init, device)
    else:  # the parameters become shards on the device one by one; the buffers move as they are
        _move_buffers(model, device)


def _apply_recompute_and_compile(model: nn.Module, comm: Comm, checkpointing: Checkpointing,
                                 compile: bool | str) -> None:
    if compile:  # (not under context parallelism: a layout rule, `rules.compile_violations`)
        from paratrain.parallel.compile import compile_blocks

        compile_blocks(model, comm, checkpointing, backend="inductor" if compile is True else compile)
    elif checkpointing.enabled:
        checkpoint_blocks(model, checkpointing)


def _apply_data_parallel(model: nn.Module, comm: Comm, policy: Precision, data: DataParallel, init: Initializer,
                         expert_info=None, gathers_fp8: bool = False):
    """The data-parallel engine of `data.zero`'s stage over the model's final parameters; under expert parallelism
    one over the dense parameters (the data axis) and one over the experts (the ranks holding the same block), or
    under ZeRO-3 one engine sharding each kind over its own axis (`gathers_fp8`: the converted linears' weights
    gathered as their FP8 casts, `paratrain.parallel.fp8.Fp8Gather`)."""
    if data.zero == 3:  # one engine: each expert block sharded over the ranks holding it, the rest over the data axis
        from paratrain.parallel.data.zero3 import FullyShardedEngine
        from paratrain.parallel.expert.sharding import REPLICATE_AXIS
        from paratrain.parallel.fp8 import Fp8Gather

        prefetch = comm.overlaps_compute() if data.prefetch is None else data.prefetch
        from paratrain.parallel.data.offload import HostShards

        return FullyShardedEngine(model, comm, policy, units=data.units, init=init if init.given else None,
                                  grad_reduction=data.grad_reduction,
                                  prefetch=prefetch,
                                  axes=dict.fromkeys(expert_info.names, REPLICATE_AXIS) if expert_info else None,
                                  shard_store=HostShards(comm.mesh.device) if data.offload == "params" else None,
                                  codecs=[Fp8Gather()] if gathers_fp8 else [])
    if expert_info is not None:
        from paratrain.parallel.data.groups import GroupedEngine
        from paratrain.parallel.expert.sharding import REPLICATE_AXIS

        named = [(n, p) for n, p in model.named_parameters()]
        groups = [[(n, p) for n, p in named if (n in expert_info.names) == expert] for expert in (False, True)]
        return GroupedEngine([DataParallelEngine(model, comm, policy, zero=data.zero, bucket_mb=data.bucket_mb,
                                                 grad_reduction=data.grad_reduction, params=params,
                                                 axis=REPLICATE_AXIS if expert else None)
                              for expert, params in zip((False, True), groups)], [False, True])
    return DataParallelEngine(model, comm, policy, zero=data.zero, bucket_mb=data.bucket_mb,
                              grad_reduction=data.grad_reduction)


def _apply_offload(engine, mesh: Mesh, data: DataParallel, module: nn.Module | None):
    """The host masters of `data.offload`, or None (`paratrain.parallel.data.offload`); stepped by groups of
    `module`'s units, each waited for by its unit's forward (None: a pipeline stage's runner, which waits for all)."""
    if data.offload is None:
        return None
    from paratrain.parallel.data.offload import HostMasters

    if mesh.device.type == "cpu" and mesh.rank == 0:
        warnings.warn("offload on the CPU: the masters and optimizer state move to separate host buffers, which "
                      "saves no memory here (on a GPU they leave the device)", stacklevel=3)
    return HostMasters(engine, mesh.device, copies=data.offload == "optimizer", module=module)


def _apply_pipeline_runner(split, comm: Comm, policy: Precision, pipeline: PipelineParallel, tp_info, sharding):
    """The pipeline runner of this rank's stages (each stage's forward on this rank's chunks of the sequences
    under context parallelism: `sharding`), or None without pipeline parallelism."""
    if split is None:
        return None
    from paratrain.parallel.pipeline.runner import PipelineRunner

    runner = PipelineRunner(split, pipeline.schedule, comm, policy, tp_axis=tp_info.axis if tp_info else None,
                            context=sharding)
    runner.schedule(comm.mesh.size(Axis.PP))  # a schedule that cannot run fails now, not at step 1
    return runner


def _optimizer(factory, data: DataParallel, fp8_casts, wrapped: ParallelModel) -> torch.optim.Optimizer:
    """The caller's optimizer over the engine's masters, with the model's hooks around its step (`ParallelModel`
    builds it, once constructed)."""
    from paratrain.parallel.muon import Muon, build_optimizer

    # A whole-matrix optimizer (Muon) gets its matrices here, from the model's layout; the engines never see it.
    opt = build_optimizer(factory, wrapped, wrapped.comm)
    if data.zero > 0 and not isinstance(opt, ELEMENTWISE_OPTIMIZERS + (Muon,)):
        raise ParallelConfigError(
            f"ZeRO shards optimizer state element by element, which {type(opt).__name__} does not allow; "
            f"use zero=0 or one of {[c.__name__ for c in ELEMENTWISE_OPTIMIZERS]}")
    opt.register_step_pre_hook(wrapped._before_optimizer_step)
    opt.register_step_post_hook(wrapped._after_optimizer_step)
    if wrapped.offload is not None:  # the host step may be under way: its state is read when it is done
        opt.register_state_dict_pre_hook(lambda _: wrapped.offload.settle())
        opt.register_load_state_dict_pre_hook(lambda *_: wrapped.offload.settle())
    if fp8_casts is not None:  # the weights changed: the next micro-batch casts them again
        opt.register_step_post_hook(fp8_casts.new_step)
    return opt

def _layout_spec(mesh: Mesh, data: DataParallel, tensor: TensorParallel, pipeline: PipelineParallel,
                 activation_checkpointing: int | str = 0, precision: str | None = None,
                 fp8: str | None = None, compile: bool | str = False) -> LayoutSpec:
    """The mesh and the options as the layout rules read them (`paratrain.parallel.rules`)."""
    s = mesh.shape
    return LayoutSpec(dp=s.dp, tp=s.tp, pp=s.pp, cp=s.cp, dp_shard=s.dp_shard, ep=s.ep, zero=data.zero,
                      sequence_parallel=tensor.sequence_parallel, schedule=pipeline.schedule,
                      virtual_stages=pipeline.virtual_stages, activation_checkpointing=activation_checkpointing,
                      precision=precision, fp8=fp8, offload=data.offload, compile=compile)


def _check_layout(mesh: Mesh, data: DataParallel, tensor: TensorParallel, pipeline: PipelineParallel,
                  checked: CheckedLayout | None, activation_checkpointing: int | str = 0, precision: str | None = None,
                  fp8: str | None = None, compile: bool | str = False) -> None:
    """The layout rules on the mesh and the options, unless the caller decided them (then on the same layout)."""
    layout = _layout_spec(mesh, data, tensor, pipeline, activation_checkpointing, precision, fp8, compile)
    if checked is None:
        rules.check_layout(layout, ParallelConfigError)
    elif not checked.describes(layout):
        raise ParallelConfigError("checked= is the verdict on another layout than this mesh and these options; "
                                  "pass the one paratrain.parallel.rules.check_layout gave for this layout")


def _apply_context_parallel(model: nn.Module, comm: Comm, context: ContextParallel | None):
    """Context parallelism's forward wrapper, or None when the mesh has one cp rank.

    Read from the model as the user built it, before any step above wraps it: only the forward's
    signature (how it takes positions) matters, and no step changes it. It acts on the forward
    alone (inputs split, SDPA answered by the ring), never on the parameters, so the engine reduces
    the gradients over dp × cp (`Mesh.data_axis`) without knowing of it.
    """
    if comm.mesh.size(Axis.CP) == 1:
        return None
    from paratrain.parallel.context.sdpa import ContextSharding

    return ContextSharding(model, comm, (context or ContextParallel()).positions)


def _default_init(model: nn.Module):
    """The initializer of a model built on the meta device without one: its own `param_init`, seed 0."""
    if not hasattr(model, "param_init"):
        raise ParallelConfigError(f"{type(model).__name__} is on the meta device: pass "
                                  "init=(name, full_shape) -> full fp32 tensor")
    return functools.partial(model.param_init, seed=0)


def _move_buffers(model: nn.Module, device: torch.device) -> None:
    for module in model.modules():
        for name, buffer in module._buffers.items():
            if buffer is not None and not buffer.is_meta:
                module._buffers[name] = buffer.to(device)


@torch.no_grad()
def _materialize(model: nn.Module, init, device: torch.device) -> None:
    """Put the model on `device`: a materialized one is moved there (parameters and buffers); a meta one
    gets storage there, each parameter filled with `init(name, shape)` (the values copied from the host)."""
    if not any(p.is_meta for p in model.parameters()):
        model.to(device)
        return
    to_empty(model, device)
    for name, param in model.named_parameters():
        param.copy_(init(name, param.shape))


def _apply_plan(model: nn.Module, comm: Comm, plan, sequence_parallel: bool, init: Initializer, materialize: bool,
                whole_model: bool) -> TensorParallelInfo:
    """Apply the plan; return its info, `init` read through the tp-local slices where ZeRO-3 follows.

    A meta model is materialized here, slice by slice, unless ZeRO-3 follows: then the modules
    stay on meta and ZeRO-3 gets an initializer of tp-local shapes (the slice of the full init),
    so no rank ever holds more than its tp × dp share of a layer.
    """
    if plan is None:
        if not isinstance(model, PlannedModel):
            raise ParallelConfigError(f"tensor parallelism needs a plan for {type(model).__name__}: pass "
                                      "tensor=TensorParallel(plan={module pattern: style}) (see "
                                      "paratrain.parallel.tensor.plan)")
        plan = model.tensor_parallel_plan(sequence_parallel)
    on_meta = any(p.is_meta for p in model.parameters())
    info = apply_tensor_parallel(model, plan, comm, sequence_parallel=sequence_parallel,
                                 init=init if on_meta and materialize else None, device=comm.mesh.device,
                                 sp_grad_hooks=False,  # ParallelModel reduces those grads itself
                                 strict=whole_model)  # a pipeline stage lacks the other stages' modules
    if on_meta and not materialize:
        init.through(info.local_init)
    return info
