"""What the planner knows about a device and its links: presets with sources, and JSON profiles.

A `Hardware` is a roofline with a size-dependent matmul efficiency:

- a matmul of shape (m, n, k) runs at peak × `GemmCurve.efficiency(m, n, k)`, an efficiency
  that rises with the size of the smallest dimensions and saturates (`GemmCurve`);
- everything else a transformer layer runs (norms, activations, softmax, residual adds,
  rotary embeddings, the optimizer step) is memory-bound: bytes moved / achieved bandwidth;
- a collective of n ranks costs steps × α + bytes sent / β (Hockney), with β the achieved
  fraction of the link's bandwidth, or a per-kind (α, β) measured by `paratrain plan --calibrate`.

Presets describe one GPU kind running a Megatron-class software stack (fused kernels for the
element-wise parts, see `KernelStack`); their numbers are datasheet figures (cited at each
preset) plus the efficiency constants, one set per GPU kind, that `paratrain.plan.published`
checks against published training runs. A calibrated profile (a JSON file written by
`paratrain plan --calibrate`) describes the machine it was measured on. Profiles are JSON, never
pickle: loading one executes nothing.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Mapping

from paratrain.plan.errors import PlanError

PROFILE_FORMAT = 1  # version of the JSON layout of a hardware profile
# Where `paratrain plan --calibrate` writes its profile unless --out says otherwise, and where
# `paratrain report` looks for one.
DEFAULT_PROFILE = Path.home() / ".cache" / "paratrain" / "hardware.json"
COLLECTIVE_KINDS = ("all_reduce", "all_gather", "reduce_scatter", "send")


class Elementwise(str, Enum):
    """The element-wise kernel kinds of an eager stack, each with its own measured throughput."""

    BINARY = "binary"  # a product or sum of two tensors
    UNARY = "unary"  # a copy, negation, square, gather
    REDUCE = "reduce"  # a sum or mean along rows
    SILU = "silu"  # a transcendental function (SiLU, exp)
    SILU_BACKWARD = "silu_backward"
    SOFTMAX = "softmax"  # a row-wise log-softmax


# Elements each kind reads and writes per output element: what a profile without a measured rate
# for the kind falls back to, through the memory bandwidth.
ELEMENTWISE_ACCESSES = {Elementwise.BINARY: 3, Elementwise.UNARY: 2, Elementwise.REDUCE: 1, Elementwise.SILU: 2,
                        Elementwise.SILU_BACKWARD: 3, Elementwise.SOFTMAX: 2}


class KernelStack(str, Enum):
    """How a run's element-wise parts are implemented, which sets the kernels they launch and the bytes they move.

    A property of the run, not of the device (`Layout.compile` picks it):
    FUSED: one kernel per fused region, as `torch.compile` makes of each block (inductor fuses
    the norms, rotary, SwiGLU and residual adds between the matmuls) and as Megatron's fused
    kernels do (fused layer norm, bias + GeLU, scale + mask + softmax, bias + dropout + add):
    each tensor is read and written about once.
    EAGER: one kernel per PyTorch operator, as paratrain's reference model runs in eager mode:
    every operator reads its inputs and writes its output (see `paratrain.plan.ops`).
    """

    FUSED = "fused"
    EAGER = "eager"


@dataclass(frozen=True)
class GemmCurve:
    """Fraction of peak a matmul of shape (m, n, k) achieves: e_max · x / (x + x_half) / (1 + x / x_power).

    x = 3 / (1/m + 1/n + 1/k), the harmonic mean of the three dimensions, is proportional to the
    matmul's arithmetic intensity (2mnk FLOPs over (mn + nk + mk) elements moved). The time
    flops / (peak · efficiency) is then flops / (peak · e_max) plus a term proportional to the
    operand bytes: a roofline whose two regimes are joined smoothly. Small or skinny matmuls
    (tensor-parallel slices, small hidden sizes, attention's head dimension) fall below the
    plateau, large ones approach e_max.

    x_power (`power_size`; None: no fall-off) is where a GPU's power limit takes the
    clock down: the largest matmuls keep every tensor core busy for long enough to hold the board
    at its power cap, and run slower per FLOP than mid-sized ones (an H200 measured 805 TFLOP/s
    for 8192×5632→2048 and 686 for 16384×8192→8192, `hardware.py`'s presets).
    """

    peak_efficiency: float
    half_size: float
    power_size: float | None = None

    def __post_init__(self):
        if not 0 < self.peak_efficiency <= 1:
            raise PlanError(f"GEMM peak_efficiency {self.peak_efficiency!r} must be in (0, 1]")
        if not self.half_size >= 0:
            raise PlanError(f"GEMM half_size {self.half_size!r} must be non-negative")
        if self.power_size is not None and not self.power_size > 0:
            raise PlanError(f"GEMM power_size {self.power_size!r} must be positive")

    def efficiency(self, m: float, n: float, k: float) -> float:
        x = 3.0 / (1.0 / m + 1.0 / n + 1.0 / k)
        droop = 1.0 if self.power_size is None else 1.0 + x / self.power_size
        return self.peak_efficiency * x / (x + self.half_size) / droop


@dataclass(frozen=True)
class LinkCost:
    """A measured collective: α seconds per ring step and β bytes sent per second (one rank)."""

    latency_s: float
    bytes_per_s: float

    def __post_init__(self):
        if not (self.latency_s >= 0 and self.bytes_per_s > 0):
            raise PlanError(f"collective cost needs latency_s >= 0 and bytes_per_s > 0, got {self!r}")


@dataclass(frozen=True)
class Hardware:
    """One accelerator (or one CPU core per rank), the links between them, and achievable fractions.

    Fields:
        name: preset name, or the profile's name.
        memory_bytes: device memory (GB = 10⁹ bytes).
        peak_bf16, peak_fp16, peak_fp32: dense peak FLOP/s (fp32 means TF32 tensor cores on GPUs;
            a calibrated CPU profile stores its fitted plateau here, with e_max = 1).
        peak_fp8: dense FP8 peak FLOP/s (e4m3/e5m2 tensor cores, `torch._scaled_mm`; its matmuls follow
            the bf16 curve); 0: no FP8 matmuls (an A100, a CPU, a profile that did not measure them).
        hbm_bytes_per_s: datasheet memory bandwidth.
        intra_node_bytes_per_s: per-GPU, one-direction link bandwidth inside a node (NVLink).
        inter_node_bytes_per_s: per-GPU, one-direction bandwidth between nodes (InfiniBand).
        gpus_per_node: devices sharing the intra-node links (a CPU profile: its cores).
        intra_node_latency_s, inter_node_latency_s: α of one ring step.
        gemm_bf16, gemm_fp16, gemm_fp32: the matmul efficiency curve per dtype.
        attention_efficiency: throughput of the attention kernel's matmuls relative to the GEMM
            curve at their shapes (QKᵀ and PV per head): 1 when they run like those matmuls.
        attention_overhead_s: time of one attention call (forward and backward) beyond its
            matmuls and the bytes of its operands (`paratrain.plan.ops.attention_seconds`): the
            backward's preprocessing pass and the tail of each kernel's last wave of tiles.
        memory_efficiency: achieved fraction of `hbm_bytes_per_s` for memory-bound kernels.
        memory_curve: measured (bytes touched, bytes/s) points of element-wise kernels, ascending
            by size (a CPU's caches make bandwidth depend on size); empty: the fraction above.
        elementwise: measured (elements, elements/s) points per element-wise kind of an eager stack
            (`ELEMENTWISE_ACCESSES`), ascending by size; a kind without points moves its accesses
            through the memory bandwidth.
        op_overhead_s: time per kernel an eager stack launches beyond its bytes (per operator
            and per autograd node): on a CPU the dispatch, paid in line; on a GPU the gap between
            back-to-back kernels (launch, ramp-up and drain of each), the host running ahead.
        host_op_s: the host's time per operation of an eager step (`paratrain.plan.host`: Python, the
            dispatcher, autograd and the launch of each operator or autograd node), which on a GPU bounds
            a pass that the device would run faster; 0: not measured, the host never bounds a pass.
        host_full_op_s, host_selective_op_s: what full and selective recomputation add to it per forward
            operator, in the forward and in the recompute (checkpoint's hooks; selective's dispatch mode).
        host_unit_s: the host's time of ZeRO-3's hooks per unit and pass.
        link_efficiency: achieved fraction of a link's bandwidth in ring collectives.
        collectives: measured intra-node cost per collective kind (calibration); empty: the links.
        collectives_shared: the same, measured with twice as many ranks as cores (a CPU profile):
            used when a layout's ranks time-share the cores.
        comm_overlap: fraction of overlappable communication that compute really hides (1 on
            GPUs, where collectives run beside the compute; less on a CPU, whose cores do both).
        host_cores: set for a CPU profile: every rank of a job runs on this one host, one
            thread each, so with more ranks than cores each rank gets cores/ranks of one.
        host_bytes_per_s: what one node's host memory moves in the offloaded optimizer step (CPU AdamW on all
            its cores, shared by the node's ranks); 0: the device's memory bandwidth (a CPU profile).
        pcie_bytes_per_s: one device's host link, one direction, from pinned memory; 0: the device's memory
            bandwidth (a CPU profile: the copies stay in the same memory).
        source: where the numbers come from.
    """

    name: str
    memory_bytes: float
    peak_bf16: float
    peak_fp16: float
    peak_fp32: float
    hbm_bytes_per_s: float
    intra_node_bytes_per_s: float
    inter_node_bytes_per_s: float
    gpus_per_node: int = 8
    peak_fp8: float = 0.0
    intra_node_latency_s: float = 5e-6
    inter_node_latency_s: float = 10e-6
    gemm_bf16: GemmCurve = GemmCurve(0.8, 300.0)
    gemm_fp16: GemmCurve = GemmCurve(0.8, 300.0)
    gemm_fp32: GemmCurve = GemmCurve(0.8, 300.0)
    attention_efficiency: float = 1.0
    attention_overhead_s: float = 0.0
    memory_efficiency: float = 0.8
    memory_curve: tuple[tuple[float, float], ...] = ()
    elementwise: Mapping[str, tuple[tuple[float, float], ...]] = field(default_factory=dict)
    op_overhead_s: float = 0.0
    # Not measured (an older profile, a preset without a host measurement): no host bound, device time only.
    host_op_s: float = 0.0
    host_full_op_s: float = 0.0
    host_selective_op_s: float = 0.0
    host_unit_s: float = 0.0
    link_efficiency: float = 0.8
    collectives: Mapping[str, LinkCost] = field(default_factory=dict)
    collectives_shared: Mapping[str, LinkCost] = field(default_factory=dict)
    comm_overlap: float = 1.0
    host_cores: int | None = None
    host_bytes_per_s: float = 0.0
    pcie_bytes_per_s: float = 0.0
    source: str = ""

    def __post_init__(self):
        for name in ("memory_bytes", "peak_bf16", "peak_fp16", "peak_fp32", "hbm_bytes_per_s",
                     "intra_node_bytes_per_s", "inter_node_bytes_per_s"):
            if not getattr(self, name) > 0:
                raise PlanError(f"hardware {name}={getattr(self, name)!r} must be positive")
        if not isinstance(self.gpus_per_node, int) or self.gpus_per_node < 1:
            raise PlanError(f"--gpus-per-node must be a positive integer, got {self.gpus_per_node!r}")
        for name in ("memory_efficiency", "link_efficiency"):
            if not 0 < getattr(self, name) <= 1:
                raise PlanError(f"hardware {name}={getattr(self, name)!r} must be in (0, 1]")
        if not self.attention_efficiency > 0:
            raise PlanError(f"hardware attention_efficiency={self.attention_efficiency!r} must be positive")
        if not 0 <= self.comm_overlap <= 1:
            raise PlanError(f"hardware comm_overlap={self.comm_overlap!r} must be in [0, 1]")
        if self.host_cores is not None and (not isinstance(self.host_cores, int) or self.host_cores < 1):
            raise PlanError(f"hardware host_cores={self.host_cores!r} must be a positive integer")
        unknown = (set(self.collectives) | set(self.collectives_shared)) - set(COLLECTIVE_KINDS)
        if unknown:
            raise PlanError(f"hardware collectives: unknown kind {sorted(unknown)[0]!r}; "
                            f"use {', '.join(COLLECTIVE_KINDS)}")
        unknown = set(self.elementwise) - set(ELEMENTWISE_ACCESSES)
        if unknown:
            raise PlanError(f"hardware elementwise: unknown kind {sorted(unknown)[0]!r}; "
                            f"use {', '.join(ELEMENTWISE_ACCESSES)}")
        for name in ("op_overhead_s", "attention_overhead_s", "host_op_s", "host_full_op_s", "host_selective_op_s",
                     "host_unit_s"):
            if not getattr(self, name) >= 0:
                raise PlanError(f"hardware {name}={getattr(self, name)!r} must be non-negative")
        object.__setattr__(self, "memory_curve", _curve(self.memory_curve))
        object.__setattr__(self, "elementwise",
                           {Elementwise(kind): _curve(points) for kind, points in self.elementwise.items()})

    def peak(self, precision: str) -> float:
        return {"bf16": self.peak_bf16, "fp16": self.peak_fp16, "fp32": self.peak_fp32, "fp8": self.peak_fp8}[precision]

    def gemm(self, precision: str) -> GemmCurve:
        return {"bf16": self.gemm_bf16, "fp16": self.gemm_fp16, "fp32": self.gemm_fp32, "fp8": self.gemm_bf16}[precision]

    def gemm_seconds(self, m: float, n: float, k: float, precision: str, count: float = 1.0) -> float:
        """Time of `count` matmuls of shape (m, n, k): 2mnk FLOPs each at the curve's efficiency."""
        if count == 0 or min(m, n, k) <= 0:
            return 0.0
        return count * 2.0 * m * n * k / (self.peak(precision) * self.gemm(precision).efficiency(m, n, k))

    def memory_bytes_per_s(self, nbytes: float) -> float:
        """Achieved bandwidth of an element-wise kernel touching `nbytes` (log-interpolated curve)."""
        if not self.memory_curve:
            return self.hbm_bytes_per_s * self.memory_efficiency
        return _interpolate(self.memory_curve, nbytes)

    def elementwise_seconds(self, kind: Elementwise, elements: float, itemsize: int) -> float:
        """One eager kernel of `kind` over `elements`: its measured rate, else its accesses / bandwidth."""
        if elements <= 0:
            return 0.0
        curve = self.elementwise.get(kind)
        if curve:
            return elements / _interpolate(curve, elements)
        nbytes = ELEMENTWISE_ACCESSES[Elementwise(kind)] * elements * itemsize
        return nbytes / self.memory_bytes_per_s(nbytes)

    def memory_seconds(self, nbytes: float, kernel_bytes: float | None = None) -> float:
        """Time to move `nbytes` through kernels that each touch `kernel_bytes` (default: all at once)."""
        if nbytes <= 0:
            return 0.0
        return nbytes / self.memory_bytes_per_s(kernel_bytes or nbytes)

    def host_seconds(self, nbytes: float, ranks_per_node: int) -> float:
        """Time of the host step moving `nbytes` on one rank while the node's other ranks step theirs."""
        rate = self.host_bytes_per_s / max(1, ranks_per_node) if self.host_bytes_per_s else None
        return nbytes / rate if rate else self.memory_seconds(nbytes)

    def copy_seconds(self, nbytes: float) -> float:
        """Time of one host link copy of `nbytes` between device and pinned host memory."""
        return nbytes / self.pcie_bytes_per_s if self.pcie_bytes_per_s else self.memory_seconds(nbytes)

    def compute_share(self, world_size: int) -> float:
        """Fraction of one core (CPU profile) or device each rank gets: cores/ranks when oversubscribed."""
        if self.host_cores is None or world_size <= self.host_cores:
            return 1.0
        return self.host_cores / world_size


def _curve(points) -> tuple[tuple[float, float], ...]:
    points = tuple(sorted((float(size), float(rate)) for size, rate in points))
    if any(size <= 0 or rate <= 0 for size, rate in points):
        raise PlanError(f"a measured curve needs positive sizes and rates, got {points!r}")
    return points


def _interpolate(curve: tuple[tuple[float, float], ...], size: float) -> float:
    """The rate at `size` on a measured curve, log-linear between points, flat beyond the ends."""
    if size <= curve[0][0]:
        return curve[0][1]
    if size >= curve[-1][0]:
        return curve[-1][1]
    for (s0, r0), (s1, r1) in zip(curve, curve[1:]):
        if s0 <= size <= s1:
            w = math.log(size / s0) / math.log(s1 / s0)
            return math.exp((1 - w) * math.log(r0) + w * math.log(r1))
    raise AssertionError("unreachable: the curve is sorted")


# -- presets ----------------------------------------------------------------------------------

# Datasheet figures, dense (no sparsity): NVIDIA A100 Tensor Core GPU datasheet (2021): 312
# TFLOP/s BF16/FP16, 156 TF32, HBM2e 1,555 GB/s (40 GB) / 2,039 GB/s (80 GB), NVLink 600 GB/s
# (both directions); NVIDIA H100 datasheet (SXM5): 989 TFLOP/s BF16/FP16 dense (1,979 with
# sparsity), 495 TF32, 3.35 TB/s HBM3, NVLink 900 GB/s; H200 (SXM): 141 GB at 4.8 TB/s, the
# H100's compute. Links here are one direction: half of NVLink's figure; one InfiniBand NIC per
# GPU, HDR 200 Gb/s (DGX A100) or NDR 400 Gb/s (DGX H100) = 25 or 50 GB/s.
#
# Efficiency constants, one set per GPU kind (the same for every run the planner predicts):
# - A100 GEMM curve: e_max 0.84, x_half 220. NVIDIA's "Matrix Multiplication Background" guide
#   (Deep Learning Performance documentation) shows A100 FP16 GEMMs reaching ~250-270 TFLOP/s
#   (80-87 % of peak) for large sizes and falling off below ~1-2K in the smallest dimension;
#   e_max and x_half place the curve there and were then checked against every A100 run of
#   `paratrain.plan.published` (no run has constants of its own).
# - H100/H200 (one chip, one set): fitted to one H200's measurements (`benchmarks/results/H200-2026-11-26.md`
#   §4: eleven bf16 linears of 686-807 TFLOP/s, causal SDPA forward + backward at 267-433) and then to
#   its training steps (§2 and `benchmarks/results/gpu-bench-20261126-074256.md`, the test
#   `tests/plan/test_plan_h200.py`):
#   GEMM curve e_max 0.975, x_half 300, x_power 25,000 (every linear within 4 %: mid-sized ones at
#   ~780, the largest at the power limit's ~690); flash attention's matmuls at 1.22 × the curve at
#   their (s, s, d) shapes plus its operands' bytes and 85 µs per pass (each SDPA point within 3 %);
#   memory-bound kernels at 52 % of the HBM bandwidth (eager element-wise kernels of 16-180 MB, the
#   optimizer's passes) and 1 µs per eager kernel beyond its bytes. Those two, the only constants
#   fitted to step times, take the eleven measured steps (eager and compiled, ZeRO-0 and 3, no and
#   full recomputation, 1B and 7B) within 6 %.
# - Memory-bound kernels elsewhere reach ~80 % of the datasheet bandwidth (STREAM-like copies on
#   A100); ring collectives ~77 % of NVLink (NCCL all-reduce bus bandwidth ~230 GB/s of
#   300 on DGX A100, nccl-tests) and of InfiniBand.
# - Offload (not yet measured here; `benchmarks/bench_offload.py` measures both on a card): the host
#   link at ~80 % of PCIe's one-direction peak from pinned memory (Gen4 x16 32 GB/s: 25; Gen5: 50),
#   and a node's CPU AdamW at 100 GB/s of memory traffic (two sockets of 8-channel DDR5 peak at
#   ~600 GB/s; a fused CPU AdamW, 28 bytes per parameter, reaches a fraction of it).
# - The host's costs of an eager step (`paratrain.plan.host`; a property of the server's CPU and software, not of
#   the GPU, so one set for every preset): an estimate for the host beside the H200 of 2026-11-28, until a GPU
#   calibration measures them (`plan --calibrate` does, `benchmarks/gpu_check.py`'s calibration row records them).
#   `measure_host_ops` on a 2-core AMD EPYC (Zen 5) VM, per-pass minima over 10 runs: 11.0 µs per operation, 8.6
#   per forward operator under full recomputation, 26.6 under selective, 231 per ZeRO-3 unit and pass. The H200's
#   host ran the same chain of tiny products at 14.5 µs per operator (`op_overhead_s` of
#   `benchmarks/results/gpu-bench-20261128-014347-quick-profile.json`, host-timed then), this VM at 2.70, of which
#   a CUDA kernel's launch is L = 8.2 µs (cudaLaunchKernel's CPU time per call in
#   `benchmarks/results/gpu-zero3-compiled-profile-20261128-0403.log`): the H200's host runs the rest
#   s = (14.5 - 8.2) / 2.70 = 2.34 times slower. So L + 11.0·s = 34 µs per operation (each launches a
#   kernel), 8.6·s = 20 and 26.6·s = 62 µs per recomputed operator, 231·s + 9·L = 615 µs per unit (a block's 9
#   parameters copied in or out). The same profile shows ZeRO-3's gather at 690-880 µs of host time per unit
#   and pass (`_GatherUnit`, its backward; under the profiler).
_A100_GEMM = GemmCurve(0.80, 220.0)
_HOPPER_GEMM = GemmCurve(0.975, 300.0, 25_000.0)
_COMMON = dict(link_efficiency=0.77, host_bytes_per_s=100e9, host_op_s=34e-6, host_full_op_s=20e-6,
               host_selective_op_s=62e-6, host_unit_s=615e-6)
_A100 = dict(memory_efficiency=0.8, pcie_bytes_per_s=25e9)
_HOPPER = dict(memory_efficiency=0.52, attention_efficiency=1.22, attention_overhead_s=85e-6, op_overhead_s=1e-6,
               pcie_bytes_per_s=50e9)


def _gpu(name: str, memory: float, peak16: float, hbm: float, nvlink: float, ib: float, gemm: GemmCurve,
         source: str, kind: dict, fp8: bool = False) -> Hardware:
    """A datasheet GPU; `fp8`: its FP8 tensor cores run twice the 16-bit dense peak (Hopper)."""
    return Hardware(name, memory, peak16, peak16, peak16 / 2, hbm, nvlink, ib, gemm_bf16=gemm, gemm_fp16=gemm,
                    gemm_fp32=gemm, peak_fp8=2 * peak16 if fp8 else 0.0, source=source, **_COMMON, **kind)


HARDWARE_PRESETS: dict[str, Hardware] = {
    "a100-40gb": _gpu("a100-40gb", 40e9, 312e12, 1.555e12, 300e9, 25e9, _A100_GEMM, "NVIDIA A100 datasheet", _A100),
    "a100-80gb": _gpu("a100-80gb", 80e9, 312e12, 2.039e12, 300e9, 25e9, _A100_GEMM, "NVIDIA A100 datasheet", _A100),
    "h100-80gb": _gpu("h100-80gb", 80e9, 989e12, 3.35e12, 450e9, 50e9, _HOPPER_GEMM,
                      "NVIDIA H100 SXM datasheet; efficiencies fitted on an H200", _HOPPER, fp8=True),
    "h200": _gpu("h200", 141e9, 989e12, 4.8e12, 450e9, 50e9, _HOPPER_GEMM,
                 "NVIDIA H200 SXM datasheet; efficiencies fitted on an H200 (benchmarks/results/H200-2026-11-26.md)", _HOPPER,
                 fp8=True),
}


# -- profiles (JSON) ------------------------------------------------------------------------


def hardware_to_dict(hardware: Hardware) -> dict:
    """The profile as JSON-ready data (what `save_profile` writes)."""
    out = dataclasses.asdict(hardware)
    out["memory_curve"] = [list(point) for point in hardware.memory_curve]
    out["elementwise"] = {kind.value: [list(point) for point in points]
                          for kind, points in hardware.elementwise.items()}
    for name in ("collectives", "collectives_shared"):
        out[name] = {kind: dataclasses.asdict(cost) for kind, cost in getattr(hardware, name).items()}
    return {"format": PROFILE_FORMAT, **out}


def hardware_from_dict(data: dict, where: str = "hardware profile") -> Hardware:
    """Build a Hardware from profile data; a wrong field raises PlanError naming it."""
    if not isinstance(data, dict):
        raise PlanError(f"{where}: expected a JSON object")
    data = dict(data)
    if data.pop("format", None) != PROFILE_FORMAT:
        raise PlanError(f"{where}: not a paratrain hardware profile (format {PROFILE_FORMAT}); "
                        "write one with `paratrain plan --calibrate`")
    data.pop("kernels", None)  # written before the kernel stack became the run's (`Layout.compile`)
    known = {f.name for f in dataclasses.fields(Hardware)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise PlanError(f"{where}: unknown field {unknown[0]!r}")
    try:
        for name in ("gemm_bf16", "gemm_fp16", "gemm_fp32"):
            if name in data:
                data[name] = GemmCurve(**data[name])
        for name in ("collectives", "collectives_shared"):
            if name in data:
                data[name] = {kind: LinkCost(**cost) for kind, cost in data[name].items()}
        if "memory_curve" in data:
            data["memory_curve"] = tuple(tuple(point) for point in data["memory_curve"])
        return Hardware(**data)
    except PlanError as e:
        raise PlanError(f"{where}: {e}") from None
    except (TypeError, ValueError) as e:
        raise PlanError(f"{where}: invalid field value ({e})") from None


def save_profile(hardware: Hardware, path: str | Path) -> Path:
    """Write `hardware` as a JSON profile (atomically: a temporary file renamed into place)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(hardware_to_dict(hardware), indent=2) + "\n", encoding="utf-8")
    tmp.replace(path)
    return path


def load_profile(path: str | Path) -> Hardware:
    """Read a JSON profile; a missing or malformed file raises PlanError (one line)."""
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise PlanError(f"hardware profile {str(path)!r} does not exist") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise PlanError(f"hardware profile {str(path)!r} is not readable JSON ({type(e).__name__})") from None
    return hardware_from_dict(data, where=f"hardware profile {path}")


def get_hardware(name: str, **overrides) -> Hardware:
    """A preset by name, or a profile by file path, with any field replaced (None values are ignored)."""
    if name in HARDWARE_PRESETS:
        base = HARDWARE_PRESETS[name]
    elif name.endswith(".json") or Path(name).is_file():
        base = load_profile(name)
    else:
        raise PlanError(f"unknown hardware {name!r}; choose one of: {', '.join(HARDWARE_PRESETS)}, "
                        "or give a profile written by `paratrain plan --calibrate` (a .json file)")
    changes = {key: value for key, value in overrides.items() if value is not None}
    try:
        return dataclasses.replace(base, **changes) if changes else base
    except TypeError as e:
        raise PlanError(f"hardware override: {e}") from None
