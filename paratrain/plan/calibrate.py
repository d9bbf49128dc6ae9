"""`paratrain plan --calibrate`: measure this machine and write a hardware profile (JSON).

On a machine with GPUs (`choose_device`) each GPU is one rank: matmuls and flash attention in
bf16, element-wise kernels and memory bandwidth at a GPU's sizes, and with two GPUs or more the
collectives over NCCL (`CalibrationPlan.gpu`); every timing waits for the device before reading
the clock (`paratrain.plan.measure`). Two things differ from the CPU: flash attention is fitted to
efficiency *and* a per-pass overhead (`fit_flash_attention`: at small sizes launches are most of a
call), and `op_overhead_s` is the device's time per kernel, from a chain of tiny kernels replayed
as a CUDA graph: at training sizes the host queues kernels ahead of the device, so what an eager
step pays per operator is the device's gap between kernels, not the host's launch time. The host's
own time per operation is measured apart (below) and bounds a pass where it is the longer. Without a
GPU, the CPU, as follows.

Every measurement runs on `nproc` gloo ranks at once (`paratrain.ranks.run_on_ranks`), one
thread per rank, as training runs: what is measured is the throughput one process gets while
its peers work beside it (on a CPU they share caches and memory bandwidth), and of the ranks the
slowest is kept, since a step waits for its slowest rank.

- the three matmuls of a linear layer (forward x·Wᵀ, input gradient dY·W, weight gradient
  dYᵀ·x) for several shapes and dtypes → the efficiency curve of `GemmCurve`, fitted as
  1/throughput = (1/A)·(1 + x_half/x), linear in 1/x (A, the plateau, is stored as the peak);
- the attention kernel (`scaled_dot_product_attention`, causal, forward + backward) →
  `attention_efficiency`, its speed relative to the curve at its matmul shapes;
- the element-wise kernel kinds of an eager stack (a product, a negation, a row sum, SiLU and its
  backward, log-softmax) at sizes of a layer's activations, each cycling through more tensors
  than the caches hold (a training step's activations do not stay in cache) → `elementwise`,
  and an out-of-place add from caches to memory size → `memory_curve`; a chain of tiny products
  run forward and backward → `op_overhead_s`, the host time per operator or autograd node;
- paratrain's reference model, tiny (its kernels shorter than their launches), forward and backward in
  eager bf16 on one rank, timed on the host without waiting for the device: as it is, with full and with
  selective recomputation, and under ZeRO-3 → `host_op_s`, `host_full_op_s`, `host_selective_op_s` and
  `host_unit_s` (`fit_host`, the planner's host rule inverted);
- all-reduce, all-gather, reduce-scatter and send/recv at several sizes, each issued between
  matmuls of about a layer's duration as training issues them (the cost is the time a loop of
  matmul + collective takes beyond the matmuls alone: waits for the slower peer and wake-ups
  count, as they do in a step) → α and β per kind, fitted to steps·α + bytes sent/β with
  relative errors; once more with twice as many ranks as `nproc`, in pairs, time-sharing the
  cores → `collectives_shared`;
- the process's CPU time during collectives against their duration → `comm_overlap`, the
  fraction of a collective during which its rank's core is free for compute;
- torch's fused CPU AdamW on every rank at once, each with its share of the host's cores (the
  offloaded optimizer step, `paratrain.parallel.data.offload`) → `host_bytes_per_s`, the node's
  traffic in that step; on a GPU also pinned copies each way → `pcie_bytes_per_s`.

The host's cores are recorded (`host_cores`): the planner gives each rank cores/ranks of a core
when a layout has more ranks than the host has cores.

On a shared machine each phase first waits for the CPUs to be nearly idle and is measured again
(up to `retries` times) when other processes took more than `max_foreign` of the CPUs while it
ran, or when a matmul probe before and after it ran more than `max_drift` away from the machine's
best probe at the start (`paratrain.plan.machine_load`); the profile's source line and the raw
measurements say how much.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import platform
import time
from dataclasses import dataclass, field

from paratrain.plan.fit import CalibrationError, fit_attention, fit_flash_attention, fit_gemm_curve, fit_host, fit_link
from paratrain.plan.hardware import HARDWARE_PRESETS, Hardware
from paratrain.plan.machine_load import Conditions, CpuWindow, machine_speed, matmul_probe, wait_until_quiet
from paratrain.plan.measure import (
    measure_attention,
    measure_collectives,
    measure_elementwise,
    measure_gemms,
    measure_host,
    measure_host_ops,
    measure_memory,
    measure_overlap,
)

__all__ = ["CalibrationError", "CalibrationPlan", "calibrate", "choose_device"]
DEVICES = ("cpu", "cuda")


def choose_device(requested: str | None, cuda_available: bool, gpus: int) -> str:
    """The device to calibrate: `requested`, or a GPU when this machine has one, else the CPU."""
    if requested is None:
        return "cuda" if cuda_available and gpus > 0 else "cpu"
    if requested not in DEVICES:
        raise CalibrationError(f"calibration device {requested!r} is not one of: {', '.join(DEVICES)}")
    if requested == "cuda" and not (cuda_available and gpus > 0):
        raise CalibrationError("calibration device 'cuda' asked for, but torch sees no GPU; calibrate the CPU instead")
    return requested


@dataclass(frozen=True)
class CalibrationPlan:
    """What `calibrate` measures.

    gemm_shapes: (m, n, k) per dtype; fp16 has few and small ones (CPUs without fp16 matmul
    units run it orders of magnitude slower). attention_shapes: (batch, heads, seq, head_dim).
    memory_sizes: fp32 elements of the element-wise add. collective_sizes: bytes of the full
    tensor (the all-gather's output, the reduce-scatter's input). min_seconds: each timing sample
    repeats its operation for at least this long; repeats: samples per measurement (median).
    device: "cpu", or "cuda": one rank per GPU (nproc GPUs), collectives over NCCL when nproc ≥ 2
    (`CalibrationPlan.gpu`). attention_dtype: the attention kernel's (a flash kernel needs 16 bits).
    """

    nproc: int = 2
    device: str = "cpu"
    attention_dtype: str = "fp32"
    gemm_shapes: dict[str, tuple[tuple[int, int, int], ...]] = field(default_factory=lambda: {
        "fp32": ((128, 128, 128), (256, 256, 256), (512, 512, 512), (512, 64, 256), (1024, 256, 256),
                 (1024, 768, 256), (2048, 256, 688), (1024, 1024, 1024), (4096, 512, 512)),
        "bf16": ((128, 128, 128), (256, 256, 256), (512, 512, 512), (512, 64, 256), (1024, 256, 256),
                 (1024, 768, 256), (2048, 256, 688), (1024, 1024, 1024)),
        "fp16": ((64, 64, 64), (128, 128, 128), (256, 256, 256)),
    })
    attention_shapes: tuple[tuple[int, int, int, int], ...] = ((4, 8, 128, 32), (2, 8, 256, 64), (1, 16, 512, 64))
    memory_sizes: tuple[int, ...] = (2**14, 2**16, 2**18, 2**20, 2**22, 2**24)
    elementwise_sizes: tuple[int, ...] = (2**16, 2**18, 2**20)
    working_set: int = 48 * 2**20
    collective_sizes: tuple[int, ...] = (2**14, 2**18, 2**20, 2**22, 2**24)
    gap: tuple[int, int, int] = (512, 384, 512)
    host_params: int = 2**24
    copy_bytes: int = 2**26
    min_seconds: float = 0.02
    repeats: int = 5
    timeout: float = 900.0
    quiet_cpu: float = 0.15
    quiet_wait: float = 120.0
    max_foreign: float = 0.10
    max_drift: float = 0.10
    retries: int = 3

    def __post_init__(self):
        if self.device not in DEVICES:
            raise CalibrationError(f"calibration device {self.device!r} is not one of: {', '.join(DEVICES)}")
        least = 1 if self.device == "cuda" else 2  # a CPU profile needs peers for its collectives; one GPU has none
        if isinstance(self.nproc, bool) or not isinstance(self.nproc, int) or self.nproc < least:
            raise CalibrationError(f"--nproc must be an integer of at least {least} on {self.device} "
                                   f"(collectives need peers), got {self.nproc!r}")

    @property
    def phases(self) -> tuple[str, ...]:
        """The measurements this plan takes: a GPU's collectives only between GPUs, its cores never time-shared."""
        if self.device == "cpu":
            return tuple(_PHASES)
        return ("gemm", "attention", "memory", "elementwise", "host_ops", "host") + (("collectives",) if self.nproc >= 2
                                                                                  else ())

    @classmethod
    def gpu(cls, gpus: int, quick: bool = False) -> CalibrationPlan:
        """Sizes of a GPU's training kernels: linears of a 1-70B model's layers, flash attention in bf16,
        element-wise kernels of 4-256 MB, collectives up to 256 MB, one rank per GPU."""
        square = ((1024, 1024, 1024), (2048, 2048, 2048), (4096, 4096, 4096), (8192, 8192, 8192))
        layers = ((8192, 2048, 2048), (8192, 5632, 2048), (2048, 4096, 4096), (2048, 11008, 4096),
                  (8192, 4096, 11008), (4096, 28672, 8192))
        if quick:
            # Still a GPU's sizes (the CPU's quick shapes fit a GPU's curve to launch overheads: a 1B step was
            # predicted at 1,670 s on an H200), fewer of them, each timed twice.
            return cls(nproc=gpus, device="cuda", attention_dtype="bf16",
                       gemm_shapes={"bf16": square[1:3] + layers[:2], "fp16": square[2:3], "fp32": square[2:3]},
                       attention_shapes=((1, 16, 2048, 128), (4, 16, 2048, 128)), memory_sizes=(2**22, 2**24, 2**26, 2**28),
                       elementwise_sizes=(2**24, 2**26), working_set=2**30, collective_sizes=(2**22, 2**24, 2**26),
                       gap=(4096, 4096, 4096), host_params=2**24, copy_bytes=2**26, min_seconds=0.005, repeats=2,
                       timeout=300.0, quiet_wait=0.0, retries=0)
        return cls(nproc=gpus, device="cuda", attention_dtype="bf16",
                   gemm_shapes={"bf16": square + layers, "fp16": square, "fp32": square},
                   attention_shapes=((4, 16, 2048, 128), (1, 32, 2048, 128), (1, 32, 4096, 128)),
                   memory_sizes=(2**20, 2**22, 2**24, 2**26, 2**28), elementwise_sizes=(2**22, 2**24, 2**26),
                   working_set=2**30, collective_sizes=(2**20, 2**22, 2**24, 2**26, 2**28), gap=(4096, 4096, 4096),
                   host_params=2**26, copy_bytes=2**28, quiet_wait=0.0, retries=0)

    @classmethod
    def quick(cls, nproc: int = 2) -> CalibrationPlan:
        """A few seconds' worth: enough to fit every constant, too little for accuracy."""
        return cls(nproc=nproc, gemm_shapes={"fp32": ((64, 64, 64), (256, 256, 256), (512, 64, 256)),
                                             "bf16": ((64, 64, 64), (256, 256, 256)), "fp16": ((32, 32, 32),)},
                   attention_shapes=((1, 2, 64, 32),), memory_sizes=(2**12, 2**16, 2**18),
                   elementwise_sizes=(2**12, 2**16), working_set=2**20, collective_sizes=(2**12, 2**16, 2**18),
                   gap=(64, 64, 64), host_params=2**18, min_seconds=0.002, repeats=2, timeout=120.0, quiet_wait=0.0,
                   retries=0)


def _slowest_over_ranks(per_rank: list, pick) -> list:
    """Each row with the largest seconds (its last field) over the ranks: a step waits for its slowest rank."""
    rows = pick(per_rank[0])
    return [(*row[:-1], max(pick(r)[i][-1] for r in per_rank)) for i, row in enumerate(rows)]


def machine_info() -> dict:
    """Where and when: platform, processor, cores, load averages, torch version, date.

    Nothing here touches CUDA: this process forks no rank itself, but a CUDA context made here would sit on
    GPU 0 beside the ranks' for the whole calibration. A GPU's name and memory come from a rank
    (`gpu_info`)."""
    import torch

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {"date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"), "node": platform.node(),
            "platform": platform.platform(), "processor": platform.processor() or platform.machine(),
            "cpu_count": os.cpu_count(), "cores": cores, "loadavg": list(os.getloadavg()), "torch": torch.__version__}


def gpu_info(rank: int, world: int) -> dict:
    """On a rank: the GPU's name and memory, and how many GPUs this host has."""
    import torch

    properties = torch.cuda.get_device_properties(0)
    return {"device_name": properties.name, "device_memory": properties.total_memory,
            "gpus": torch.cuda.device_count()}


def _shares(machine: dict, plan: CalibrationPlan) -> str:
    """Each phase's kept attempt: other processes' CPU share and the speed against the baseline probe."""
    parts = []
    for name, attempts in (machine.get("conditions") or {}).items():
        kept = min(attempts, key=lambda a: Conditions(**a).off(plan.max_foreign, plan.max_drift))
        foreign = "n/a" if kept["foreign"] is None else f"{kept['foreign']:.0%}"
        parts.append(f"{name} {foreign}/{kept['speed']:.2f} ({len(attempts)})")
    return ", ".join(parts) or "n/a"


def _physical_memory() -> float:
    try:
        return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 16e9


def build_profile(measured: dict, plan: CalibrationPlan, machine: dict, name: str | None = None) -> Hardware:
    """The profile from the measurements (`calibrate`'s rank results, medians over ranks)."""
    if plan.device == "cuda":
        return _gpu_profile(measured, plan, machine, name or "cuda")
    name = name or "cpu"
    peaks, curves = {}, {}
    for dtype in ("fp32", "bf16", "fp16"):
        rows = measured["gemm"].get(dtype) or measured["gemm"]["fp32"]
        peaks[dtype], curves[dtype] = fit_gemm_curve(rows)
    memory_curve = tuple((float(b), b / s) for b, s in measured["memory"])
    links = {kind: fit_link(kind, 2, rows) for kind, rows in measured["collectives"].items()}
    shared = {kind: fit_link(kind, 2, rows) for kind, rows in measured["collectives_shared"].items()}
    elementwise = {kind: tuple((float(n), n / s) for n, s in rows)
                   for kind, rows in measured["elementwise"].items() if kind != "op_overhead"}
    wall, cpu = measured["overlap"]
    cores = int(machine["cores"])
    base = Hardware(
        name=name, memory_bytes=_physical_memory(), peak_bf16=peaks["bf16"], peak_fp16=peaks["fp16"],
        peak_fp32=peaks["fp32"], hbm_bytes_per_s=memory_curve[-1][1],
        intra_node_bytes_per_s=links["all_reduce"].bytes_per_s, inter_node_bytes_per_s=links["all_reduce"].bytes_per_s,
        gpus_per_node=cores, intra_node_latency_s=links["all_reduce"].latency_s,
        inter_node_latency_s=links["all_reduce"].latency_s, gemm_bf16=curves["bf16"], gemm_fp16=curves["fp16"],
        gemm_fp32=curves["fp32"], memory_efficiency=1.0, memory_curve=memory_curve, elementwise=elementwise,
        op_overhead_s=measured["elementwise"]["op_overhead"], link_efficiency=1.0, collectives=links,
        collectives_shared=shared, comm_overlap=min(1.0, max(0.0, 1.0 - cpu / wall)),
        host_cores=cores, host_bytes_per_s=_host_rate(measured, plan),
        source=(f"paratrain plan --calibrate on {machine['node']} ({machine['processor']}, {cores} cores, "
                f"torch {machine['torch']}), {plan.nproc} ranks, {machine['date']}, load average "
                f"{machine['loadavg'][0]:.2f}; per phase other processes' CPU share / speed against the best probe "
                f"(attempts): {_shares(machine, plan)}"))
    return dataclasses.replace(base, attention_efficiency=fit_attention(measured["attention"], base),
                               **_host_costs(measured, base))


def _gpu_profile(measured: dict, plan: CalibrationPlan, machine: dict, name: str) -> Hardware:
    """A GPU's profile: its measured curves; links measured over NCCL between its GPUs, else the H100 preset's.

    Collectives run beside the compute on a GPU (`comm_overlap` 1), and no rank time-shares a device.
    """
    peaks, curves = {}, {}
    for dtype in ("fp32", "bf16", "fp16"):
        peaks[dtype], curves[dtype] = fit_gemm_curve(measured["gemm"].get(dtype) or measured["gemm"]["bf16"])
    memory_curve = tuple((float(b), b / s) for b, s in measured["memory"])
    elementwise = {kind: tuple((float(n), n / s) for n, s in rows)
                   for kind, rows in measured["elementwise"].items() if kind != "op_overhead"}
    links = {kind: fit_link(kind, 2, rows) for kind, rows in measured.get("collectives", {}).items()}
    preset = HARDWARE_PRESETS["h100-80gb"]
    link = links.get("all_reduce")
    intra = link.bytes_per_s if link else preset.intra_node_bytes_per_s
    base = Hardware(
        name=name, memory_bytes=float(machine["device_memory"]), peak_bf16=peaks["bf16"], peak_fp16=peaks["fp16"],
        peak_fp32=peaks["fp32"], hbm_bytes_per_s=memory_curve[-1][1], intra_node_bytes_per_s=intra,
        inter_node_bytes_per_s=preset.inter_node_bytes_per_s, gpus_per_node=plan.nproc,
        intra_node_latency_s=link.latency_s if link else preset.intra_node_latency_s,
        gemm_bf16=curves["bf16"], gemm_fp16=curves["fp16"], gemm_fp32=curves["fp32"], memory_efficiency=1.0,
        memory_curve=memory_curve, elementwise=elementwise, op_overhead_s=measured["elementwise"]["op_overhead"],
        link_efficiency=1.0 if link else preset.link_efficiency, collectives=links, comm_overlap=1.0,
        host_bytes_per_s=_host_rate(measured, plan),
        pcie_bytes_per_s=min(measured["host"]["d2h"], measured["host"]["h2d"]) if "host" in measured else 0.0,
        source=(f"paratrain plan --calibrate on {machine['node']} ({machine['device_name']} × {plan.nproc}, "
                f"torch {machine['torch']}), {machine['date']}; "
                + ("collectives over NCCL" if link else "one GPU: links of the h100-80gb preset")))
    efficiency, overhead = fit_flash_attention(measured["attention"], base, plan.attention_dtype)
    return dataclasses.replace(base, attention_efficiency=efficiency, attention_overhead_s=overhead,
                               **_host_costs(measured, base))


def _host_costs(measured: dict, base: Hardware) -> dict[str, float]:
    """The host's costs per eager operation, recomputed operator and ZeRO-3 unit (none: an older plan)."""
    return fit_host(measured["host_ops"], base) if "host_ops" in measured else {}


def _host_rate(measured: dict, plan: CalibrationPlan) -> float:
    """The node's host-step traffic: each rank's (the slowest one's) while all of them stepped at once, times
    the ranks (0 when not measured: an older plan)."""
    return measured["host"]["adamw"] * plan.nproc if "host" in measured else 0.0


# name: (measurement, ranks as a multiple of plan.nproc)
_PHASES = {"gemm": (measure_gemms, 1), "attention": (measure_attention, 1), "memory": (measure_memory, 1),
           "elementwise": (measure_elementwise, 1), "host_ops": (measure_host_ops, 1),
           "collectives": (measure_collectives, 1), "collectives_shared": (measure_collectives, 2),
           "overlap": (measure_overlap, 1), "host": (measure_host, 1)}


def run_phase(rank: int, world: int, name: str, plan: CalibrationPlan):
    """One phase on this rank: (result, the foreign CPU share on rank 0, this rank's slower probe)."""
    import torch
    import torch.distributed as dist

    dist.barrier()
    before = matmul_probe()
    window = CpuWindow().start() if rank == 0 else None
    cpu = time.process_time()
    result = _PHASES[name][0](rank, world, plan)
    own = torch.tensor([time.process_time() - cpu], dtype=torch.float64)
    dist.all_reduce(own)  # every rank's CPU seconds, and the end of the window
    foreign = window.stop(own.item()) if window is not None else None
    return result, foreign, min(before, matmul_probe())


def _measure_phase(name: str, plan: CalibrationPlan, baseline: float) -> tuple[list, list]:
    """(per-rank results of the attempt closest to the baseline conditions, every attempt's Conditions)."""
    from paratrain.ranks import RankError, run_on_ranks

    attempts = []
    ranks = plan.nproc * _PHASES[name][1]
    for _ in range(1 + plan.retries):
        wait_until_quiet(plan.quiet_cpu, plan.quiet_wait)
        try:
            per_rank = run_on_ranks(run_phase, ranks, name, plan, timeout=plan.timeout)
        except RankError as e:
            raise CalibrationError(f"calibration step {name!r} failed: {str(e).splitlines()[0]}") from None
        speed = sum(r[2] for r in per_rank) / baseline
        attempts.append(([r[0] for r in per_rank], Conditions(per_rank[0][1], speed)))
        if attempts[-1][1].off(plan.max_foreign, plan.max_drift) == 0:
            break
    best = min(attempts, key=lambda a: a[1].off(plan.max_foreign, plan.max_drift))
    return best[0], [dataclasses.asdict(a[1]) for a in attempts]


def calibrate(plan: CalibrationPlan = CalibrationPlan(), progress: bool = True) -> tuple[Hardware, dict]:
    """Measure this machine on `plan.nproc` ranks; return (profile, raw measurements with machine info)."""
    from paratrain.ranks import run_on_ranks

    machine = machine_info()
    if plan.device == "cuda":
        machine.update(run_on_ranks(gpu_info, 1, timeout=plan.timeout)[0])
    wait_until_quiet(plan.quiet_cpu, plan.quiet_wait)
    baseline = machine_speed(plan.nproc, plan.timeout)
    machine["probe_flops"] = baseline
    measured: dict = {}
    conditions: dict = {}
    bar = _progress(len(plan.phases), progress)
    for name in plan.phases:
        bar.set_description(f"calibrating: {name}")
        per_rank, conditions[name] = _measure_phase(name, plan, baseline)
        measured[name] = _reduce(name, per_rank)
        bar.update(1)
    bar.close()
    machine["loadavg_end"] = list(os.getloadavg())
    machine["conditions"] = conditions
    return build_profile(measured, plan, machine), {"machine": machine, "measured": measured}


def _reduce(name: str, per_rank: list):
    """The slowest rank's seconds per measurement; for the overlap, the rank whose collectives took most CPU."""
    if name == "overlap":
        return max(per_rank, key=lambda r: r[1] / r[0])
    if name == "elementwise":
        rows = {kind: _slowest_over_ranks(per_rank, lambda r, k=kind: r[k])
                for kind in per_rank[0] if kind != "op_overhead"}
        return {**rows, "op_overhead": max(r["op_overhead"] for r in per_rank)}
    if name == "host":  # rates: the slowest rank's, each of them
        return {key: min(r[key] for r in per_rank) for key in per_rank[0]}
    if name == "host_ops":  # each pass of each variant: the slowest rank's seconds
        return {key: value if key == "layers" else tuple(max(r[key][i] for r in per_rank) for i in range(2))
                for key, value in per_rank[0].items()}
    if name in ("gemm", "collectives", "collectives_shared"):
        return {key: _slowest_over_ranks(per_rank, lambda r, k=key: r[k]) for key in per_rank[0]}
    return _slowest_over_ranks(per_rank, lambda r: r)


def _progress(total: int, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=total, disable=not enabled, unit="phase", leave=False)
