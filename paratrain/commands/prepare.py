"""`paratrain prepare`: tokenize a corpus once into memory-mapped token files."""

from __future__ import annotations


def add_parser(subparsers):
    parser = subparsers.add_parser("prepare", help="tokenize a corpus into token files", description=(
        "Tokenize a corpus once into a memory-mapped token file (tokens.bin, documents.bin: where each document "
        "starts, mask.bin for chat data: which tokens the loss learns, meta.json), streaming, in bounded memory, for "
        "corpora larger than memory. Train on it with `paratrain train --data DIR`. Interrupted, it leaves "
        ".OUT.partial, from which the same command continues after the last finished input file."))
    parser.add_argument("--data", default="default",
                        help="'default' (stdlib sources), a text, JSON Lines (.jsonl, .jsonl.gz, .jsonl.zst) or Parquet "
                             "file, a directory or glob of them, a dataset saved with `datasets`' save_to_disk, or "
                             "hf:NAME[:CONFIG][:SPLIT], a dataset streamed from the Hugging Face hub")
    parser.add_argument("--text-key", default="text",
                        help="the field of each JSON Lines record / the column holding its text (default: text)")
    parser.add_argument("--tokenizer", default="byte",
                        help="'byte', 'bpe:N', a tokenizer.json path, or a model directory (tokenizer.json and "
                             "tokenizer_config.json, whose chat template renders chat data)")
    parser.add_argument("--format", default="auto", choices=("auto", "chat", "text"),
                        help="'chat' (records of messages, conversations or prompt/completion), 'text', or 'auto': "
                             "from the first record (default), said in the first line")
    parser.add_argument("--chat-template", default="",
                        help="a Jinja chat template file, instead of the --tokenizer directory's")
    parser.add_argument("--loss-on", default="assistant", choices=("assistant", "all", "completion"),
                        help="chat data's targets: the assistant turns' content and end-of-turn token (default), "
                             "the last assistant turn ('completion'), or every token")
    parser.add_argument("--max-seq-len", type=int, default=0,
                        help="chat data: the sequence length a conversation must fit (seq_len + 1 tokens), else "
                             "--long applies (default 0: keep every conversation; training packs at its --seq-len)")
    parser.add_argument("--long", default="drop", choices=("drop", "truncate"),
                        help="a conversation longer than --max-seq-len: drop it (default) or keep its start")
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
    from paratrain.data.chat import ChatOptions
    from paratrain.data.corpus import corpus_files
    from paratrain.data.prepare import data_format, open_prepared

    data = None if args.data == "default" else args.data
    chat = ChatOptions(format=args.format, chat_template=args.chat_template, loss_on=args.loss_on,
                       long=args.long, max_seq_len=args.max_seq_len)
    fmt = data_format(corpus_files(data)[0], chat)
    print(f"prepare: {fmt} data ({'detected from the first record' if args.format == 'auto' else '--format'})"
          + (f", loss on {args.loss_on}" if fmt == "chat" else ""), flush=True)
    out = prepare_corpus(data, args.out, tokenizer_spec=args.tokenizer, text_key=args.text_key, workers=args.workers,
                         chat=chat, overwrite=args.overwrite)
    meta = open_prepared(out)[1]
    counts = meta.get("chat")
    left = "" if not counts else (
        f": {counts['conversations']:,} conversations, {counts['no_assistant']:,} without an assistant turn skipped, "
        f"{counts['dropped']:,} dropped and {counts['truncated']:,} truncated as longer than --max-seq-len")
    print(f"wrote {out} ({meta['num_tokens']:,} tokens){left}")
    return 0
