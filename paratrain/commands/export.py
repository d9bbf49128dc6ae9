"""`paratrain export RUN_OR_CKPT OUT`: write a run's weights as a Hugging Face Llama directory.

Bad input (a missing source, a checkpoint whose tensors do not match its
model config, an occupied output directory) ends with one line on stderr and
exit code 2.
"""

from __future__ import annotations

import argparse

from paratrain.interop.export import EXPORT_DTYPES
from paratrain.run.export import export_adapter, export_hf

MB = 2**20


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register the `export` subcommand on the `paratrain` parser's subparsers."""
    parser = subparsers.add_parser("export", help="write a run or checkpoint as a Hugging Face Llama directory",
                                   description=(
        "Write the model weights of a run (its newest committed checkpoint, else final/), of one checkpoint "
        "(a step-* directory) or of a final/ directory as a Hugging Face Llama directory: config.json, "
        "model.safetensors and the run's tokenizer. LlamaForCausalLM.from_pretrained(OUT) loads it, and "
        "`paratrain train --init-from OUT` starts from it."))
    parser.add_argument("source", metavar="RUN_OR_CKPT", help="run directory, checkpoint step-* directory or final/")
    parser.add_argument("out", metavar="OUT", help="output directory (must not exist or be empty)")
    parser.add_argument("--dtype", default="float32", choices=list(EXPORT_DTYPES),
                        help="dtype of the written weights (default: float32, the master weights unrounded)")
    parser.add_argument("--max-shard-mb", type=float, default=None, metavar="MB",
                        help="split the weights into files of at most MB megabytes, with an index "
                             "(default: one model.safetensors)")
    parser.add_argument("--overwrite", action="store_true", help="replace OUT if it already holds files")
    lora = parser.add_mutually_exclusive_group()
    lora.add_argument("--adapter", action="store_true",
                      help="a --lora run: write its adapters in PEFT's format (adapter_config.json, "
                           "adapter_model.safetensors), which peft.PeftModel.from_pretrained loads over the base")
    lora.add_argument("--merge", action="store_true",
                      help="a --lora run: write the whole model with the adapters merged into the base weights "
                           "(as PEFT's merge_and_unload), a Hugging Face directory")
    return parser


def run(args: argparse.Namespace) -> int:
    """Run `paratrain export` (bad input raises HFError, CheckpointError or ModelConfigError: exit 2)."""
    max_bytes = None if args.max_shard_mb is None else int(args.max_shard_mb * MB)
    if args.adapter:
        result = export_adapter(args.source, args.out, dtype=EXPORT_DTYPES[args.dtype], overwrite=args.overwrite)
        print(f"exported the LoRA adapters of {_what(result)} to {result.out_dir} in PEFT's format: "
              f"{', '.join(result.weight_files)}")
        return 0
    result = export_hf(args.source, args.out, dtype=EXPORT_DTYPES[args.dtype], max_shard_bytes=max_bytes,
                       overwrite=args.overwrite, merge=args.merge)
    what = _what(result)
    tokenizer = result.tokenizer_file or "none found"
    print(f"exported {what} to {result.out_dir}: {result.model_config.num_params():,} parameters as {args.dtype} "
          f"in {len(result.weight_files)} file(s){'; LoRA adapters merged' if args.merge else ''}; tokenizer: {tokenizer}")
    return 0


def _what(result) -> str:
    return f"step {result.step} ({result.source.path})" if result.step is not None else str(result.source.path)
