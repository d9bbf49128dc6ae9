"""`paratrain plan`: estimate one layout, or search the layouts of a GPU count.

    paratrain plan --model llama2-7b --dp 8 --zero 1 --seq-len 4096 --global-batch 64
    paratrain plan --params 7.5B --dp 64 --zero 3            # model states only (ZeRO Table 1)
    paratrain plan --model llama2-70b --gpus 64 --gpu-memory 80GB --gpus-per-node 8 \\
                   --seq-len 4096 --global-batch 1024        # search
    paratrain plan --model llama2-70b --gpus 64 --tokens 2T --gpu-hour-price 2.5   # days, GPU-hours, cost
    paratrain plan --model llama2-7b --dp 32 --dp-shard 8 --zero 3 --seq-len 4096 --global-batch 256 \
                   --inter-node-gbps 25                      # hybrid sharding: ZeRO-3 within each node
    paratrain plan --calibrate                               # measure this machine: a hardware profile
    paratrain plan --model tiny --dp 2 --hardware ~/.cache/paratrain/hardware.json
    paratrain plan --published                               # the presets against published runs

The options and what they make are `paratrain.commands.plan_options`: the model, batch and
layout options are `paratrain train`'s, the planner's older spellings (`--seq`, `--layers`, ...) kept.

Bad input raises `PlanError` (a ValueError) with one line; `paratrain.cli` prints it and
exits with 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import json

from paratrain.commands.options import given_options
from paratrain.commands.plan_options import (
    BATCH_OPTIONS, LAYOUT_OPTIONS, LORA_OPTIONS, MODEL_OPTIONS, add_shared_options, hardware_from_args, layout_from_args,
    space_from_args, workload_from_args,
)
from paratrain.parallel import rules
from paratrain.plan.budget import budget, format_budget
from paratrain.plan.goodput import (
    DEFAULT_DISK_GBPS, DEFAULT_GPU_FAILURES_PER_YEAR, DEFAULT_RESTART_S, checkpoint_bytes, failures_per_day,
    format_goodput, goodput,
)
from paratrain.plan.hardware import DEFAULT_PROFILE, HARDWARE_PRESETS, Hardware, save_profile
from paratrain.plan.memory import GB, LayoutError, MemoryBreakdown, PlanError, Recompute, Workload
from paratrain.plan.moe import DEFAULT_IMBALANCE, is_moe
from paratrain.plan.search import Estimate, SearchResult, estimate, layout_spec, layout_violations, search
from paratrain.plan.sizes import parse_count


ATTENTION_RUNTIMES = ("flash", "materialized")


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Add the `plan` subcommand to the main CLI's subparsers; returns its parser."""
    parser = subparsers.add_parser("plan", help="estimate memory, FLOPs and step time; search layouts",
                                   description=(
        "Estimate per-rank memory (ZeRO model states, Korthikanti activations), FLOPs, communication "
        "and step time of a training layout, or with --gpus N search every layout of N GPUs and rank "
        "the ones that fit by estimated step time. GB = 10^9 bytes."))
    model = parser.add_argument_group("model (one of --model, --params, or --n-layers/--dim/--n-heads)")
    add_shared_options(model, MODEL_OPTIONS)
    model.add_argument("--params", help="parameter count only, e.g. 7.5B: model states, no activations "
                                        "(dp and ZeRO only)")
    model.add_argument("--moe-imbalance", type=float, default=DEFAULT_IMBALANCE, metavar="C",
                       help="a mixture of experts' assumed load imbalance: tokens the busiest expert rank receives "
                            "over the mean (max/mean), scaling its expert compute, activations and all-to-all bytes "
                            f"(default {DEFAULT_IMBALANCE}; 1: uniform routing)")
    model.add_argument("--attention", choices=ATTENTION_RUNTIMES, default="flash",
                       help="how attention runs: flash (paratrain's kernels and blocks: no s×s scores kept; the "
                            "default) or materialized (the runtime of Korthikanti et al. 2022: scores, softmax and "
                            "1-byte dropout masks kept, a GPT block, Megatron's selective recompute of attention's "
                            "core)")
    add_shared_options(parser.add_argument_group("batch and precision"), BATCH_OPTIONS)
    add_shared_options(parser.add_argument_group("LoRA (a frozen base, low-rank adapters that train)"), LORA_OPTIONS)
    layout = parser.add_argument_group("layout (with --gpus, any of these fixes that choice of the search)")
    layout.add_argument("--gpus", type=int, help="search every layout of this many GPUs")
    add_shared_options(layout, LAYOUT_OPTIONS)
    layout.add_argument("--recompute", choices=[r.value for r in Recompute],
                        help="activation checkpointing as the planner models it: none, selective (the outputs of "
                             "matmuls and attention kept, the rest recomputed) or full (every layer); the same as "
                             "--activation-checkpointing none|selective|full (default none; searched with --gpus)")
    _add_hardware_options(parser)
    return parser


def _add_hardware_options(parser: argparse.ArgumentParser) -> None:
    hw = parser.add_argument_group("hardware")
    hw.add_argument("--hardware", default="h100-80gb", metavar="NAME_OR_FILE",
                    help=f"GPU preset ({', '.join(HARDWARE_PRESETS)}: memory, peak FLOP/s, matmul efficiency curve, "
                         "NVLink and InfiniBand bandwidth), or a profile written by --calibrate (a .json file) "
                         "(default h100-80gb)")
    hw.add_argument("--gpu-memory", help="device memory, e.g. 80GB or 80GiB (default: the hardware's)")
    hw.add_argument("--gpus-per-node", type=int, help="GPUs per node; tp must fit in one (default: the hardware's, "
                                                      "8 for the presets)")
    hw.add_argument("--peak-tflops", type=float, help="peak dense TFLOP/s at --precision (default: the hardware's)")
    hw.add_argument("--efficiency", type=float,
                    help="plateau e_max of the matmul efficiency curve e_max·x/(x + x_half) at --precision "
                         "(default: the hardware's)")
    hw.add_argument("--intra-node-gbps", type=float,
                    help="intra-node (NVLink) bandwidth per GPU, one direction, in GB/s (gigaBYTES)")
    hw.add_argument("--inter-node-gbps", type=float,
                    help="inter-node (InfiniBand) bandwidth per GPU, one direction, in GB/s (gigaBYTES)")

    cal = parser.add_argument_group("calibration (measure this machine instead of estimating)")
    cal.add_argument("--calibrate", action="store_true",
                     help="measure matmuls, attention, element-wise kernels and collectives on this machine's GPUs "
                          "(NCCL between them), or without a GPU on --nproc local gloo ranks of the CPU, and write a "
                          "hardware profile (JSON) for --hardware FILE")
    cal.add_argument("--out", metavar="FILE", help=f"with --calibrate: where to write the profile (default "
                                                   f"{DEFAULT_PROFILE}, which `paratrain report` reads)")
    cal.add_argument("--nproc", type=int, help="with --calibrate: ranks measured at once (default: every GPU, one rank "
                                               "each; without a GPU, 2)")
    cal.add_argument("--quick", action="store_true",
                     help="with --calibrate: a few seconds of measurements, enough to fit every constant but not "
                          "for accuracy (for trying the command out)")

    budget_group = parser.add_argument_group("time and cost of a token budget")
    budget_group.add_argument("--tokens", help="train on this many tokens, e.g. 300B or 2T (suffixes K, M, B, T): "
                                               "prints days, GPU-hours and the formula (default global batch: 4M "
                                               "tokens, Llama 2's)")
    budget_group.add_argument("--gpu-hour-price", type=float, metavar="USD",
                              help="with --tokens: price of one GPU-hour, adds the cost")

    fail = parser.add_argument_group("goodput under failures (with --tokens; paratrain.plan.goodput)")
    fail.add_argument("--goodput", action="store_true",
                      help="with --tokens: price failures with the defaults below: goodput of disk checkpoints "
                           "against in-memory snapshots, their Young/Daly intervals, the days and cost lost")
    fail.add_argument("--failures-per-day", type=float, metavar="F",
                      help="failures of the whole job per day (implies --goodput; default: the GPUs times "
                           "--gpu-failures-per-year / 365)")
    fail.add_argument("--gpu-failures-per-year", type=float, metavar="RATE",
                      help=f"failures per GPU per year (implies --goodput; default {DEFAULT_GPU_FAILURES_PER_YEAR:.3f}, "
                           "Llama 3's 419 interruptions in 54 days on 16,384 GPUs)")
    fail.add_argument("--disk-write-gbps", type=float, metavar="GB/S",
                      help=f"checkpoint write (and read) bandwidth per rank in GB/s, gigaBYTES, with every rank "
                           f"writing at once (implies --goodput; default {DEFAULT_DISK_GBPS:g})")
    fail.add_argument("--restart-s", type=float, metavar="SECONDS",
                      help=f"a restart's time before the state is read back: processes, imports, rendezvous "
                           f"(implies --goodput; default {DEFAULT_RESTART_S:g})")

    out = parser.add_argument_group("output")
    out.add_argument("--top", type=int, default=10, help="layouts to show with --gpus (default 10)")
    out.add_argument("--json", action="store_true", help="print one JSON document instead of tables")
    out.add_argument("--published", action="store_true",
                     help="print the published training runs the presets are checked against, with the planner's "
                          "prediction of each one's per-GPU throughput")


# -- commands -------------------------------------------------------------------------------


def run(args) -> int:
    """Run `paratrain plan` (bad input raises PlanError or ModelConfigError: one line, exit 2)."""
    _check_modes(args)
    if args.calibrate:
        return _run_calibrate(args)
    if args.published:
        return _run_published(args)
    opts = given_options(args)  # the options shared with `paratrain train`, by config key
    workload, name = workload_from_args(args, opts)
    hardware = hardware_from_args(args, workload.precision)
    if args.gpus is not None:
        return _run_search(args, opts, workload, name, hardware)
    return _run_single(args, opts, workload, name, hardware)


def _check_modes(args) -> None:
    """Options that belong to one mode only, and the token budget's values."""
    if not args.calibrate:
        for flag, value in (("--out", args.out), ("--nproc", args.nproc), ("--quick", args.quick)):
            if value not in (None, False):
                raise PlanError(f"{flag} belongs to --calibrate")
    if args.gpu_hour_price is not None and args.tokens is None:
        raise PlanError("--gpu-hour-price needs --tokens (the budget whose cost it prices)")
    if args.gpu_hour_price is not None and not args.gpu_hour_price >= 0:
        raise PlanError(f"--gpu-hour-price must be a non-negative number of dollars, got {args.gpu_hour_price!r}")
    if args.tokens is not None:
        parse_count(args.tokens, "--tokens")
    _check_goodput(args)


GOODPUT_OPTIONS = ("--failures-per-day", "--gpu-failures-per-year", "--disk-write-gbps", "--restart-s")


def _wants_goodput(args) -> bool:
    return args.goodput or any(getattr(args, flag[2:].replace("-", "_")) is not None for flag in GOODPUT_OPTIONS)


def _check_goodput(args) -> None:
    """The failure options' values; they price a token budget's time, so they need --tokens."""
    for flag in GOODPUT_OPTIONS:
        value = getattr(args, flag[2:].replace("-", "_"))
        if value is None:
            continue
        if args.tokens is None:
            raise PlanError(f"{flag} needs --tokens (goodput prices the budget's days and cost)")
        positive = flag != "--restart-s"
        if not (value > 0 if positive else value >= 0) or value == float("inf"):
            what = "a positive" if positive else "a non-negative"
            raise PlanError(f"{flag} must be {what} finite number, got {value!r}")
    if args.goodput and args.tokens is None:
        raise PlanError("--goodput needs --tokens (goodput prices the budget's days and cost)")
    if args.failures_per_day is not None and args.gpu_failures_per_year is not None:
        raise PlanError("give --failures-per-day or --gpu-failures-per-year, not both")


def _run_calibrate(args) -> int:
    from paratrain.distributed import visible_gpus
    from paratrain.plan.calibrate import CalibrationPlan, calibrate, choose_device

    gpus = visible_gpus()
    if choose_device(None, gpus > 0, gpus) == "cuda":  # the GPUs, one rank each; NCCL between them
        plan = CalibrationPlan.gpu(args.nproc or gpus, quick=args.quick)
    else:
        nproc = 2 if args.nproc is None else args.nproc
        plan = CalibrationPlan.quick(nproc) if args.quick else CalibrationPlan(nproc=nproc)
    hardware, _ = calibrate(plan, progress=not args.json)
    path = save_profile(hardware, args.out or DEFAULT_PROFILE)
    if args.json:
        from paratrain.plan.hardware import hardware_to_dict

        print(json.dumps({"mode": "calibrate", "profile": str(path), "hardware": hardware_to_dict(hardware)}, indent=2))
    else:
        print(format_profile(hardware))
        print(f"wrote {path}; use it with `paratrain plan --hardware {path} ...`")
    return 0


def _run_published(args) -> int:
    from paratrain.plan.published import format_published, published_rows

    rows = published_rows()
    print(json.dumps({"mode": "published", "runs": rows}, indent=2) if args.json else format_published(rows))
    return 0


def format_profile(hw: Hardware) -> str:
    """A calibrated profile's main numbers, one line each."""
    lines = [f"hardware profile {hw.name!r}: {hw.source}"]
    for dtype in ("fp32", "bf16", "fp16"):
        curve = hw.gemm(dtype)
        lines.append(f"  matmul {dtype}: {hw.peak(dtype) * curve.peak_efficiency / 1e9:,.1f} GFLOP/s plateau per rank, "
                     f"half of it at x = {curve.half_size:,.0f} (x = 3/(1/m + 1/n + 1/k))")
    lines.append(f"  attention kernel: {hw.attention_efficiency:.2f} of the matmul curve; dispatch "
                 f"{hw.op_overhead_s * 1e6:.1f} µs per operator")
    rates = ", ".join(f"{kind} {points[-1][1] / 1e9:.2f}" for kind, points in hw.elementwise.items())
    lines.append(f"  element-wise kernels, G elements/s at their largest measured size: {rates or 'n/a'}")
    for name, costs in (("collectives", hw.collectives), ("time-sharing cores", hw.collectives_shared)):
        text = ", ".join(f"{kind} α {c.latency_s * 1e3:.2f} ms β {c.bytes_per_s / 1e9:.2f} GB/s"
                         for kind, c in costs.items())
        lines.append(f"  {name}: {text or 'n/a'}")
    lines.append(f"  overlap of communication with compute: {hw.comm_overlap:.2f}; {hw.host_cores} cores")
    return "\n".join(lines)


def _run_single(args, opts: dict, workload: Workload, name: str, hardware: Hardware) -> int:
    layout = layout_from_args(args, opts)
    if workload.global_batch is None:
        workload = dataclasses.replace(workload, global_batch=layout.dp * layout.micro_batch)
    spec = layout_spec(workload, layout, gpus_per_node=hardware.gpus_per_node)
    broken = layout_violations(workload, layout, gpus_per_node=hardware.gpus_per_node)
    errors = [v for v in broken if v.rule != "tp_node"]  # a tp across nodes runs, slowly: an infeasible estimate
    if errors:
        message = rules.explain(spec, errors[0])  # the degrees' rules name the nearest valid layouts
        raise LayoutError(message if message != errors[0].message else f"invalid layout {layout.label()}: {message}")
    est = estimate(workload, layout, hardware, memory_limit=hardware.memory_bytes)
    reason = broken[0].message if broken else est.reason
    plan = _budget(args, est)
    good = _goodput(args, est, hardware)
    if args.json:
        row = {**est.to_dict(hardware), "feasible": reason is None, "reason": reason}
        doc = {"mode": "estimate", **_header_dict(workload, name, hardware, layout.world_size), "layouts": [row]}
        print(json.dumps({**doc, **({"budget": plan.as_dict()} if plan else {}),
                          **({"goodput": good.as_dict()} if good else {})}, indent=2))
        return 0
    print(_header(workload, name, hardware, layout.world_size, args))
    print(f"layout: {layout.label()}, {layout.num_microbatches(workload.global_batch)} micro-batch(es) per step")
    print()
    print(format_memory(est.memory, hardware.memory_bytes))
    if reason and est.reason != reason:
        print(f"  infeasible: {reason}")
    print()
    print(format_time(est, hardware))
    if plan:
        print()
        print(format_budget(plan))
        _print_goodput(good, plan)
    return 0


def _budget(args, est: Estimate | None):
    """The token budget's time and cost with `est`'s layout, when --tokens asks for it."""
    if args.tokens is None:
        return None
    if est is None:
        raise PlanError("--tokens needs a layout that fits: no layout of the search does")
    return budget(est, parse_count(args.tokens, "--tokens"), args.gpu_hour_price)


def _goodput(args, est: Estimate | None, hardware: Hardware):
    """Disk checkpoints against snapshots for `est`'s layout, when a failure option asks for it."""
    if est is None or args.tokens is None or not _wants_goodput(args):
        return None
    failures = args.failures_per_day
    if failures is None:
        rate = DEFAULT_GPU_FAILURES_PER_YEAR if args.gpu_failures_per_year is None else args.gpu_failures_per_year
        failures = failures_per_day(est.layout.world_size, rate)
    nbytes = checkpoint_bytes(est.memory)
    disk = (DEFAULT_DISK_GBPS if args.disk_write_gbps is None else args.disk_write_gbps) * 1e9
    restart = DEFAULT_RESTART_S if args.restart_s is None else args.restart_s
    return goodput(nbytes, est.time.total, failures, disk, hardware.copy_seconds(nbytes), restart)


def _print_goodput(good, plan) -> None:
    if good is not None:
        print(format_goodput(good, plan.days, plan.cost))


def _run_search(args, opts: dict, workload: Workload, name: str, hardware: Hardware) -> int:
    if args.gpus < 1:
        raise PlanError(f"--gpus must be a positive integer, got {args.gpus}")
    if args.top < 1:
        raise PlanError(f"--top must be a positive integer, got {args.top}")
    result = search(workload, args.gpus, hardware, space_from_args(args, opts), top=args.top)
    plan = _budget(args, result.best)
    good = _goodput(args, result.best, hardware)
    if args.json:
        doc = {"mode": "search", **_header_dict(workload, name, hardware, args.gpus),
               "searched": result.searched, "num_feasible": result.num_feasible,
               "num_infeasible": result.num_infeasible,
               "layouts": [e.to_dict(hardware) for e in result.ranked],
               "infeasible": result.failure_summary(), **({"budget": plan.as_dict()} if plan else {}),
               **({"goodput": good.as_dict()} if good else {})}
        print(json.dumps(doc, indent=2))
        return 0
    print(format_search(result, workload, name, hardware, args.gpus, args))
    if plan:
        print()
        print(f"with the best layout ({result.best.layout.label()}):")
        print(format_budget(plan))
        _print_goodput(good, plan)
    return 0


# -- formatting -----------------------------------------------------------------------------


def _header_dict(workload: Workload, name: str, hardware: Hardware, gpus: int) -> dict:
    from paratrain.plan.hardware import hardware_to_dict

    model = dataclasses.asdict(workload.model) if workload.model is not None else None
    active = workload.model.num_active_params() if workload.model is not None else workload.num_params
    return {"workload": {"model": name, "num_params": workload.num_params, "active_params": active,
                         "moe_imbalance": workload.moe_imbalance, "config": model,
                         "seq_len": workload.seq_len, "global_batch": workload.global_batch,
                         "precision": workload.precision, "reduce_dtype": workload.reduce_dtype or workload.precision},
            "hardware": {**hardware_to_dict(hardware), "gpus": gpus}}


def _header(workload: Workload, name: str, hardware: Hardware, gpus: int, args=None) -> str:
    what = f"{name} ({workload.num_params / 1e9:.2f}B parameters)" if workload.model else \
        f"{workload.num_params / 1e9:g}B parameters, model states only"
    if is_moe(workload.model):
        m = workload.model
        what = (f"{name} ({workload.num_params / 1e9:.2f}B parameters, {m.num_active_params() / 1e9:.2f}B active: "
                f"top-{m.top_k} of {m.n_experts} experts; assumed load imbalance {workload.moe_imbalance:g} max/mean)")
    batch = f"global batch {workload.global_batch}"
    if args is not None and "train.global_batch" not in given_options(args) and (args.tokens is not None
                                                                                 or args.gpus is not None):
        batch += f" (assumed: {workload.global_batch * workload.seq_len / 1e6:.1f}M tokens per step, Llama 2's 4M)"
    curve = hardware.gemm(workload.precision)
    intra, inter = hardware.intra_node_bytes_per_s / 1e9, hardware.inter_node_bytes_per_s / 1e9
    stack = "compiled blocks" if args is not None and given_options(args).get("parallel.compile") else "eager"
    fp8 = f" with FP8 {workload.fp8} linears" if workload.fp8 else ""
    fp8_peak = f" ({hardware.peak_fp8 / 1e12:g} in FP8; MFU against the bf16 peak)" if workload.fp8 else ""
    given = given_options(args) if args is not None else {}
    seq = f"seq {workload.seq_len}"
    if args is not None and "data.seq_len" not in given and workload.model is not None:
        seq += " (assumed: the model's pretraining length; --seq-len to change)"
    # --fp8 implies bf16 (FP8 keeps bf16 for what it does not cast): assumed only when nothing implies it
    precision = workload.precision + (" (assumed; --precision to change)" if args is not None and not workload.fp8
                                      and "parallel.precision" not in given else "")
    return (f"{what}, {seq}, {batch}, {precision}{fp8}, {stack}; "
            f"{gpus} × {hardware.name} ({hardware.memory_bytes / GB:g} GB, "
            f"{hardware.peak(workload.precision) / 1e12:g} TFLOP/s{fp8_peak}, matmuls at {curve.peak_efficiency:g}·x/(x + "
            f"{curve.half_size:.0f}) of it, {hardware.gpus_per_node} per node; links {intra:g} GB/s in a node, "
            f"{inter:g} GB/s between nodes)")


def _gb(value: float) -> str:
    return f"{value / GB:,.2f}"


def format_memory(memory: MemoryBreakdown, limit: float | None = None) -> str:
    """The per-rank memory table, in GB."""
    states = " (activations not estimated: no model shape)" if memory.model_states_only else ""
    lines = [f"memory per rank (pipeline stage {memory.stage}){states}       GB",
             f"  params             {_gb(memory.params):>12}",
             f"  grads              {_gb(memory.grads):>12}",
             f"  optimizer_state    {_gb(memory.optimizer_state):>12}   = fp32 master "
             f"{_gb(memory.master_weights)} + Adam moments {_gb(memory.adam_moments)}",
             f"  activations        {_gb(memory.activations):>12}",
             f"  comm_buffers       {_gb(memory.comm_buffers):>12}",
             *([f"  fp8 weight casts   {_gb(memory.fp8_casts):>12}   = 1 byte per FP8 weight, cast once per step"]
               if memory.fp8_casts else []),
             f"  total              {_gb(memory.total):>12}"]
    if limit is not None:
        verdict = "fits in" if memory.total <= limit else "does NOT fit in"
        lines[-1] += f"   {verdict} {limit / GB:g} GB"
    if not memory.gradients_meet_activations:
        lines.append("  (a peak, not the sum: the gradients are born as backward frees the activations)")
    if memory.host:
        lines.append(f"  host (offloaded)   {_gb(memory.host):>12}   = fp32 master, optimizer state (Adam's moments; "
                     f"Muon's momentum and bf16 update) and gradient buffer per rank, in host memory")
    return "\n".join(lines)


def format_time(est: Estimate, hardware: Hardware) -> str:
    """Step time breakdown, FLOPs and communication volume of one estimate."""
    t = est.time
    rows = [("compute", t.compute), ("tp comm (exposed)", t.tp_comm), ("pp comm (exposed)", t.pp_comm)]
    if est.layout.cp > 1:  # the ring attention's K/V traffic that its blocks' compute does not hide
        rows.append(("cp comm (exposed)", t.cp_comm))
    rows.append(("dp comm (exposed)", t.dp_comm))
    if est.layout.ep > 1:  # the experts' gradients on their replica group, and the all-to-alls
        rows += [(f"  {axis}", seconds) for axis, seconds in t.dp_comm_by_axis.items()]
        rows.append(("ep all-to-all", t.ep_comm))
    if est.layout.dp_replicate > 1 and est.layout.ep == 1:  # hybrid sharding: the data axis's two parts
        rows += [(f"  {axis}", seconds) for axis, seconds in t.dp_comm_by_axis.items()]
    rows += [("pipeline bubble", t.bubble), ("optimizer step", t.optimizer)]
    lines = ["step time                      s   share"]
    lines += [f"  {label:<20} {value:>9.3f}  {value / t.total:>5.1%}" for label, value in rows]
    lines.append(f"  {'total':<20} {t.total:>9.3f}   MFU {est.mfu(hardware):.1%}")
    lines.append(f"  (dp comm in all {t.dp_comm_total:.3f} s, the rest hidden behind compute)")
    lines.append(f"FLOPs per step: model {est.flops.model:.3e}, hardware {est.flops.hardware:.3e} "
                 "(hardware adds recomputation)")
    comm = ", ".join(f"{axis} {_gb(value)}" for axis, value in est.comm_bytes.items())
    lines.append(f"communication per rank per step (GB sent): {comm}")
    return "\n".join(lines)


def format_search(result: SearchResult, workload: Workload, name: str, hardware: Hardware, gpus: int,
                  args=None) -> str:
    lines = [_header(workload, name, hardware, gpus, args),
             f"searched {result.searched:,} layouts: {result.num_feasible:,} fit, "
             f"{result.num_infeasible:,} do not", ""]
    if result.ranked:
        lines.append(f"top {len(result.ranked)} by estimated step time:")
        lines.append(f"   #   dp shard  cp  ep  tp  pp zero  mb     m  recompute  sp   {'schedule':<16}{'mem GB':>6}"
                     "  step s    MFU  compute   comm  bubble")
        for i, est in enumerate(result.ranked, 1):
            lines.append(_search_row(i, est, hardware))
        best = result.ranked[0]
        lines += ["", f"best: {best.layout.label()}", format_memory(best.memory, hardware.memory_bytes),
                  "", format_time(best, hardware)]
    else:
        lines.append("no layout fits; see why below")
    if result.failures:
        lines += ["", f"why {result.num_infeasible:,} layouts do not fit:"]
        for entry in result.failure_summary():
            lines.append(f"  {entry['count']:>7,}  {entry['summary']}")
    return "\n".join(lines)


def _search_row(i: int, est: Estimate, hardware: Hardware) -> str:
    lay, t = est.layout, est.time
    sched = "-" if lay.pp == 1 else lay.schedule.value + (f" v={lay.chunks}" if lay.chunks > 1 else "")
    shard = lay.shard_ranks if lay.dp_replicate > 1 else "-"  # a ZeRO shard group smaller than dp: HSDP
    return (f"  {i:>2}  {lay.dp:>3} {shard:>5} {lay.cp:>3} {lay.ep:>3} {lay.tp:>3} {lay.pp:>3} {lay.zero:>4} "
            f"{lay.micro_batch:>3} "
            f"{lay.num_microbatches(est.workload.global_batch):>5}  {lay.recompute.value:<9}  "
            f"{'yes' if lay.sequence_parallel else 'no':<4} {sched:<16}{est.memory.total / GB:>6.1f}"
            f"  {t.total:>6.2f}  {est.mfu(hardware):>5.1%}  {t.compute:>7.2f} {t.exposed_comm:>6.2f} "
            f"{t.bubble:>7.2f}")
