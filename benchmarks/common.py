"""What the benchmarks share: the model and its data, the measuring, the rounds, the report and its files.

    from common import MB, add_common_args, build_model, doc_parser, run_rounds, write_results

Every side-by-side benchmark (paratrain against PyTorch's own implementation) builds the same
reference model from the same seed (`build_model`, `model_config`), feeds every variant the same
global batches (`global_batch`), runs each pair in rounds whose order alternates (`run_rounds`,
`set_time_ratio`), counts memory by distinct storages (`storage_bytes`) and peak RSS
(`proc_status_kb`, `warm_process`), and writes a markdown report with a JSON twin
(`write_results`) headed by the machine and its load (`machine`, `run_meta`, `fmt_load`). Not a
benchmark itself: run on its own it only says what it holds.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import importlib.util
import json
import os
import platform
import re
import statistics
import sys

MB = 2**20


# ---------------------------------------------------------------- the model, its data, its state
def build_model(cfg: ModelConfig, seed: int) -> Transformer:
    """Meta construction, then materialize and initialize: identical values for every variant."""
    import torch

    from paratrain.models import Transformer

    with torch.device("meta"):
        model = Transformer(cfg)
    model.to_empty(device="cpu")
    model.init_weights(seed)
    return model


def model_config(args) -> ModelConfig:
    from paratrain.models import ModelConfig

    return ModelConfig(vocab_size=args.vocab, dim=args.dim, n_layers=args.layers, n_heads=args.heads,
                       n_kv_heads=args.kv_heads, ffn_dim=args.ffn, max_seq_len=args.seq)


def global_batch(step: int, world: int, args) -> tuple[torch.Tensor, torch.Tensor]:
    """Step `step`'s global batch (micro_batch × world rows), the same for every variant."""
    import torch

    g = torch.Generator().manual_seed(args.seed * 100003 + step)
    shape = (args.micro_batch * world, args.seq)
    return torch.randint(0, args.vocab, shape, generator=g), torch.randint(0, args.vocab, shape, generator=g)


def adamw_factory(args):
    import torch

    return functools.partial(torch.optim.AdamW, lr=args.lr, weight_decay=args.weight_decay)


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind `tensors` (DTensors: their local shard); views count once."""
    import torch

    seen: dict[int, int] = {}
    for t in tensors:
        if t is None or not torch.is_tensor(t):
            continue
        t = t.to_local() if hasattr(t, "to_local") else t
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def optimizer_tensors(opt) -> list[torch.Tensor]:
    """Optimizer state tensors (Adam's moments), not the scalar step counters."""
    import torch

    return [v for s in opt.state.values() for v in s.values() if torch.is_tensor(v) and v.dim() > 0]


# ---------------------------------------------------------------- peak memory of a rank
def proc_status_kb(field: str) -> int:
    """A `VmXXX:` line of /proc/self/status, in kB."""
    with open("/proc/self/status") as f:
        return int(re.search(rf"^{field}:\s+(\d+)", f.read(), re.M).group(1))


def warm_process(args) -> None:
    """Fault in the code and allocator pages every variant needs, so the RSS peak measures data.

    Ranks fork from a forkserver that imported torch but never ran it: the first
    forward/backward/step pages in tens of MB of libtorch code, which would otherwise
    dominate the peak of a small model. A tiny model runs one step before the peak is reset.
    """
    import torch
    import torch.nn.functional as F

    from paratrain.models import ModelConfig

    if importlib.util.find_spec("paratrain.parallel.data.zero3") is not None:
        importlib.import_module("paratrain.parallel.data.zero3")
    tiny = build_model(ModelConfig(vocab_size=args.vocab, dim=32, n_layers=1, n_heads=2, n_kv_heads=2, ffn_dim=32,
                                   max_seq_len=args.seq), 0)
    opt = torch.optim.AdamW(tiny.parameters())
    x = torch.randint(0, args.vocab, (1, args.seq))
    F.cross_entropy(tiny(x).flatten(0, 1), x.flatten()).backward()
    opt.step()


# ---------------------------------------------------------------- rounds and ratios
def run_rounds(specs: list, rounds: int, run) -> list[dict]:
    """`run(spec)` for every spec, `rounds` times, the order reversed every other round; one row per spec."""
    runs: dict[int, list[dict]] = {i: [] for i in range(len(specs))}
    for round_ in range(rounds):
        order = range(len(specs)) if round_ % 2 == 0 else reversed(range(len(specs)))
        for i in order:
            runs[i].append(run(specs[i]))
    return [merge_rounds(runs[i]) for i in range(len(specs))]


def merge_rounds(runs: list[dict]) -> dict:
    """One row from a variant's rounds: step time the median of the rounds' medians, every step's time
    kept; bytes, memory and losses from the first round."""
    failed = [r for r in runs if "error" in r]
    if failed:
        return failed[0]
    row = dict(runs[0])
    row["round_step_s"] = [r["step_s"] for r in runs]
    row["step_s"] = statistics.median(row["round_step_s"])
    row["step_times_s"] = [t for r in runs for t in r["step_times_s"]]
    row["tokens_per_s"] = runs[0]["tokens_per_s"] * runs[0]["step_s"] / row["step_s"]
    return row


def set_time_ratio(row: dict, ref: dict) -> None:
    """`row`'s time ratio to `ref`: the median of the rounds' ratios, each between the two sides of one round."""
    pairs = zip(row.get("round_step_s", [row["step_s"]]), ref.get("round_step_s", [ref["step_s"]]))
    row["round_time_ratios"] = [mine / theirs for mine, theirs in pairs]
    row["time_ratio"] = statistics.median(row["round_time_ratios"])


def failed_row(row: dict, exc: Exception) -> dict:
    """A row whose launch failed: the failure's last error line as its reason (a rank's traceback ends in it)."""
    lines = str(exc).splitlines() or [type(exc).__name__]
    reason = next((line for line in reversed(lines) if "Error" in line), lines[0])
    return {**row, "error": reason.strip()[:300], "detail": str(exc)[-4000:]}


# ---------------------------------------------------------------- the report
def fmt_load(load) -> str:
    return "/".join(f"{x:.1f}" for x in load)


def machine_sentence(meta: dict) -> str:
    """The results' first sentence: the machine, torch and Python, and the load average at the run's start and end."""
    m = meta["machine"]
    return (f"{m['cpu_model']}, {m['cpu_count']} cores, torch {m['torch']}, Python {m['python']}; load average "
            f"{fmt_load(meta['load_avg_start'])} at the start, {fmt_load(meta['load_avg_end'])} at the end")


def fmt(value, spec: str) -> str:
    return "—" if value is None else format(value, spec)


def fmt_spread(row: dict, spec: str = ".1f") -> str:
    """A row's median step in ms and, in brackets, its fastest and slowest: "412.3 (398–455)"."""
    times = row["step_times_s"]
    return f"{row['step_s'] * 1e3:{spec}} ({min(times) * 1e3:.0f}–{max(times) * 1e3:.0f})"


def ratio_cell(row: dict) -> str:
    """The time ratio; with several rounds, bold median then each round's ratio."""
    rounds = row.get("round_time_ratios", [])
    if len(rounds) < 2:
        return fmt(row.get("time_ratio"), ".2f")
    return f"**{row['time_ratio']:.2f}** ({' / '.join(f'{x:.2f}' for x in rounds)})"


def rss_start_note(starts_mb: list[float], hwm_reset: bool, setup: str) -> list[str]:
    """The results' footnote on where peak-RSS measurement started (shared by the benchmarks)."""
    return ["", f"RSS of a rank when measuring starts ({setup}): {min(starts_mb):.0f}–{max(starts_mb):.0f} MB; "
                f"VmHWM reset to it through /proc/self/clear_refs: {hwm_reset}."]


def failure_notes(rows: list[dict], label) -> list[str]:
    """The last lines of each failed row's error, under `label(row)`."""
    lines = []
    for r in rows:
        if "detail" in r:
            tail = "\n".join(r["detail"].rstrip().splitlines()[-8:])
            lines += ["", f"**{label(r)} failed:**", "```", tail, "```"]
    return lines


def machine() -> dict:
    import torch

    cpu = "unknown"
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        found = re.search(r"^model name\s*:\s*(.+)$", f.read(), re.M)
        cpu = found.group(1).strip() if found else cpu
    return {"platform": platform.platform(), "cpu_count": os.cpu_count(), "cpu_model": cpu,
            "torch": torch.__version__, "python": platform.python_version()}


def run_meta(args, now: datetime.datetime) -> dict:
    """Date, machine, command, model and run settings of one benchmark invocation (load average at start)."""
    cfg = model_config(args)
    return {"date": now.isoformat(timespec="seconds"), **machine(),
            "command": " ".join([os.path.basename(sys.executable)] + sys.argv), "model": repr(cfg),
            "params": cfg.num_params(), **{k: getattr(args, k) for k in
                                           ("micro_batch", "seq", "lr", "clip", "warmup", "steps", "seed")},
            "rounds": getattr(args, "rounds", 1), "load_avg_start": os.getloadavg()}


def train_in_process(argv: list[str], out, what: str) -> tuple[list[dict], float]:
    """`paratrain train` (`argv`, whose --out is `out`) in this process, its output kept and shown only if it fails:
    the run's metrics records and wall seconds; its directory removed (its checkpoints are not needed)."""
    import io
    import shutil
    import time

    from paratrain.cli import main as paratrain_main
    from paratrain.metrics import read_metrics

    captured = io.StringIO()
    start = time.perf_counter()
    with contextlib.redirect_stdout(captured), contextlib.redirect_stderr(captured):
        code = paratrain_main(argv)
    seconds = time.perf_counter() - start
    if code != 0:
        raise RuntimeError(f"{what} exited {code}:\n{captured.getvalue()[-3000:]}")
    records = read_metrics(os.path.join(out, "metrics.jsonl"))
    shutil.rmtree(out)
    return records, seconds


def write_results(out: str, prefix: str, now: datetime.datetime, text: str, payload: dict) -> None:
    """Write `<out>/<prefix>-<time>.md` (the markdown report) and `.json` (everything)."""
    os.makedirs(out, exist_ok=True)
    stem = os.path.join(out, f"{prefix}-{now:%Y%m%d-%H%M%S}")
    with open(stem + ".md", "w") as f:
        f.write(text)
    with open(stem + ".json", "w") as f:
        json.dump(payload, f, indent=1)
    print(f"wrote {stem}.md and {stem}.json", file=sys.stderr)


# ---------------------------------------------------------------- the command line
def doc_parser(doc: str) -> argparse.ArgumentParser:
    """A parser whose help is a script's docstring: its first paragraph, the options (with their
    defaults), then the rest after the examples."""
    class Formatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
        pass

    intro, _examples, rest = doc.split("\n\n", 2)
    return argparse.ArgumentParser(description=intro, epilog=rest, formatter_class=Formatter)


def add_common_args(p: argparse.ArgumentParser, micro_batch_default: int, micro_batch_help: str) -> None:
    """The options every benchmark shares: run length, model shape, data, optimizer, seed, timeout."""
    p.add_argument("--steps", type=int, default=10, help="measured optimizer steps")
    p.add_argument("--warmup", type=int, default=2, help="steps run first and excluded from timing and comm")
    p.add_argument("--dim", type=int, default=256, help="model width")
    p.add_argument("--layers", type=int, default=4, help="transformer blocks")
    p.add_argument("--heads", type=int, default=8, help="query heads")
    p.add_argument("--kv-heads", type=int, default=4, help="key/value heads (GQA)")
    p.add_argument("--ffn", type=int, default=688, help="SwiGLU hidden width")
    p.add_argument("--vocab", type=int, default=512, help="vocabulary size")
    p.add_argument("--seq", type=int, default=128, help="sequence length")
    p.add_argument("--micro-batch", type=int, default=micro_batch_default, help=micro_batch_help)
    p.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate")
    p.add_argument("--weight-decay", type=float, default=0.1, help="AdamW weight decay")
    p.add_argument("--clip", type=float, default=1.0, help="global gradient-norm clipping (0: off)")
    p.add_argument("--seed", type=int, default=0, help="init and data seed")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds allowed per launch")


if __name__ == "__main__":
    doc_parser(__doc__).parse_args()
