"""What tests of code that runs on several ranks need: the ranks themselves, and counters to run a step under.

- `run_on_ranks` (`paratrain.ranks`): a function run on N local gloo ranks, the first failure re-raised
  with its rank (`RankFailure`), a hang stopped with every stack (`RankTimeout`).
- `counters`: `HostSyncs` (what makes the host wait for the device), `Collectives` (the bytes of every
  c10d collective, per process group or mesh axis) and `MemoryTraffic` (the bytes every operator reads
  and writes), counted at torch's dispatcher.

Nothing in paratrain's own code imports this package: it is the face of those helpers for tests,
paratrain's and a user's own.
"""

from paratrain.ranks import RankError, RankFailure, RankTimeout, run_on_ranks
from paratrain.testing.counters import Collectives, HostSyncs, MemoryTraffic

__all__ = ["Collectives", "HostSyncs", "MemoryTraffic", "RankError", "RankFailure", "RankTimeout", "run_on_ranks"]
