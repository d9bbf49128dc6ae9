"""Model states per rank: how many parameters a tensor/pipeline rank holds, and the bytes of its
parameters, gradients and optimizer state at each ZeRO stage.

Arithmetic only; `paratrain.plan.memory` adds activations and communication buffers to
these for a whole layout. GB means 10⁹ bytes, as in the ZeRO paper.

Model states (Rajbhandari et al. 2019, "ZeRO", §3.1 and Table 1). Ψ is the
number of parameters this rank holds before data-parallel sharding (the
model split over tp and pp, see `stage_param_count`), N the number of ranks
ZeRO shards over: the data-parallel degree, or under hybrid sharding (HSDP,
`Layout.dp_shard`) the shard group, whose dp / dp_shard replicas each hold
the same shards. Mixed-precision Adam keeps 16-bit parameters (2Ψ), 16-bit gradients
(2Ψ) and K = 12 bytes of optimizer state per parameter: the fp32 master copy
(4Ψ) and the two fp32 moments (8Ψ)::

    baseline  (2 + 2 + K)Ψ       ZeRO-1  (2 + 2 + K/N)Ψ
    ZeRO-2    2Ψ + (2 + K)Ψ/N    ZeRO-3  (2 + 2 + K)Ψ/N

fp32 training has no separate master copy (the parameters are the master):
parameters 4Ψ, gradients 4Ψ, K = 8, sharded at the same ZeRO stages. Gradients
take the reduce dtype's size when it differs from the parameter dtype.

ZeRO-3 as paratrain.parallel.data.zero3 implements it (as FSDP2 does) keeps no
16-bit copy at rest: each rank's fp32 parameter shard is the master, cast to
the compute dtype as it enters the all-gather, and the reduce-scattered
gradient is kept in fp32 on that shard. Mixed precision at ZeRO-3 is then
parameters 4Ψ/N + gradients 4Ψ/N + moments 8Ψ/N, whatever the reduce dtype:
the paper's (2 + 2 + 12)Ψ/N in total, with the master counted as the parameters.

The seed arithmetic of docs/reference-numbers.md ("7B → 14 GB of fp16 weights; 56 GB of fp32
Adam moments; 70 GB in all") counts the 16-bit weights (2Ψ) and the two fp32
moments (8Ψ = 56 GB) only: 8 bytes per parameter is m and v, not master + m + v
(that would be 12Ψ = 84 GB). It is a lower bound that leaves out the 16-bit
gradients (14 GB) and the fp32 master copy (28 GB); full mixed-precision
model states are 16Ψ = 112 GB. `ModelStates` reports `master_weights` and
`adam_moments` separately so both readings can be printed.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from paratrain.models.configs import ModelConfig

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
MASTER_BYTES = 4  # fp32 master copy of each parameter (mixed precision only)
ADAM_MOMENT_BYTES = 8  # fp32 first and second moments
MUON_MOMENT_BYTES = 4  # Muon's one fp32 momentum buffer
MUON_UPDATE_BYTES = 2  # Muon's update in bf16 (the Newton–Schulz iteration's first rounding): what travels, and
# under offload its host staging buffer between the host's momentum and the device's iteration


@dataclass(frozen=True)
class ModelStates:
    """Bytes of parameters, gradients and optimizer state on one rank (floats, unrounded)."""

    params: float
    grads: float
    master_weights: float
    adam_moments: float
    host: float = 0.0  # offloaded to host memory (`offload`): not on the device

    @property
    def optimizer_state(self) -> float:
        return self.master_weights + self.adam_moments

    def __add__(self, other: ModelStates) -> ModelStates:
        """Two groups of parameters held on one rank (a stage's dense ones and its experts)."""
        return ModelStates(*(getattr(self, f.name) + getattr(other, f.name) for f in dataclasses.fields(self)))


def model_state_bytes(num_params: float, dp: int = 1, zero: int = 0, precision: str = "bf16",
                      reduce_dtype: str | None = None, offload: str | None = None, muon_params: float = 0.0
                      ) -> ModelStates:
    """Model states of a rank holding `num_params` (Ψ) parameters, ZeRO-sharded over `dp` (N).

    N is the ranks that split the shards: the data-parallel degree, or the shard group
    (`Layout.shard_ranks`) under hybrid sharding, whose replicas hold the same shards.

    Rajbhandari et al. 2019 §3.1/§5: the optimizer state (K = 12 for mixed precision: fp32
    master 4 + moments 8; K = 8 for fp32, whose parameters are the master) is divided by N
    from ZeRO-1, gradients from ZeRO-2, parameters at ZeRO-3. At ZeRO-3 with mixed precision
    the parameter shards are fp32 and are the master (see the module docstring). With a 16-bit
    gradient dtype paratrain holds a little more than the paper while the optimizer steps: fp32
    copies of the masters' gradients beside DDP / ZeRO-1's buckets (4Ψ/N; 4Ψ for DDP), and ZeRO-2's
    reduced shard summed in fp32 (4Ψ/N, not 2Ψ/N). The trainer reduces in fp32 by default, where
    the two agree.

    `offload="optimizer"` (`paratrain.parallel.data.offload`) moves the optimizer to the host: the device keeps
    no master and no moments; the host holds an fp32 master copy (in fp32 too: the parameter stays on the
    device), the moments and a buffer for the fp32 gradient, 16 bytes per element of this rank's shard.
    `offload="params"` (ZeRO-3) keeps the fp32 shards themselves there instead of a copy: the device holds no
    parameter between gathers, the host the same 16 bytes per element.

    `muon_params` of the Ψ are stepped by Muon (`paratrain.plan.muon`): one fp32 momentum buffer, 4 bytes per
    element where Adam keeps 8 (`adam_moments` then holds both optimizers' moments); offloaded, that buffer is on
    the host with a bf16 staging buffer for the update (`paratrain.parallel.muon.HostUpdates`): 14 bytes per
    element of the shard there, not 16.
    """
    param_bytes = DTYPE_BYTES[precision]
    grad_bytes = DTYPE_BYTES[reduce_dtype or precision]
    master = MASTER_BYTES if precision != "fp32" else 0
    if zero >= 3 and master:
        # The fp32 shard is both the parameter and the master; its gradient is fp32 too.
        param_bytes, grad_bytes, master = MASTER_BYTES, MASTER_BYTES, 0
    psi, n = float(num_params), dp
    shard = psi / (n if zero >= 1 else 1)  # what this rank's optimizer steps
    params, grads = param_bytes * psi / (n if zero >= 3 else 1), grad_bytes * psi / (n if zero >= 2 else 1)
    muon = muon_params / (n if zero >= 1 else 1)
    moments = ADAM_MOMENT_BYTES * (shard - muon) + MUON_MOMENT_BYTES * muon
    if offload:  # the master (or the shard itself), the moments and the gradient's buffer
        return ModelStates(0.0 if offload == "params" else params, grads, 0.0, 0.0,
                           host=2 * MASTER_BYTES * shard + moments + MUON_UPDATE_BYTES * muon)
    return ModelStates(params, grads, master * shard, moments)


def layers_on_stage(n_layers: int, pp: int, stage: int) -> int:
    """Transformer layers of pipeline stage `stage` (the first n_layers mod pp stages take one more)."""
    return n_layers // pp + (1 if stage < n_layers % pp else 0)


def block_param_count(model: ModelConfig) -> int:
    """Parameters of one transformer block, from ModelConfig.num_params() minus the non-block parts."""
    embedding = model.vocab_size * model.dim
    output = 0 if model.tie_embeddings else embedding
    blocks = model.num_params() - embedding - output - model.dim
    assert blocks % model.n_layers == 0, "every block has the same shape"
    return blocks // model.n_layers


def stage_param_count(model: ModelConfig, tp: int = 1, pp: int = 1, stage: int = 0) -> int:
    """Parameters one tensor-parallel rank of pipeline stage `stage` holds.

    Megatron partitioning (Shoeybi et al. 2019): every matrix of a block is split over tp
    (q/k/v/gate/up by columns, out/down by rows), the two RMSNorm weights (2h) are replicated;
    the embedding and the output head are vocab-parallel (V·h/t). The first stage holds the
    embedding, the last the final norm and the output head; a tied head is a second copy on
    the last stage when pp > 1 (as in Megatron), one shared table when pp = 1.
    """
    norms = 2 * model.dim
    sharded = block_param_count(model) - norms
    count = layers_on_stage(model.n_layers, pp, stage) * (-(-sharded // tp) + norms)
    table = -(-(model.vocab_size * model.dim) // tp)
    if stage == 0:
        count += table
    if stage == pp - 1:
        count += model.dim + (table if not model.tie_embeddings or pp > 1 else 0)
    return count


def gpt_num_params(n_layers: int, hidden: int, vocab_size: int = 51200, seq_len: int = 2048) -> int:
    """Exact parameter count of a GPT-2-style model (Narayanan et al. 2021, Table 1's models).

    Per layer: QKV 3h² + 3h, projection h² + h, MLP 8h² + 5h, two LayerNorms 4h → 12h² + 13h;
    learned positions s·h; tied embedding V·h; the final LayerNorm 2h. This is the paper's
    12·l·h²·(1 + 13/(12h) + (V + s)/(12·l·h)) plus the final LayerNorm's 2h (which the paper's
    formula omits; under 10⁻⁶ of the total).
    """
    l, h = n_layers, hidden
    return l * (12 * h * h + 13 * h) + (vocab_size + seq_len) * h + 2 * h
