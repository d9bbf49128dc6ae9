"""One training run of `paratrain.train`, in the pieces the loop needs.

- `build`: the preflight (every check before any process starts) and the run, built in order.
- `rundir`, `inputs`: the run directory and the paths the options name.
- `checkpoints`, `model_state`: what a run saves and how a launch resumes it.
- `guard`, `watchdog`, `diagnose`: non-finite steps, hangs, failed collectives and who was where.
- `memory_budget`: the planner's memory estimate against what one process has.
- `samples`: the sample ids each rank reads (to check the data order).
"""
