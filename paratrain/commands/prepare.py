"""`paratrain prepare`: tokenize a corpus once into memory-mapped token files."""

from __future__ import annotations


def add_parser(subparsers):
    parser = subparsers.add_parser("prepare", help="tokenize a corpus into token files", description=(
        "Tokenize a corpus once into a memory-mapped token file (tokens.bin, documents.bin: where each document "
        "starts, meta.json), streaming, in bounded memory, for corpora larger than memory. Train on it with "
        "`paratrain train --data DIR`. Interrupted, it leaves .OUT.partial, from which the same command continues "
        "after the last finished input file."))
    parser.add_argument("--data", default="default",
                        help="'default' (stdlib sources), a text, JSON Lines (.jsonl, .jsonl.gz, .jsonl.zst) or Parquet "
                             "file, a directory or glob of them, a dataset saved with `datasets`' save_to_disk, or "
                             "hf:NAME[:CONFIG][:SPLIT], a dataset streamed from the Hugging Face hub")
    parser.add_argument("--text-key", default="text",
                        help="the field of each JSON Lines record / the column holding its text (default: text)")
    parser.add_argument("--tokenizer", default="byte", help="'byte', 'bpe:N' or a tokenizer.json path")
    parser.add_argument("--workers", type=int, default=0,
                        help="0: this process, with the tokenizer library's threads (one per core; the fastest on "
                             "few cores); 1: this process on one thread; N > 1: N processes of one thread each; the "
                             "output does not depend on it (default 0)")
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace what --out holds (refused without it when --out is not empty)")
    return parser


def run(args) -> int:
    from paratrain.data import prepare_corpus

    out = prepare_corpus(None if args.data == "default" else args.data, args.out, tokenizer_spec=args.tokenizer,
                         text_key=args.text_key, workers=args.workers, overwrite=args.overwrite)
    print(f"wrote {out}")
    return 0
