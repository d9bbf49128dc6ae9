"""The ring's block kernels: the fused CPU op against explicit math, which one runs where, the CUDA op's call shapes."""

import pytest
import torch

from paratrain.parallel.context import kernels
from paratrain.parallel.context.kernels import attention_kernel
from paratrain.parallel.context.ring import blockwise_causal_attention


@pytest.mark.parametrize("causal, sq, sk", [(True, 16, 16), (False, 16, 8), (False, 8, 16)])
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 2e-6), (torch.bfloat16, 3e-2)])
def test_cpu_flash_equals_explicit_math_forward_lse_and_backward(causal, sq, sk, dtype, tol):
    """The ring's three call shapes (own block causal, earlier block's half keys, later block's half queries);
    the backward given the same out and lse; bf16 against fp32 math within bf16's rounding."""
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 4, n, 8, generator=g).to(dtype) for n in (sq, sk, sk))
    dout = torch.randn(2, 4, sq, 8, generator=g).to(dtype)
    out, lse = kernels.CPU_FLASH.forward(q, k, v, causal, 0.35)
    ref_out, ref_lse = kernels.EXPLICIT.forward(q, k, v, causal, 0.35)
    assert out.dtype == dtype and lse.dtype == torch.float32 and lse.shape == (2, 4, sq)
    assert (out.float() - ref_out.float()).abs().max() < tol and (lse - ref_lse).abs().max() < tol * 4
    grads = kernels.CPU_FLASH.backward(dout, q, k, v, out, lse, causal, 0.35)
    refs = kernels.EXPLICIT.backward(dout, q, k, v, out, lse, causal, 0.35)
    for got, ref in zip(grads, refs):
        assert got.shape == ref.shape and (got.float() - ref.float()).abs().max() < tol * 4


def test_the_kernel_is_chosen_by_device_dtype_and_head_size_in_one_place():
    assert attention_kernel("cpu", torch.float32, 8) is kernels.CPU_FLASH
    assert attention_kernel("cpu", torch.bfloat16, 7) is kernels.CPU_FLASH
    assert attention_kernel("cuda", torch.bfloat16, 128) is kernels.CUDA_FLASH
    assert attention_kernel("cuda", torch.float16, 64) is kernels.CUDA_FLASH
    assert attention_kernel("cuda", torch.bfloat16, 512) is kernels.CUDA_EFFICIENT  # beyond flash's head sizes
    assert attention_kernel("cuda", torch.float32, 64) is kernels.CUDA_EFFICIENT
    assert attention_kernel("cuda", torch.float64, 64) is kernels.EXPLICIT
    assert attention_kernel("cuda", torch.float16, 36) is kernels.EXPLICIT
    assert attention_kernel("mps", torch.float32, 64) is kernels.EXPLICIT
    assert attention_kernel("cpu", torch.int8, 64) is kernels.EXPLICIT
    # masked blocks (a document mask): CPU flash takes the mask as a bias; the CUDA ops here take none
    assert attention_kernel("cpu", torch.bfloat16, 64, masked=True) is kernels.CPU_FLASH
    assert attention_kernel("cuda", torch.bfloat16, 128, masked=True) is kernels.EXPLICIT
    assert attention_kernel("cuda", torch.float32, 64, masked=True) is kernels.EXPLICIT
    assert all(k.masks for k in (kernels.CPU_FLASH, kernels.EXPLICIT))


@pytest.mark.parametrize("kernel", [kernels.CUDA_EFFICIENT, kernels.CUDA_FLASH], ids=lambda k: k.name)
@pytest.mark.parametrize("sq, sk, causal", [(40, 40, True), (40, 20, False), (20, 40, False)])
def test_cuda_calls_match_the_ops_schemas_on_meta_tensors(kernel, sq, sk, causal):
    """No GPU here: the aten ops' meta functions check the arguments and give the shapes. The forward's lse
    (the efficient op pads it to a multiple of 32 rows) comes back as [B, H, Sq] for the merge."""
    q, dout = (torch.empty(2, 4, sq, 64, device="meta", dtype=torch.bfloat16) for _ in range(2))
    k, v = (torch.empty(2, 4, sk, 64, device="meta", dtype=torch.bfloat16) for _ in range(2))
    out, lse = kernel.forward(q, k, v, causal, 0.125)
    assert out.shape == q.shape and lse.shape == (2, 4, sq) and lse.dtype == torch.float32
    dq, dk, dv = kernel.backward(dout, q, k, v, out.contiguous(), lse, causal, 0.125)
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape


@pytest.mark.parametrize("kernel", [kernels.CUDA_EFFICIENT, kernels.CUDA_FLASH], ids=lambda k: k.name)
def test_cuda_kernels_hand_the_ops_the_layouts_their_kernels_read(kernel, monkeypatch):
    """The CUDA calls run through CPU emulations of the ops (tests/cuda_ops_emulation.py) that read out at the
    kernel's fixed row stride H·E and lse at its padded layout, as the GPU does: split causal attention equals
    whole causal SDPA (fp32, exact math) only if every call hands the ops what their kernels assume. A
    contiguous out handed to the efficient backward, as the ring's row slices are, reads the wrong rows."""
    import cuda_ops_emulation

    monkeypatch.setattr(kernels, "_op", cuda_ops_emulation.OPS.__getitem__)
    g = torch.Generator().manual_seed(5)
    q, k, v, grad = (torch.randn(2, 4, 4 * 40, 16, generator=g, dtype=torch.float64) for _ in range(4))
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    expected = torch.nn.functional.scaled_dot_product_attention(*full, is_causal=True)
    expected.backward(grad)
    got = blockwise_causal_attention(kernel, q, k, v, grad, blocks=4)
    for mine, ref in zip(got, [expected, *(t.grad for t in full)]):
        assert torch.allclose(mine.double(), ref, rtol=0, atol=1e-5), (mine.double() - ref).abs().max()
