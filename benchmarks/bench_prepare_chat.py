"""`paratrain prepare` on chat data: tokens/s and peak memory, and what the loss mask costs.

    python benchmarks/bench_prepare_chat.py                          # 100,000 conversations, 2 rounds
    python benchmarks/bench_prepare_chat.py --conversations 20000 --rounds 1

The corpus is JSON Lines of generated conversations (OpenAI `messages`: a system prompt in one of three, one to
three user/assistant turns of words drawn from the standard library's sources). The tokenizer is a byte-level
BPE trained here on those sources, with ChatML's special tokens, in a model directory whose template is Qwen's
ChatML; each row prepares the corpus in a fresh process (`prepare_corpus`, workers 0) and reports wall seconds,
tokens/s and the process's peak resident memory (VmHWM), median over --rounds (each round runs every row once, so
a load that drifts weighs on the rows alike):

- `all`: every token a target (--loss-on all): the render and the tokenization, no mask to find;
- `assistant, {% generation %}`: the template marks the assistant turns, the mask comes with the one render;
- `assistant, prefixes`: the template does not mark them (Qwen's as published), each assistant turn's span is
  found by rendering the conversation's prefixes (two more renders per assistant turn).

The mask's cost is 1 − (`all`'s seconds) / (the row's seconds): by the median wall time, by the fastest round's,
and by the median CPU time of the preparing process (all its threads), which the other work on shared cores
leaves alone where it moves wall time by more than the effect. Writes benchmarks/results/prepare-chat-<time>.md
and .json with the machine and its load.
"""

from __future__ import annotations

import json
import os
import random
import statistics
import sys
import tempfile
from pathlib import Path

from bench_prepare import parser_and_meta, run_fresh
from common import machine_sentence, write_results

_RUN = """
import json, re, sys, time
from paratrain.data import prepare_corpus
from paratrain.data.chat import ChatOptions
from paratrain.data.prepare import open_prepared
start, cpu = time.perf_counter(), time.process_time()
out = prepare_corpus(sys.argv[1], sys.argv[2], sys.argv[3], progress=False, chat=ChatOptions(loss_on=sys.argv[4]))
seconds, cpu = time.perf_counter() - start, time.process_time() - cpu  # cpu: every thread's, the tokenizer's too
meta = open_prepared(out)[1]
peak = int(re.search(r"VmHWM:\\s+(\\d+) kB", open("/proc/self/status").read())[1]) * 1024
print(json.dumps({"seconds": seconds, "cpu_seconds": cpu, "tokens": meta["num_tokens"],
                  "conversations": meta["num_documents"], "peak_rss": peak}))
"""

CHATML = (
    "{%- for message in messages %}"
    "{%- if loop.first and message.role != 'system' %}{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{%- endif %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
CHATML_MARKED = (
    "{%- for message in messages %}"
    "{%- if loop.first and message.role != 'system' %}{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{%- endif %}"
    "{%- if message.role == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' }}{% generation %}{{ message.content + '<|im_end|>' }}{% endgeneration %}{{- '\\n' }}"
    "{%- else %}{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def make_corpus(path: Path, count: int, seed: int = 0) -> int:
    """`count` conversations as JSON Lines; returns the file's bytes."""
    from paratrain.data.corpus import default_corpus_files

    words = []
    for f in default_corpus_files()[:200]:
        words += f.read_text(errors="replace").split()[:500]
    rng = random.Random(seed)
    say = lambda n: " ".join(rng.choices(words, k=n))  # noqa: E731
    with open(path, "w") as out:
        for i in range(count):
            messages = [{"role": "system", "content": say(8)}] if i % 3 == 0 else []
            for _ in range(rng.randint(1, 3)):
                messages += [{"role": "user", "content": say(rng.randint(5, 40))},
                             {"role": "assistant", "content": say(rng.randint(10, 80))}]
            out.write(json.dumps({"messages": messages}) + "\n")
    return path.stat().st_size


def model_dirs(work: Path, vocab: int) -> dict[str, Path]:
    """Two model directories sharing one tokenizer: the ChatML template as published, and with its turns marked."""
    from tokenizers import AddedToken

    from paratrain.data.corpus import default_corpus_files, iter_texts
    from paratrain.data.tokenizer import BPETokenizer

    tokenizer = BPETokenizer.train(iter_texts(default_corpus_files()[:400]), vocab).backend
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                  for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")])
    dirs = {}
    for name, template in (("prefixes", CHATML), ("generation", CHATML_MARKED)):
        directory = work / name
        directory.mkdir()
        tokenizer.save(str(directory / "tokenizer.json"))
        (directory / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>",
                                                                     "chat_template": template}))
        dirs[name] = directory
    return dirs


def main(argv: list[str] | None = None) -> int:
    args, now, meta = parser_and_meta(__doc__, argv, [
        ("--conversations", int, 100_000, "conversations in the corpus"),
        ("--bpe-vocab", int, 8192, "vocabulary of the BPE tokenizer")])
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        meta["corpus_bytes"] = make_corpus(work / "chat.jsonl", args.conversations)
        dirs = model_dirs(work, args.bpe_vocab)
        specs = (("all", dirs["prefixes"], "all"), ("assistant, {% generation %}", dirs["generation"], "assistant"),
                 ("assistant, prefixes", dirs["prefixes"], "assistant"))
        # Round by round, every row once per round: a load that drifts over the minutes weighs on each row alike.
        runs = {name: [] for name, _, _ in specs}
        for round_ in range(args.rounds):
            for name, model, loss_on in specs[round_ % 3:] + specs[:round_ % 3]:  # each row first in some round
                runs[name].append(run_fresh(_RUN, work, work / "chat.jsonl", model, loss_on))
                print(f"{name:>28}: {runs[name][-1]['tokens'] / runs[name][-1]['seconds']:,.0f} tokens/s", flush=True)
        for name, done in runs.items():
            seconds = statistics.median(r["seconds"] for r in done)
            rows.append({"row": name, "tokens": done[0]["tokens"], "conversations": done[0]["conversations"],
                         "seconds": [r["seconds"] for r in done], "median_s": seconds,
                         "cpu_seconds": [r["cpu_seconds"] for r in done],
                         "median_cpu_s": statistics.median(r["cpu_seconds"] for r in done),
                         "tokens_per_s": done[0]["tokens"] / seconds,
                         "peak_rss_mb": max(r["peak_rss"] for r in done) / 2**20})
    base = rows[0]
    for r in rows:
        r["mask_cost"] = 1 - r["tokens_per_s"] / base["tokens_per_s"]
        r["mask_cost_fastest"] = 1 - min(base["seconds"]) / min(r["seconds"])
        r["mask_cost_cpu"] = 1 - base["median_cpu_s"] / r["median_cpu_s"]
    meta["load_avg_end"] = os.getloadavg()
    lines = [f"# paratrain prepare on chat data, {meta['date']}", "",
             machine_sentence(meta) + f" (the "
             f"cores are shared with other work: the spread of the rounds is shown). Corpus: "
             f"{args.conversations:,} generated conversations, {meta['corpus_bytes'] / 2**20:.0f} MB of JSON Lines; "
             f"BPE of {args.bpe_vocab} tokens; median of {args.rounds} round(s), workers 0. The mask's cost, "
             f"1 − `all`'s time / the row's: by the median wall time, by the fastest round's, and by the median CPU "
             f"time (every thread of the process: what other work on the cores does not change).", "",
             "| loss on | conversations | tokens | s (each round) | tokens/s | CPU s (each round) | the mask's cost: "
             "median, fastest, CPU | peak RSS MB |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    lines += [f"| {r['row']} | {r['conversations']:,} | {r['tokens']:,} | "
              f"{', '.join(f'{s:.1f}' for s in r['seconds'])} | {r['tokens_per_s']:,.0f} | "
              f"{', '.join(f'{s:.1f}' for s in r['cpu_seconds'])} | {r['mask_cost']:+.1%}, "
              f"{r['mask_cost_fastest']:+.1%}, {r['mask_cost_cpu']:+.1%} | {r['peak_rss_mb']:.0f} |" for r in rows]
    text = "\n".join(lines) + "\n"
    print(text)
    write_results(args.out, "prepare-chat", now, text, {"meta": meta, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
