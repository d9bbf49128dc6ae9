"""ZeRO-3 trains a model whose full training state exceeds what one rank may use, on 4 ranks."""

import torch

from paratrain.mesh import MeshShape, build_mesh
from paratrain.models import ModelConfig, Transformer
from paratrain.parallel.api import DataParallel, parallelize
from parallel_cases import adamw, loss_sum, start_peak_measurement, vm_bytes

BIG = ModelConfig(vocab_size=512, dim=512, n_layers=12, n_heads=8, n_kv_heads=8, ffn_dim=1536, max_seq_len=64)
CAP_BYTES = 340 * 2**20  # the memory each rank may use for training, above its starting footprint


def _warm_up_torch() -> None:
    """Load the code pages of forward, backward and AdamW once, so they are not counted as training memory."""
    w = torch.nn.Parameter(torch.randn(8, 8))
    opt = torch.optim.AdamW([w])
    (w @ w).sum().backward()
    opt.step()


def _train_big_model(rank, world):
    _warm_up_torch()
    start = start_peak_measurement()
    mesh = build_mesh(MeshShape(dp=world))
    with torch.device("meta"):
        model = Transformer(BIG)
    init = lambda name, shape: model.param_init(name, shape, 0)  # noqa: E731
    model, optimizer = parallelize(model, mesh, optimizer=adamw, init=init,
                                   data=DataParallel(zero=3, grad_reduction="sum"))
    g = torch.Generator().manual_seed(rank)
    losses = []
    for _ in range(3):
        x = torch.randint(0, 512, (2, 64), generator=g)
        loss = loss_sum(model, x, x) / x.numel()
        loss.backward()
        model.clip_grad_norm_(1.0)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return vm_bytes("VmHWM") - start, losses


def test_zero3_trains_a_model_larger_than_one_ranks_share():
    from paratrain.testing import run_on_ranks

    full_state = 16 * BIG.num_params()  # fp32 params + grads + Adam moments, unsharded
    assert full_state > CAP_BYTES, "the model must not fit one rank's cap"
    results = run_on_ranks(_train_big_model, 4, timeout=240)
    peaks = [peak for peak, _ in results]
    for peak, losses in results:
        assert all(torch.isfinite(torch.tensor(losses)))
        assert peak < CAP_BYTES, f"peak {peak / 2**20:.0f} MiB above start ≥ cap {CAP_BYTES / 2**20:.0f} MiB"
    print(f"full state {full_state / 2**20:.0f} MiB; per-rank measured peaks (MiB): "
          f"{[round(p / 2**20) for p in peaks]}")
