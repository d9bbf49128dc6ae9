"""`paratrain train`: one flag per config field; one process, `--nproc N` local processes, or under torchrun/srun."""

from __future__ import annotations

from paratrain.commands.options import add_config_options, config_from_args, given_options


def add_parser(subparsers):
    parser = subparsers.add_parser("train", help="train a model", description=(
        "Train a model. Options come from the defaults, then --config FILE (TOML, one table per "
        "section), then the command line. With --nproc N, N local processes are launched; under "
        "torchrun or srun, each process runs this same command."))
    parser.add_argument("--config", metavar="FILE", help="TOML file with [model], [data], [train], [run] tables")
    add_config_options(parser)
    return parser


def run(args) -> int:
    from paratrain.distributed import detect_env  # torch-free, as is everything up to the launch decision

    cfg = config_from_args(args)
    if cfg.checkpoint.resume not in ("auto", "none"):  # the checkpoint's own config, under the options given
        from paratrain.config import load_toml
        from paratrain.run.checkpoints import continue_config

        toml = load_toml(args.config) if args.config else {}
        given = set(given_options(args)) | {f"{section}.{key}" for section, values in toml.items() for key in values}
        cfg = continue_config(cfg, given)
    if (cfg.run.nproc > 1 or cfg.run.nnodes > 1) and not detect_env().distributed:
        from paratrain import forkserver

        # The workers' server imports torch on one core while this process imports it on another.
        started_here = not forkserver.running()
        forkserver.start()
        from paratrain.launch import launch_local
        from paratrain.run.build import preflight

        # Before any worker starts: no restart is burned on bad input. The workers get the options it resolved.
        try:
            cfg = preflight(cfg, world_size=cfg.run.nproc * cfg.run.nnodes).cfg
        except BaseException:
            if started_here:  # refused: the server this launch started goes, mid-preload (a caller's own stays)
                forkserver.stop()
            raise
        launch_local(cfg)  # each worker calls train(cfg)
        return 0
    from paratrain.launch import PREEMPTED_EXIT
    from paratrain.train import train

    return PREEMPTED_EXIT if train(cfg).preempted else 0
