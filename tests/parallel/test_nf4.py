"""NF4 (`paratrain.parallel.nf4`): codes, double-quantized scales and decoded weights equal torchao's `NF4Tensor`
bit for bit; what torchao cannot encode (a last, shorter block of scales) decodes within NF4's own error."""

from __future__ import annotations

import pytest
import torch

from paratrain.parallel.nf4 import LEVELS, NF4, NF4Error
from paratrain.parallel.rules import NF4_BLOCK_SIZE as BLOCK_SIZE


def _torchao_nf4(weight: torch.Tensor):
    from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import to_nf4

    return to_nf4(weight, BLOCK_SIZE, 256)


# random weights of the sizes of a tiny model's and a Llama-class model's linears (a slice of an 8B's rows: the
# same columns and block statistics, kept small so that the torchao reference runs in a second)
SHAPES = [((256, 64), torch.bfloat16, 1.0), ((128, 384), torch.float32, 0.02), ((512, 96), torch.bfloat16, 0.02),
          ((64, 4096), torch.bfloat16, 0.02), ((14336 // 32, 4096 // 16), torch.bfloat16, 0.006)]


@pytest.mark.parametrize("shape, dtype, std", SHAPES)
def test_codes_scales_and_weights_equal_torchaos_bit_for_bit(shape, dtype, std):
    torch.manual_seed(sum(shape))
    weight = (torch.randn(shape) * std).to(dtype)
    weight[0, :7] = 0.0  # zeros and an outlier: the levels' ends and the middle
    weight[-1, -1] = 40 * std
    ours, ref = NF4.encode(weight), _torchao_nf4(weight)
    assert torch.equal(ours.codes, ref.quantized_data)
    assert torch.equal(ours.scales, ref.quantized_scalers)
    assert torch.equal(ours.factors, ref.quantization_factor) and ours.factors.dtype == dtype
    assert torch.equal(ours.mean, ref.scaler_mean)
    assert torch.equal(ours.decode(), ref.get_original_weight()) and ours.decode().dtype == dtype
    assert torch.equal(ours.decode(torch.float32), ref.to(torch.float32))


def test_real_weights_equal_torchaos():
    """A trained linear's weights (heavier tails than a Gaussian) from a short training of a small MLP."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64))
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    x = torch.randn(256, 64)
    for _ in range(20):
        loss = (net(x) - x.flip(1)).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
    weight = net[0].weight.detach().to(torch.bfloat16)
    ours, ref = NF4.encode(weight), _torchao_nf4(weight)
    assert torch.equal(ours.codes, ref.quantized_data) and torch.equal(ours.scales, ref.quantized_scalers)
    assert torch.equal(ours.decode(), ref.get_original_weight())


def test_a_last_shorter_block_of_scales_decodes_within_nf4s_error():
    """3 · 64 blocks: not a multiple of torchao's 256 scales per scaler block (torchao refuses it); the error of
    each element stays within half the widest gap between two levels of its block's scale, plus the scale's own
    8-bit rounding (at most one step, the clamp of +128 to 127)."""
    torch.manual_seed(1)
    weight = torch.randn(3 * 64, 64)
    with pytest.raises(AssertionError):
        _torchao_nf4(weight)
    packed = NF4.encode(weight)
    assert packed.scales.numel() == 3 * 64 and packed.factors.numel() == 1
    absmax = weight.view(-1, BLOCK_SIZE).abs().amax(dim=1, keepdim=True)
    half_gap = max(b - a for a, b in zip(LEVELS, LEVELS[1:])) / 2
    scale_error = (packed.block_scales().unsqueeze(-1) - absmax).abs()
    centred = (absmax - absmax.mean()).abs().max()  # one 8-bit step is 2 · centred / 256 (clamped at 127: a step)
    assert scale_error.max() <= centred / 128 + 1e-6
    error = (packed.decode().view(-1, BLOCK_SIZE) - weight.view(-1, BLOCK_SIZE)).abs()
    assert (error <= half_gap * absmax + scale_error + 1e-6).all()


def test_nf4_holds_a_weight_in_about_half_a_byte_per_parameter():
    weight = torch.randn(512, 512, dtype=torch.bfloat16)
    packed = NF4.encode(weight)
    assert packed.nbytes() / weight.numel() == pytest.approx(0.5 + 1 / 64, abs=1e-3)


@pytest.mark.parametrize("weight, match", [(torch.randn(10, 10), "not a whole number of NF4 blocks"),
                                           (torch.ones(64, dtype=torch.int32), "floating-point")])
def test_what_nf4_cannot_hold_is_refused_in_one_line(weight, match):
    with pytest.raises(NF4Error, match=match) as error:
        NF4.encode(weight)
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tp", [2, 4])
def test_a_tensor_parallel_slice_decodes_to_the_slice_of_the_whole_weight(dtype, tp):
    """A weight quantized whole (1,152 blocks: five blocks of scales, so ranks' blocks cross factor boundaries),
    its rows split as the tensor-parallel twins split them (`paratrain.parallel.tensor.adapters`): by output rows,
    and by input columns ([out, in / 64, 33] split on dim 1); each part, with the whole weight's factors and mean
    and its `layout`, decodes bit for bit to its slice of the whole weight's decoding."""
    torch.manual_seed(tp)
    weight = (torch.randn(96, 768) * 0.02).to(dtype)
    whole = NF4.encode(weight)
    decoded, rows, per_row = whole.decode(), whole.rows(), 768 // BLOCK_SIZE
    for rank in range(tp):
        blocks, run = rows.shape[0] // tp, per_row // tp
        by_rows = NF4.from_rows(rows.chunk(tp, 0)[rank], whole.factors, whole.mean, (96 // tp, 768), dtype,
                                layout=(rank * blocks, blocks, 0))
        by_columns = NF4.from_rows(rows.reshape(96, per_row, -1).chunk(tp, 1)[rank], whole.factors, whole.mean,
                                   (96, 768 // tp), dtype, layout=(rank * run, run, per_row))
        assert torch.equal(by_rows.decode(), decoded.chunk(tp, 0)[rank])
        assert torch.equal(by_columns.decode(), decoded.chunk(tp, 1)[rank])
    shifted = NF4.from_rows(rows.chunk(tp, 0)[1], whole.factors, whole.mean, (96 // tp, 768), dtype)
    assert not torch.equal(shifted.decode(), decoded.chunk(tp, 0)[1])  # without its layout: another block's factors
