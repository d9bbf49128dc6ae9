"""Expert parallelism: the experts of every MoE layer split over the ep ranks, tokens sent to them (all-to-all).

- `sharding`: `apply_expert_parallel` and `ExpertInfo`: each rank's block of every layer's experts.
- `dispatch`: `ExpertDispatch`, the tokens to their experts' ranks and back (all-to-all).

`apply_expert_parallel` gives each MoE layer (a `MixtureOfExperts`: the reference model's
`paratrain.models.moe.MoE` is one, recognized by what it holds, not by its class) of a model this rank's
block of E/ep experts, under the same parameter names (w1 [E/ep, F, D]: the expert dimension is
the first, a shardable dimension like a tensor-parallel one), and replaces its dispatch step by
`ExpertDispatch` (`dispatch.py`). A model built on the meta device gets only its block: the
initializer it returns draws each expert tensor whole and keeps the block (as a tensor-parallel
slice is kept), so the values do not depend on the layout.

Gradients (`paratrain.parallel.data`): an expert's gradient on its rank already sums the
contributions of every token of the ep group routed to it (the all-to-all's backward brings them),
so expert tensors are reduced only over `ep_replicate`, the dp/ep data ranks that hold the same
block; every other parameter over the whole data axis. With the trainer's sum of the token
losses over the global token count both sums give one process's gradient; with a mean each
rank's loss is its own batch's mean and both are divided by dp (not by the ranks they are
reduced over: dp/ep ranks × ep groups of tokens = dp batches).
"""

from paratrain.parallel.expert.dispatch import ExpertDispatch
from paratrain.parallel.expert.sharding import (AXIS, REPLICATE_AXIS, ExpertInfo, MixtureOfExperts,
                                                apply_expert_parallel, moe_layers)

__all__ = ["AXIS", "REPLICATE_AXIS", "ExpertDispatch", "ExpertInfo", "MixtureOfExperts", "apply_expert_parallel",
           "moe_layers"]
