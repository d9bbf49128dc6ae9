"""Parallelism strategies applied to plain modules: data parallel and ZeRO (tensor and pipeline to come)."""
