"""`paratrain prepare`: tokenize a corpus once into memory-mapped token files."""

from __future__ import annotations


def add_parser(subparsers):
    parser = subparsers.add_parser("prepare", help="tokenize a corpus into token files", description=(
        "Tokenize a corpus once into a memory-mapped token file (tokens.bin + meta.json), for "
        "corpora larger than memory. Train on it with `paratrain train --data DIR`."))
    parser.add_argument("--data", default="default", help="'default' (stdlib sources), a file, a directory or a glob")
    parser.add_argument("--tokenizer", default="byte", help="'byte', 'bpe:N' or a tokenizer.json path")
    parser.add_argument("--out", required=True, help="output directory")
    return parser


def run(args) -> int:
    from paratrain.data import prepare_corpus

    out = prepare_corpus(None if args.data == "default" else args.data, args.out, tokenizer_spec=args.tokenizer)
    print(f"wrote {out}")
    return 0
