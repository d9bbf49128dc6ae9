"""Data parallelism: every rank computes on its slice of the batch; gradients are reduced over `dp`.

- `engine`: the `Engine` protocol every data-parallel engine meets (what `ParallelModel` calls).
- `ddp`: DDP (ZeRO-0) and ZeRO-1/2: gradients written into flat buckets as backward produces
  them, each bucket's all-reduce or reduce-scatter launched the moment it is full.
- `buckets`: the layout of those buckets (which parameters share one, where each parameter's
  rows sit in its N chunks) and ZeRO-1/2's all-gather of updated parameters through it.
- `zero3`: ZeRO-3 (FSDP): parameters sharded at rest, one unit gathered at a time (where it
  prefetches the next), its gradients reduce-scattered as backward leaves it.
- `units`: how a model is cut into ZeRO-3 units and how a unit's flat parameters are laid out;
  `GatherCodec`, what a parameter travels as in its unit's all-gather (a feature's codec plugs in there).
- `placement`: the axis each ZeRO-3 parameter is sharded over (expert blocks: `ep_replicate`).
- `outside_use`: ZeRO-3's check that no parameter is read outside its unit's forward.
- `groups`: one engine per group of parameters (DDP, ZeRO-1/2 under expert parallelism).
- `shard`: which rows of every parameter rank r of N owns (the layout checkpoints record).
- `replicas`: agreeing start-up values, and hybrid sharding's all-reduce across replica groups.
- `offload`, `host_step`: the optimizer's masters and state in host memory, stepped there (overlapped);
  `offload.HostPlaced` is what that placement needs of an engine, outside the `Engine` contract.
"""

from paratrain.parallel.data.ddp import DataParallelEngine  # noqa: F401
from paratrain.parallel.data.engine import Engine  # noqa: F401
from paratrain.parallel.data.zero3 import FullyShardedEngine  # noqa: F401
