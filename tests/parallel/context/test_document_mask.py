"""--document-mask: attention within each document of a packed sequence, positions restarting per document.

Equal to running each document as its own sequence (fp32), in the model and through the trainer on
one process, under tensor + sequence parallelism, pipeline parallelism and context parallelism (the ring
masks each rank's queries against the whole sequence's keys, documents crossing the chunks' bounds).
"""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from paratrain.cli import build_parser, main
from paratrain.commands.options import config_from_args
from paratrain.metrics import read_metrics
from paratrain.models import ModelConfig, Transformer
from paratrain.models.llama import document_layout
from paratrain.testing import run_on_ranks

EOS = 1
CFG = ModelConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, max_seq_len=64)


def test_positions_and_mask_follow_the_documents():
    tokens = torch.tensor([[5, 6, EOS, 7, EOS, 8, 9, 10]])
    positions, mask = document_layout(tokens, EOS)
    assert positions.tolist() == [[0, 1, 2, 0, 1, 0, 1, 2]]
    assert mask.shape == (1, 1, 8, 8)
    assert mask[0, 0, 4].tolist() == [False, False, False, True, True, False, False, False]  # the 2nd document's end
    assert mask[0, 0, 7].tolist() == [False] * 5 + [True] * 3


def test_a_packed_sequence_equals_its_documents_run_alone():
    torch.manual_seed(0)
    masked = Transformer(dataclasses.replace(CFG, document_eos=EOS))
    alone = Transformer(CFG)
    alone.load_state_dict(masked.state_dict())
    docs = [torch.randint(2, 64, (n,)) for n in (5, 9, 7, 11)]
    segments = [torch.cat((d, torch.tensor([EOS]))) for d in docs]
    packed = torch.stack([torch.cat(segments), torch.cat(segments[::-1])])  # two rows, documents in other places
    weights = torch.randn(*packed.shape, CFG.vocab_size)
    logits = masked(packed)
    (logits * weights).sum().backward()
    expected, start = [], 0
    for row, order in enumerate((segments, segments[::-1])):
        start = 0
        for segment in order:
            out = alone(segment[None])[0]
            (out * weights[row, start:start + len(segment)]).sum().backward()
            expected.append((row, start, out))
            start += len(segment)
    for row, start, out in expected:
        got = logits[row, start:start + len(out)]
        assert ((got - out).abs().max() / out.abs().max()).item() <= 1e-5
    for (name, a), b in zip(masked.named_parameters(), alone.parameters()):
        assert ((a.grad - b.grad).abs().max() / b.grad.abs().max()).item() <= 1e-5, name


TINY = ["--n-layers", "2", "--dim", "32", "--n-heads", "4", "--n-kv-heads", "2", "--ffn-dim", "64",
        "--seq-len", "64", "--global-batch", "4", "--micro-batch", "2", "--sample-tokens", "0",
        "--eval-every", "0", "--no-progress", "--steps", "3", "--document-mask"]


@pytest.fixture(scope="module")
def documents(tmp_path_factory):
    """Short JSON Lines documents: several in every sequence of 64 bytes."""
    path = tmp_path_factory.mktemp("docs") / "docs.jsonl"
    rng = random.Random(0)
    path.write_text("".join('{"text": "%s"}\n' % " ".join(rng.choice(["ab", "cd", "efg"]) for _ in range(rng.randint(2, 9)))
                            for _ in range(600)))
    return path


def _train(rank, world, argv):
    from paratrain.train import train

    train(config_from_args(build_parser().parse_args(argv)))


@pytest.mark.parametrize("layout", [["--tp", "2", "--sequence-parallel"], ["--pp", "2"], ["--cp", "2"]],
                         ids=["tp2_sp", "pp2", "cp2"])
def test_the_trainer_masks_documents_alike_on_one_process_and_under_a_layout(documents, tmp_path, layout):
    """Under pp2 the later stage masks by the micro-batch's token ids, which every pipeline rank holds; under cp2
    each rank masks its chunks' queries by the whole sequences' token ids, which every cp rank holds."""
    one, tp = tmp_path / "one", tmp_path / "layout"
    assert main(["train", *TINY, "--data", str(documents), "--out", str(one)]) == 0
    run_on_ranks(_train, 2, ["train", *TINY, "--data", str(documents), "--out", str(tp), *layout], timeout=120)
    plain = tmp_path / "plain"
    assert main(["train", *TINY[:-1], "--data", str(documents), "--out", str(plain)]) == 0
    a, b, c = (read_metrics(out / "metrics.jsonl") for out in (one, tp, plain))
    assert [r["loss"] for r in a] == pytest.approx([r["loss"] for r in b], rel=1e-5)
    assert a[0]["loss"] != pytest.approx(c[0]["loss"], rel=1e-6)  # the mask changes what the model computes
