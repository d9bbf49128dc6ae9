"""Pipeline parallelism: the layers split into stages on the `pp` ranks, micro-batches flowing through them.

- `schedules`: each schedule (GPipe, 1F1B, interleaved 1F1B, zero-bubble ZB-H1) as pure data,
  a list of actions per rank; its traits (in-flight micro-batches, split backward) are read off it.
- `simulator`: runs a schedule's actions without processes: deadlock check, bubble, timeline.
- `stages`: where a model is cut into stages (balanced by cost) and how each stage is built.
- `runner`: the one runtime that executes any schedule's actions with point-to-point transfers.
- `split_backward`: zero-bubble's backward in two halves, the input's gradient (B) and the weights' (W).

The schedules and the simulator are pure Python; the runner and the stages need torch, and are
imported on first use (PEP 562), so that the planner, which reads schedules only, does not import it.
"""

from __future__ import annotations

from paratrain.lazy import lazy_getattr

from paratrain.parallel.pipeline.schedules import (  # noqa: F401
    DEFAULT_SCHEDULE, SCHEDULES, Action, Kind, Schedule, ScheduleName, build_schedule,
)

_LAZY = {"PipelineRunner": "paratrain.parallel.pipeline.runner", "PipelineError": "paratrain.parallel.pipeline.stages",
         "StageSplit": "paratrain.parallel.pipeline.stages", "split_for_pipeline": "paratrain.parallel.pipeline.stages"}


__getattr__ = lazy_getattr(__name__, _LAZY, globals())
