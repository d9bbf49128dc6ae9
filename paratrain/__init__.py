"""paratrain: train large language models across many processes.

    mesh = paratrain.init_mesh(dp=4)
    model, optimizer = paratrain.parallelize(model, mesh, optimizer=partial(torch.optim.AdamW, lr=3e-4),
                                             data=paratrain.DataParallel(zero=3))

The names below are imported on first use (PEP 562): `import paratrain` alone, and the commands
that need no tensors (`paratrain plan`, `paratrain models`), do not pay for importing torch.
"""

from __future__ import annotations

from paratrain.lazy import lazy_getattr

__version__ = "0.1.0"

_EXPORTS = {
    "Mesh": "paratrain.mesh", "MeshShape": "paratrain.mesh", "init_mesh": "paratrain.mesh",
    "ParatrainError": "paratrain.errors", "RunFailure": "paratrain.errors",
    "ContextParallel": "paratrain.parallel.api", "DataParallel": "paratrain.parallel.api", "GradReduction": "paratrain.parallel.data.engine",
    "ModelSpec": "paratrain.parallel.api", "PipelineParallel": "paratrain.parallel.api",
    "TensorParallel": "paratrain.parallel.api", "parallelize": "paratrain.parallel.api",
    "ParallelModel": "paratrain.parallel.model", "ScheduleName": "paratrain.parallel.pipeline.schedules",
    "from_pretrained": "paratrain.interop.hf", "MuonRecipe": "paratrain.parallel.muon",
    "LoRA": "paratrain.parallel.lora",
}
__all__ = sorted(_EXPORTS)


__getattr__ = lazy_getattr(__name__, _EXPORTS, globals())


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
