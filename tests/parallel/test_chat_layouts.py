"""Chat data under every layout: dp2, ZeRO-3 dp2, tp2 + sp, pp2 (with the document mask, and without it) and cp2 each
equal one process (the error model of `paratrain.error_model`), on micro-batches whose counted tokens differ fivefold
and more; a mixture of a chat and a text source, killed mid-epoch, resumes the same packed stream."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
from safetensors.torch import load_file

from chat_fixtures import model_dir, write_jsonl
from paratrain.cli import build_parser, main
from paratrain.commands.options import config_from_args
from paratrain.data.dataset import build_dataset
from paratrain.data.sampler import DataSampler
from paratrain.faults import FAULT_ENV
from paratrain.metrics import read_metrics
from paratrain.parallel.contract import IGNORE_INDEX
from paratrain.testing import run_on_ranks
from paratrain.error_model import FP32_ADAMW
from parallel_cases import assert_matches_reference

pytestmark = pytest.mark.multirank

SEQ, STEPS = 224, 3
TINY = ["--n-layers", "2", "--dim", "32", "--n-heads", "4", "--n-kv-heads", "2", "--ffn-dim", "64",
        "--seq-len", str(SEQ), "--global-batch", "4", "--micro-batch", "1", "--sample-tokens", "0", "--eval-every", "0",
        "--no-progress", "--precision", "fp32", "--steps", str(STEPS), "--lr", "1e-2", "--warmup-steps", "0"]


def _conversations(n: int, seed: int = 0) -> list[dict]:
    """Three in four nearly all prompt (a long question, a one-word answer), the fourth nearly all answer."""
    rng = np.random.default_rng(seed)
    words = ["sun", "moon", "star", "sky", "sea", "rain", "wind"]
    say = lambda k: " ".join(rng.choice(words, size=k))  # noqa: E731
    out = []
    for i in range(n):
        question, answer = (say(14), say(1)) if i % 4 else (say(1), say(14))
        out.append({"messages": [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]})
    return out


@pytest.fixture(scope="module")
def chat(tmp_path_factory):
    root = tmp_path_factory.mktemp("chat")
    return {"model": model_dir(root / "llama3", "llama3"), "data": write_jsonl(root / "chat.jsonl", _conversations(48))}


def _train(rank, world, argv):
    from paratrain.train import train

    train(config_from_args(build_parser().parse_args(argv)))


def _run(chat, out, world: int, *extra):
    argv = ["train", *TINY, "--data", str(chat["data"]), "--tokenizer", str(chat["model"]), "--out", str(out), *extra]
    if world == 1:
        assert main(argv) == 0
    else:
        run_on_ranks(_train, world, argv, timeout=300)
    return [r["loss"] for r in read_metrics(out / "metrics.jsonl")], load_file(out / "final" / "model.safetensors")


def test_the_first_steps_micro_batches_count_very_different_numbers_of_tokens(chat):
    train, _, _ = build_dataset(str(chat["data"]), str(chat["model"]), SEQ, progress=False)
    ids = DataSampler(len(train), 4, seed=0).next_batch()
    counted = [int((train.get_batch([i])[1] != IGNORE_INDEX).sum()) for i in ids]
    assert max(counted) >= 5 * min(counted) > 0, counted


_REFERENCE: dict[tuple[str, ...], tuple] = {}


@pytest.mark.parametrize("layout, extra", [("dp2", []), ("zero3_dp2", ["--zero", "3"]),
                                           ("tp2_sp", ["--tp", "2", "--sequence-parallel"]),
                                           ("pp2", ["--pp", "2"]), ("cp2", ["--cp", "2"]),
                                           ("pp2_1f1b_no_mask", ["--pp", "2", "--schedule", "1f1b",
                                                                 "--no-document-mask"])])
def test_each_layout_equals_one_process_on_chat_data(chat, tmp_path_factory, tmp_path, layout, extra):
    masked = tuple(e for e in extra if e == "--no-document-mask")
    if masked not in _REFERENCE:  # one process's run, with the document mask and without: each trained once
        _REFERENCE[masked] = _run(chat, tmp_path_factory.mktemp("one"), 1, *masked)
    ref_losses, ref_params = _REFERENCE[masked]
    losses, params = _run(chat, tmp_path / layout, 2, *extra)
    assert_matches_reference(losses, params, ref_losses, ref_params, FP32_ADAMW, what=layout)


def test_a_killed_mixture_of_chat_and_text_resumes_the_same_packed_stream(chat, tmp_path):
    """Rank 1 SIGKILLed in step 5 of 6: the restart resumes from step 4's checkpoint, mid-epoch of the chat
    source, and every step's loss, counted tokens and tokens by source are those of one process straight
    through."""
    text = tmp_path / "text.txt"
    text.write_text(" ".join(np.random.default_rng(1).choice(["alpha", "beta", "gamma"], size=6000)))
    mixture = f"0.5:{chat['data']},0.5:{text}"
    argv = ["train", *TINY[:-6], "--steps", "6", "--lr", "1e-2", "--warmup-steps", "0", "--data", mixture,
            "--tokenizer", str(chat["model"])]
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    assert main([*argv, "--out", str(whole)]) == 0
    env = {**os.environ, FAULT_ENV: "sigkill@rank1:step5"}
    result = subprocess.run([sys.executable, "-m", "paratrain", *argv, "--out", str(killed), "--checkpoint-every",
                             "4", "--nproc", "2", "--max-restarts", "1"], capture_output=True, text=True, env=env,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "resumed from" in result.stdout + result.stderr
    a, b = read_metrics(whole / "metrics.jsonl"), read_metrics(killed / "metrics.jsonl")
    assert [r["step"] for r in b] == list(range(1, 7))
    train, _, _ = build_dataset(str(chat["data"]), str(chat["model"]), SEQ, progress=False)
    assert 4 * 4 * 0.5 % len(train) != 0  # the checkpoint lies inside an epoch of the chat source
    assert [r["tokens_by_source"] for r in a] == [r["tokens_by_source"] for r in b]
    assert all(sum(r["tokens_by_source"].values()) == r["tokens"] for r in a)  # the chat source's: its targets
    assert all(r["tokens_by_source"][chat["data"].stem] < 2 * SEQ for r in a)  # two samples, their answers alone
    assert [r["tokens"] for r in a] == [r["tokens"] for r in b]
    assert [r["loss"] for r in b] == pytest.approx([r["loss"] for r in a], rel=1e-5)
