"""What the device this process computes on can do: its dense peak FLOP/s, looked up by name.

Model FLOPs utilisation divides achieved FLOP/s by this peak, so a wrong peak makes MFU
meaningless. The table holds each accelerator's dense (no 2:4 sparsity) tensor-core peak for
16-bit floats (bf16, or fp16 where bf16 is missing), from the vendors' data sheets; the first
pattern contained in `torch.cuda.get_device_name()` wins, so more specific names come first.
A CPU has no such figure: MFU is then left out unless `--peak-flops` gives one.
"""

from __future__ import annotations

import torch

# (substring of the device name, dense 16-bit tensor FLOP/s): NVIDIA data sheets unless noted.
DEVICE_PEAK_FLOPS: tuple[tuple[str, float], ...] = (
    ("GB200", 2.5e15),  # B200 inside a GB200 superchip: 2.5 PFLOP/s dense bf16
    ("B200", 2.25e15),  # HGX B200: 2.25 PFLOP/s dense bf16
    ("B100", 1.75e15),
    ("H200", 989e12),  # H200 SXM: the H100 SXM's tensor cores, more memory
    ("GH200", 989e12),
    ("H100 PCIe", 756e12),
    ("H100 NVL", 835e12),
    ("H100", 989e12),  # H100 SXM5 (reported as "NVIDIA H100 80GB HBM3"): 989.4 TFLOP/s dense bf16
    ("H800", 989e12),
    ("H20", 148e12),
    ("A100", 312e12),  # A100 SXM4 and PCIe, 40 and 80 GB
    ("A800", 312e12),
    ("L40S", 362e12),
    ("L40", 181e12),
    ("L4", 121e12),
    ("A40", 150e12),
    ("A30", 165e12),
    ("A10G", 70e12),  # AWS's A10G
    ("A10", 125e12),
    ("V100", 125e12),  # fp16 tensor cores (no bf16)
    ("T4", 65e12),  # fp16 tensor cores
    ("MI300X", 1307e12),  # AMD Instinct MI300X, dense bf16 (AMD data sheet)
    ("MI250X", 383e12),
)


def peak_flops_of(name: str) -> float | None:
    """The dense 16-bit peak FLOP/s of an accelerator named `name`, or None when the table does not know it."""
    return next((peak for pattern, peak in DEVICE_PEAK_FLOPS if pattern in name), None)


def device_peak_flops(device: torch.device) -> float | None:
    """The peak of `device` by its name: None on a CPU or an accelerator the table does not know."""
    if device.type != "cuda":
        return None
    return peak_flops_of(torch.cuda.get_device_name(device))


def slow_bf16_matmuls(device: torch.device) -> bool:
    """Whether bf16 matmuls on `device` take torch's reference CPU kernel: an x86 CPU without AVX512-BF16 or AMX
    (oneDNN's bf16 paths need them), where a bf16 matmul runs about 20x slower than the same one in fp32 (2048 x 256
    by 256 x 688: 257 ms against 11.5 ms on an AVX2 EPYC core pair, torch 2.13)."""
    if device.type != "cpu":
        return False
    check = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    try:
        return check is not None and torch.backends.mkldnn.is_available() and not check()
    except RuntimeError:  # a torch without the check: no claim either way
        return False
