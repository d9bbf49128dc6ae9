"""`paratrain train`: one flag per config field; one process, `--nproc N` local processes, or under torchrun/srun."""

from __future__ import annotations

import argparse

from paratrain.config import Config, coerce, iter_options, load_toml


def add_parser(subparsers):
    parser = subparsers.add_parser("train", help="train a model", description=(
        "Train a model. Options come from the defaults, then --config FILE (TOML, one table per "
        "section), then the command line. With --nproc N, N local processes are launched; under "
        "torchrun or srun, each process runs this same command."))
    parser.add_argument("--config", metavar="FILE", help="TOML file with [model], [data], [train], [run] tables")
    add_config_options(parser)
    return parser


def add_config_options(parser: argparse.ArgumentParser) -> None:
    """One flag per config field, grouped by section, help taken from the field."""
    groups = {}
    for section, _, f, flag in iter_options():
        group = groups.get(section) or groups.setdefault(
            section, parser.add_argument_group(f"[{section}] options"))
        default = f.default
        choices = f.metadata.get("choices")
        allowed = f"; one of {', '.join(map(str, choices))}" if choices else ""
        shown = "auto" if default in ("", None) else default
        help_text = f"{f.metadata['help']}{allowed}" + ("" if "(default:" in f.metadata["help"] else f" (default: {shown})")
        kwargs = dict(dest=f"{section}.{f.name}", default=argparse.SUPPRESS, help=help_text)
        if isinstance(default, bool):
            group.add_argument(flag, action=argparse.BooleanOptionalAction, **kwargs)
        else:
            group.add_argument(flag, metavar=f.name.upper(), **kwargs)


def config_from_args(args: argparse.Namespace) -> Config:
    """Defaults, then the TOML file, then the command line."""
    data = load_toml(args.config) if getattr(args, "config", None) else {}
    for section, section_cls, f, flag in iter_options():
        key = f"{section}.{f.name}"
        if key in vars(args):
            data.setdefault(section, {})[f.name] = coerce(flag, section_cls, f, vars(args)[key])
    return Config.from_dict(data)


def run(args) -> int:
    from paratrain.distributed import detect_env
    from paratrain.launch import PREEMPTED_EXIT, launch_local
    from paratrain.run.build import preflight
    from paratrain.train import train

    cfg = config_from_args(args)
    if (cfg.run.nproc > 1 or cfg.run.nnodes > 1) and not detect_env().distributed:
        # Before any process starts: no restart is burned on bad input.
        preflight(cfg, world_size=cfg.run.nproc * cfg.run.nnodes)
        launch_local(cfg)  # each worker calls train(cfg)
        return 0
    return PREEMPTED_EXIT if train(cfg).preempted else 0
