"""Layout-free sharded checkpoints: every rank saves the boxes of global tensors it holds, any layout reads them back.

    spec = ShardSpec("layers.0.wq", global_shape=(64, 32), offset=(rank * 16, 0))
    save_checkpoint(root, step, {"layers.0.wq": (spec, local_rows)}, rank_state={"rng": rng_bytes},
                    shared_state={"step": step}, coordinator=DistCoordinator(), keep_latest=2)

    path = find_latest(root)                  # newest committed checkpoint that verifies, or None
    with CheckpointReader(path) as ckpt:
        rows = ckpt.read("layers.0.wq", offset=(0, 0), shape=(32, 32))

This package is the storage core: it knows boxes of tensors, files and commits, not models.
A parallel model's masters and optimizer state become boxes in `paratrain.run.model_state`.

On disk: ``root/step-00000008/`` with ``rank-<r>.safetensors`` per rank,
``index.json`` and ``manifest.json`` (the commit marker); see `format` for the
schemas, `save` for the commit protocol and `store` for the root's layout.
Everything is safetensors and JSON; nothing is pickled.
"""

from paratrain.checkpoint.async_save import AsyncCheckpointer
from paratrain.checkpoint.coordinator import Coordinator, DistCoordinator, LocalCoordinator, dedicated_coordinator
from paratrain.checkpoint.format import (
    Box, CheckpointError, CheckpointWarning, CorruptCheckpointError, IncompatibleCheckpointError, ShardSpec,
    rank_filename, step_dirname,
)
from paratrain.checkpoint.reader import CheckpointReader, Compatibility
from paratrain.checkpoint.save import save_checkpoint
from paratrain.checkpoint.state import decode_state, encode_state
from paratrain.checkpoint.store import (
    apply_retention, check_free_space, find_latest, list_checkpoints, quarantine_incomplete, read_latest_pointer, verify_checkpoint,
)

__all__ = [
    "AsyncCheckpointer", "Box", "CheckpointError", "CheckpointReader", "CheckpointWarning", "Compatibility",
    "Coordinator", "CorruptCheckpointError", "DistCoordinator", "IncompatibleCheckpointError", "LocalCoordinator",
    "ShardSpec", "apply_retention", "check_free_space", "decode_state", "dedicated_coordinator", "encode_state", "find_latest",
    "list_checkpoints", "quarantine_incomplete", "rank_filename",
    "read_latest_pointer", "save_checkpoint", "step_dirname", "verify_checkpoint",
]
