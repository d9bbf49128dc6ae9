"""The `paratrain` command: a thin layer over the Python API.

    paratrain train [--config FILE] [--steps N ...]   train (one process, --nproc N, or under torchrun/srun)
    paratrain prepare --data PATH --out DIR          tokenize a corpus into memory-mapped token files
    paratrain models [--json]                        list the named model configs and their sizes
    paratrain plan --model NAME (--gpus N | --dp --tp --pp --zero ...)   estimate memory and time; search layouts
    paratrain export RUN_OR_CKPT OUT                 write a run's weights as a Hugging Face Llama directory

Bad input ends with one line on stderr and exit code 2, never a traceback.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from paratrain.checkpoint.export_cli import add_export_parser, cmd_export
from paratrain.checkpoint.format import CheckpointError
from paratrain.config import Config, ConfigError, coerce, iter_options, load_toml
from paratrain.data import DataError
from paratrain.distributed import LaunchError, detect_env
from paratrain.models import MODEL_CONFIGS, ModelConfigError
from paratrain.plan.cli import add_plan_parser, cmd_plan
from paratrain.report import add_report_parser, cmd_report
from paratrain.verify import add_verify_parser, cmd_verify

USER_ERRORS = (ConfigError, DataError, ModelConfigError, LaunchError, CheckpointError)


class _Parser(argparse.ArgumentParser):
    """argparse that reports bad usage as one line (and exit code 2), without the usage dump."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="paratrain", description="Train large language models across many processes.")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    train = commands.add_parser("train", help="train a model", description=(
        "Train a model. Options come from the defaults, then --config FILE (TOML, one table per "
        "section), then the command line. With --nproc N, N local processes are launched; under "
        "torchrun or srun, each process runs this same command."))
    train.add_argument("--config", metavar="FILE", help="TOML file with [model], [data], [train], [run] tables")
    add_config_options(train)

    prepare = commands.add_parser("prepare", help="tokenize a corpus into token files", description=(
        "Tokenize a corpus once into a memory-mapped token file (tokens.bin + meta.json), for "
        "corpora larger than memory. Train on it with `paratrain train --data DIR`."))
    prepare.add_argument("--data", default="default", help="'default' (stdlib sources), a file, a directory or a glob")
    prepare.add_argument("--tokenizer", default="byte", help="'byte', 'bpe:N' or a tokenizer.json path")
    prepare.add_argument("--out", required=True, help="output directory")

    models = commands.add_parser("models", help="list named model configs", description=(
        "List the named model configs with their exact parameter counts."))
    models.add_argument("--json", action="store_true", help="print one JSON document instead of a table")
    add_plan_parser(commands)
    add_report_parser(commands)
    add_verify_parser(commands)
    add_export_parser(commands)
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
        help_text = f"{f.metadata['help']}{allowed} (default: {default if default != '' else 'auto'})"
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


def cmd_train(args) -> int:
    from paratrain.diagnose import CollectiveFailure
    from paratrain.guard import TrainingAborted
    from paratrain.launch import PREEMPTED_EXIT, LaunchFailed, Preempted, launch_local
    from paratrain.train import default_run_dir, preflight, train

    cfg = config_from_args(args)
    env = detect_env()
    launching = cfg.run.nproc > 1 and not env.distributed
    preflight(cfg, world_size=cfg.run.nproc if launching else env.world_size)
    try:
        if not launching:
            return PREEMPTED_EXIT if train(cfg).preempted else 0
        cfg.run.out = cfg.run.out or default_run_dir(cfg)
        launch_local(cfg)
    except (LaunchFailed, TrainingAborted, CollectiveFailure) as e:
        print(f"paratrain train: {e}", file=sys.stderr)
        return 1
    except Preempted as e:
        print(f"paratrain train: {e}", file=sys.stderr)
        return PREEMPTED_EXIT
    return 0


def cmd_prepare(args) -> int:
    from paratrain.data import prepare_corpus

    out = prepare_corpus(None if args.data == "default" else args.data, args.out, tokenizer_spec=args.tokenizer)
    print(f"wrote {out}")
    return 0


def cmd_models(args) -> int:
    rows = [{"name": name, "parameters": cfg.num_params(), **dataclasses.asdict(cfg)}
            for name, cfg in MODEL_CONFIGS.items()]
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    print(f"{'name':<12} {'parameters':>16} {'layers':>6} {'dim':>6} {'heads':>5} {'kv':>4} {'ffn':>6} {'vocab':>7}")
    for r in rows:
        print(f"{r['name']:<12} {r['parameters']:>16,} {r['n_layers']:>6} {r['dim']:>6} {r['n_heads']:>5} "
              f"{r['n_kv_heads']:>4} {r['ffn_dim']:>6} {r['vocab_size']:>7}")
    return 0


COMMANDS = {"train": cmd_train, "prepare": cmd_prepare, "models": cmd_models, "plan": cmd_plan,
            "report": cmd_report, "verify": cmd_verify, "export": cmd_export}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return COMMANDS[args.command](args)
    except USER_ERRORS as e:
        print(f"paratrain {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"paratrain {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
