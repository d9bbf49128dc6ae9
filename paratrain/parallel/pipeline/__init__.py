"""Pipeline parallelism: the layers split into stages on the `pp` ranks, micro-batches flowing through them.

- `schedules`: each schedule (GPipe, 1F1B, interleaved 1F1B, zero-bubble ZB-H1) as pure data,
  a list of actions per rank; its traits (in-flight micro-batches, split backward) are read off it.
- `simulator`: runs a schedule's actions without processes: deadlock check, bubble, timeline.
- `stages`: where a model is cut into stages (balanced by cost) and how each stage is built.
- `runner`: the one runtime that executes any schedule's actions with point-to-point transfers.
"""

from paratrain.parallel.pipeline.runner import PipelineRunner  # noqa: F401
from paratrain.parallel.pipeline.schedules import (  # noqa: F401
    DEFAULT_SCHEDULE, SCHEDULES, Action, Kind, Schedule, ScheduleName, build_schedule,
)
from paratrain.parallel.pipeline.stages import PipelineError, StageSplit, split_for_pipeline  # noqa: F401
