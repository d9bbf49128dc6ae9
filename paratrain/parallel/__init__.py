"""Parallelism strategies applied to plain modules, one package per strategy.

- `api`: `parallelize()`, the one place where strategies are applied, in a fixed, commented order.
- `model`: `ParallelModel`, the wrapped model; `contract`: `TrainableModel`, what the trainer and `run/`
  may call on it (and the step's `StepResult` and `Verdict`).
- `rules`: every layout rule, decided once (`parallelize`, `train`, `plan` and `verify` ask it).
- `data`: DDP, ZeRO-1/2/3 and hybrid sharding (the `dp` axis).
- `tensor`: tensor and sequence parallelism (the `tp` axis): primitives, layers, plans.
- `pipeline`: schedules as data, their simulator, stage splitting and the runner (the `pp` axis).
- `context`: context parallelism (the `cp` axis): the load-balanced sequence split and ring attention.
- `norm`: sums of squares shared by every strategy's gradient norm.
- `lora`: LoRA and QLoRA, a model converted before any strategy applies; `nf4`: QLoRA's 4-bit NormalFloat codec.
"""
