"""`paratrain prepare` throughput: tokens/s and peak memory, byte and 32k BPE tokenizers, workers 0, 1 and 2.

    python benchmarks/bench_prepare.py                        # a 64 MB JSON Lines corpus, 2 rounds
    python benchmarks/bench_prepare.py --mb 16 --rounds 1     # quicker

The corpus is JSON Lines made from this Python's standard-library sources (one record per file, repeated up to
--mb megabytes). Each row prepares it in a fresh process (`prepare_corpus`) and reports wall seconds, tokens/s
and the process's peak resident memory (VmHWM, workers excluded: each holds a batch at a time), median over
--rounds; workers' speed-up is the 1-worker median over the row's (workers 1: one thread in the preparing
process; 2: two processes of one thread; 0: the preparing process with the tokenizer library's own threads). Peak memory at a quarter of the corpus is
measured too: streaming keeps it the same whatever the corpus's size. Writes benchmarks/results/prepare-<time>.md
and .json with the machine and its load.
"""

from __future__ import annotations

import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import doc_parser, machine, machine_sentence, write_results

_RUN = """
import json, re, sys, time
from paratrain.data import prepare_corpus
from paratrain.data.prepare import open_prepared
start = time.perf_counter()
out = prepare_corpus(sys.argv[1], sys.argv[2], sys.argv[3], progress=False, workers=int(sys.argv[4]))
seconds = time.perf_counter() - start
tokens = open_prepared(out)[1]["num_tokens"]
peak = int(re.search(r"VmHWM:\\s+(\\d+) kB", open("/proc/self/status").read())[1]) * 1024
print(json.dumps({"seconds": seconds, "tokens": tokens, "peak_rss": peak}))
"""


def make_corpus(path: Path, megabytes: float) -> int:
    """JSON Lines of the standard library's sources, repeated to `megabytes`; returns its bytes."""
    from paratrain.data.corpus import default_corpus_files

    records = [json.dumps({"text": f.read_text(errors="replace"), "path": str(f)}) + "\n"
               for f in default_corpus_files()]
    written, target = 0, int(megabytes * 2**20)
    with open(path, "w") as out:
        while written < target:
            for line in records:
                out.write(line)
                written += len(line.encode())
                if written >= target:
                    break
    return written


def bpe_tokenizer(directory: Path, vocab: int) -> str:
    from paratrain.data.corpus import default_corpus_files, iter_texts
    from paratrain.data.tokenizer import BPETokenizer

    return str(BPETokenizer.train(iter_texts(default_corpus_files()[:400]), vocab).save(directory))


def run(corpus: Path, tokenizer: str, workers: int, work: Path) -> dict:
    return run_fresh(_RUN, work, corpus, tokenizer, workers)


def run_fresh(script: str, work: Path, corpus: Path, *more) -> dict:
    """`script` in a fresh interpreter, given the corpus, a new output directory under `work` and `more`; the JSON
    of its last line."""
    out = work / f"out-{time.monotonic_ns()}"
    result = subprocess.run([sys.executable, "-c", script, str(corpus), str(out), *map(str, more)],
                            capture_output=True, text=True, check=True)
    return json.loads(result.stdout.splitlines()[-1])


def parser_and_meta(doc: str, argv: list[str] | None, options: list[tuple]) -> tuple:
    """(args, now, meta) of a prepare benchmark: its own `options` ((flag, type, default, help) each), --rounds
    and --out; the date, the machine and its load at the start."""
    parser = doc_parser(doc)
    for flag, kind, default, text in options:
        parser.add_argument(flag, type=kind, default=default, help=text)
    parser.add_argument("--rounds", type=int, default=2, help="runs of each row (the median is reported)")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"), help="results directory")
    args = parser.parse_args(argv)
    now = datetime.datetime.now()
    return args, now, {"date": now.isoformat(timespec="seconds"), "machine": machine(),
                       "load_avg_start": os.getloadavg(), "args": vars(args)}


def main(argv: list[str] | None = None) -> int:
    args, now, meta = parser_and_meta(__doc__, argv, [("--mb", float, 64, "corpus size in MB"),
                                                      ("--bpe-vocab", int, 32000, "vocabulary of the BPE tokenizer")])
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        meta["corpus_bytes"] = make_corpus(work / "corpus.jsonl", args.mb)
        meta["quarter_bytes"] = make_corpus(work / "quarter.jsonl", args.mb / 4)
        tokenizers = {"byte": "byte", f"bpe {args.bpe_vocab}": bpe_tokenizer(work, args.bpe_vocab)}
        for name, spec in tokenizers.items():
            for workers in (0, 1, 2):
                runs = [run(work / "corpus.jsonl", spec, workers, work) for _ in range(args.rounds)]
                quarter = run(work / "quarter.jsonl", spec, workers, work)
                seconds = statistics.median(r["seconds"] for r in runs)
                rows.append({"tokenizer": name, "workers": workers, "tokens": runs[0]["tokens"],
                             "seconds": [r["seconds"] for r in runs], "median_s": seconds,
                             "tokens_per_s": runs[0]["tokens"] / seconds,
                             "mb_per_s": meta["corpus_bytes"] / 2**20 / seconds,
                             "peak_rss_mb": max(r["peak_rss"] for r in runs) / 2**20,
                             "quarter_peak_rss_mb": quarter["peak_rss"] / 2**20})
                print(f"{name:>10} workers {workers}: {rows[-1]['tokens_per_s']:,.0f} tokens/s, "
                      f"peak {rows[-1]['peak_rss_mb']:.0f} MB", flush=True)
    for r in rows:
        one = next(o for o in rows if o["tokenizer"] == r["tokenizer"] and o["workers"] == 1)
        r["speedup"] = one["median_s"] / r["median_s"]
    meta["load_avg_end"] = os.getloadavg()
    lines = [f"# paratrain prepare, {meta['date']}", "",
             machine_sentence(meta) + f". Corpus: "
             f"{meta['corpus_bytes'] / 2**20:.0f} MB of JSON Lines (the standard library's sources); median of "
             f"{args.rounds} round(s).", "",
             "| tokenizer | workers | tokens | s (each round) | tokens/s | MB/s | speed-up | peak RSS MB | "
             "peak RSS MB at 1/4 of the corpus |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    lines += [f"| {r['tokenizer']} | {r['workers']} | {r['tokens']:,} | {', '.join(f'{s:.2f}' for s in r['seconds'])} | "
              f"{r['tokens_per_s']:,.0f} | {r['mb_per_s']:.1f} | {r['speedup']:.2f} | {r['peak_rss_mb']:.0f} | "
              f"{r['quarter_peak_rss_mb']:.0f} |" for r in rows]
    text = "\n".join(lines) + "\n"
    print(text)
    write_results(args.out, "prepare", now, text, {"meta": meta, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
