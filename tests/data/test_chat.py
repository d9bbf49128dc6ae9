"""Chat data: records rendered by the model's chat template, the loss on the assistant turns only, packed
conversations that see only themselves, and the lines that refuse bad input.

The model directories are built here (`chat_fixtures`: one byte per token, so an expected target is its text).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from chat_fixtures import CHATML_GENERATION, model_dir, write_jsonl
from paratrain.cli import main
from paratrain.data.chat import ChatOptions
from paratrain.data.dataset import PackedDataset, TokenStream, build_dataset
from paratrain.data.prepare import open_documents, open_mask, open_prepared, prepare_corpus
from paratrain.errors import DataError
from paratrain.metrics import read_metrics
from paratrain.models import ModelConfig, Transformer
from paratrain.parallel.contract import IGNORE_INDEX

RECORDS = [
    {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Capital of France?"},
                  {"role": "assistant", "content": "Paris."}, {"role": "user", "content": "And Spain?"},
                  {"role": "assistant", "content": "Madrid."}]},
    {"conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello! How can I help?"}]},
    {"prompt": "2+2=", "completion": "4"},
    {"messages": [{"role": "user", "content": "Anyone there?"}]},  # no assistant turn: skipped and counted
    {"messages": [{"role": "user", "content": "Another?"}, {"role": "assistant", "content": " Lyon. "}]},
]
# What each kept record trains on, by hand: every run of consecutive target tokens, as text.
EXPECTED = {
    "chatml": [["Paris.<|im_end|>", "Madrid.<|im_end|>"], ["Hello! How can I help?<|im_end|>"], ["4<|im_end|>"],
               [" Lyon. <|im_end|>"]],
    # Llama 3's template trims each message: the learned text is what the template renders
    "llama3": [["Paris.<|eot_id|>", "Madrid.<|eot_id|>"], ["Hello! How can I help?<|eot_id|>"], ["4<|eot_id|>"],
               ["Lyon.<|eot_id|>"]],
}


def _documents(out: Path):
    """[(tokens, mask)] of each conversation of a prepared directory, read from its files."""
    tokens, meta, tokenizer = open_prepared(out)
    mask, starts = open_mask(out, meta), open_documents(out, meta)
    return [(np.asarray(tokens[a:b]), np.asarray(mask[a:b])) for a, b in zip(starts[:-1], starts[1:])], tokenizer, meta


def _runs(tokens, mask, tokenizer) -> list[str]:
    """The text of each run of consecutive target tokens."""
    runs, current = [], []
    for token, target in zip(tokens.tolist(), mask.tolist()):
        if target:
            current.append(token)
        elif current:
            runs.append(current)
            current = []
    runs += [current] if current else []
    return [tokenizer.backend.decode(r, skip_special_tokens=False) for r in runs]


@pytest.mark.parametrize("family", ["chatml", "llama3"])
def test_the_mask_covers_exactly_the_assistant_contents_and_each_end_of_turn(tmp_path, family):
    model = model_dir(tmp_path / family, family)
    data = write_jsonl(tmp_path / "chat.jsonl", RECORDS)
    out = prepare_corpus(data, tmp_path / "out", str(model), progress=False)
    documents, tokenizer, meta = _documents(out)
    assert meta["version"] == 3 and meta["data_format"] == "chat" and meta["chat"]["no_assistant"] == 1
    assert [_runs(t, m, tokenizer) for t, m in documents] == EXPECTED[family]
    for tokens, mask in documents:  # each conversation closed by end-of-text, which is not learned
        assert tokens[-1] == tokenizer.eos_id and mask[-1] == 0 and mask[0] == 0


@pytest.mark.parametrize("family", ["chatml", "llama3"])
def test_every_prefix_renders_as_transformers_renders_it(tmp_path, family):
    """The prefixes the mask is found from, rendered in one pass over the conversation's template data, are
    transformers' `render_jinja_template`'s text for each prefix, with and without the generation prompt; a
    conversation that ends with a user turn after the answer keeps the answer's own end."""
    from transformers.utils.chat_template_utils import render_jinja_template

    from paratrain.data.chat import load_chat_template, target_spans

    template = load_chat_template(model_dir(tmp_path / family, family))
    trailing = {"messages": RECORDS[0]["messages"][:3] + [{"role": "user", "content": "Thanks."}]}
    for record in (RECORDS[0], trailing):
        messages = record["messages"]
        ends = [(k, prompt) for k in range(1, len(messages) + 1) for prompt in (False, True)]
        want = [render_jinja_template([messages[:k]], chat_template=template.text, add_generation_prompt=prompt,
                                      **template.special)[0][0] for k, prompt in ends]
        assert template.render_prefixes(messages, ends, "x") == want
    text, spans = target_spans(template, trailing, "x", "assistant")
    assert [text[a:b] for a, b in spans] == [EXPECTED[family][0][0]]


def test_the_sandbox_lookups_a_render_makes_answer_as_a_fresh_sandbox_does():
    """The renders' environment answers `obj.name` (plain data, loops, functions, types) as jinja2's
    ImmutableSandboxedEnvironment does: items of a dict that are no dict attributes, its methods otherwise, the
    unsafe ones (a mutating method, a dunder, a function's globals) refused, asked twice (the second answer
    remembered)."""
    from jinja2 import Undefined
    from jinja2.runtime import LoopContext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    from paratrain.data.chat import _renderer

    quick, fresh = _renderer("{{ messages }}").template.environment, ImmutableSandboxedEnvironment()

    def described(value):
        if isinstance(value, Undefined):
            return type(value).__name__, value._undefined_hint, value._undefined_name
        return (type(value).__name__, getattr(value, "__name__", None)) if callable(value) else value

    message = {"role": "user", "items": "shadowed", "content": "Hi {0}", "_hidden": 1}
    probes = [(message, name) for name in ("role", "items", "content", "missing", "_hidden", "get", "pop", "update",
                                          "__class__", "__init__")]
    probes += [(message["content"], name) for name in ("strip", "format", "format_map", "__class__", "nope")]
    probes += [(["a"], name) for name in ("append", "index", "__len__")] + [(3, "real"), (None, "x"), (True, "real")]
    probes += [(LoopContext(iter([1, 2]), Undefined), name) for name in ("first", "index0", "_after", "__class__")]
    probes += [(described, "__globals__"), (described, "__name__"), (dict, "mro"), (dict, "fromkeys")]
    assert quick.getattr is not fresh.getattr  # the quick lookups are installed
    for _ in range(2):
        for obj, name in probes:
            assert described(quick.getattr(obj, name)) == described(fresh.getattr(obj, name)), (obj, name)


def test_generation_marks_give_the_mask_in_one_render_and_loss_on_selects_the_turns(tmp_path):
    data = write_jsonl(tmp_path / "chat.jsonl", RECORDS[:1])
    marked = model_dir(tmp_path / "marked", "chatml", template=CHATML_GENERATION)
    documents, tokenizer, _ = _documents(prepare_corpus(data, tmp_path / "marked-out", str(marked), progress=False))
    assert _runs(*documents[0], tokenizer) == ["Paris.<|im_end|>", "Madrid.<|im_end|>"]
    from transformers.utils.chat_template_utils import render_jinja_template

    from paratrain.data.chat import load_chat_template

    template, messages = load_chat_template(marked), RECORDS[0]["messages"]
    text, spans = render_jinja_template([messages], chat_template=template.text, return_assistant_tokens_mask=True,
                                        **template.special)
    assert template.render(messages, "x", track=True) == (text[0], [tuple(s) for s in spans[0]])
    plain = model_dir(tmp_path / "plain", "chatml")
    last = prepare_corpus(data, tmp_path / "last", str(plain), progress=False, chat=ChatOptions(loss_on="completion"))
    assert _runs(*_documents(last)[0][0], tokenizer) == ["Madrid.<|im_end|>"]
    every = prepare_corpus(data, tmp_path / "all", str(plain), progress=False, chat=ChatOptions(loss_on="all"))
    (tokens, mask), = _documents(every)[0]
    assert mask[0] == 0 and mask[1:].all()  # every token but the first, which nothing precedes


@pytest.mark.parametrize("template", ["plain", "generation"])
def test_a_transformers_without_the_private_render_pieces_gives_the_same_masks(tmp_path, monkeypatch, template):
    """Rendering leans on transformers' private pieces for speed; a transformers that moved them renders through its
    public `render_jinja_template` and prepares the same tokens and masks."""
    from paratrain.data import chat

    def moved(text):  # what importing a private piece that transformers no longer has raises
        raise ImportError("cannot import name '_compile_jinja_template' from 'transformers.utils.chat_template_utils'")

    marks = {"template": CHATML_GENERATION} if template == "generation" else {}
    model = model_dir(tmp_path / "model", "chatml", **marks)
    data = write_jsonl(tmp_path / "chat.jsonl", RECORDS)
    fast = _documents(prepare_corpus(data, tmp_path / "fast", str(model), progress=False))[0]
    chat._renderer.cache_clear()
    monkeypatch.setattr(chat, "_Renderer", moved)
    try:
        assert isinstance(chat._renderer("{{ messages }}"), chat._PublicRenderer)
        public = _documents(prepare_corpus(data, tmp_path / "public", str(model), progress=False))[0]
    finally:
        chat._renderer.cache_clear()
    assert len(public) == len(fast) == len(RECORDS) - 1
    for (tokens, mask), (want_tokens, want_mask) in zip(public, fast):
        assert tokens.tolist() == want_tokens.tolist() and mask.tolist() == want_mask.tolist()


def test_text_directories_of_older_versions_read_with_every_token_a_target(tmp_path):
    text = tmp_path / "t.jsonl"
    text.write_text("".join(json.dumps({"text": f"document {i} " * 20}) + "\n" for i in range(20)))
    out = prepare_corpus(text, tmp_path / "t", "byte", progress=False)
    meta = json.loads((out / "meta.json").read_text())
    assert meta["mask_file"] is None
    meta = {k: v for k, v in meta.items() if k not in ("mask_file", "data_format")} | {"version": 2}
    (out / "meta.json").write_text(json.dumps(meta))
    train, _, _ = build_dataset(str(out), "auto", 16)
    assert open_mask(out, meta) is None and (train.get_batch(list(range(len(train))))[1] != IGNORE_INDEX).all()


def _packed(tmp_path, family="chatml", seq_len=96, records=None, **chat):
    model = model_dir(tmp_path / family, family)
    data = write_jsonl(tmp_path / "many.jsonl", records or _conversations(24))
    return build_dataset(str(data), str(model), seq_len, eval_fraction=0.1, progress=False,
                         chat=ChatOptions(**chat))


def _conversations(n: int, seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    words = ["sun", "moon", "star", "sky", "sea", "rain"]
    say = lambda k: " ".join(rng.choice(words, size=k))  # noqa: E731
    out = []
    for i in range(n):
        turns = [{"role": "system", "content": say(2)}] if i % 3 == 0 else []
        for _ in range(1 + i % 2):
            turns += [{"role": "user", "content": say(int(rng.integers(1, 6)))},
                      {"role": "assistant", "content": say(int(rng.integers(1, 4)))}]
        out.append({"messages": turns})
    return out


def test_packing_keeps_conversations_whole_and_counts_what_is_too_long(tmp_path):
    train, held, tokenizer = _packed(tmp_path, seq_len=96)
    documents = train.stream.documents
    assert len(held) >= 1 and train.conversations + held.conversations + train.dropped + held.dropped == 24
    covered = sorted((lo, hi) for lo, hi in train.bounds.tolist())
    starts = set(documents.tolist())
    for lo, hi in covered:  # each sample starts and ends at conversation boundaries and fits
        assert lo in starts and hi in starts and hi - lo <= 96 + 1
    short, short_held, _ = _packed(tmp_path / "short", seq_len=90, long="truncate")
    starts = set(short.stream.documents.tolist())
    cut = [(lo, hi) for lo, hi in short.bounds.tolist() if hi not in starts]  # a conversation's start alone
    assert short.truncated > 0 and len(cut) == short.truncated and all(hi - lo == 91 for lo, hi in cut)
    dropped, dropped_held, _ = _packed(tmp_path / "drop", seq_len=90)
    assert dropped.dropped + dropped_held.dropped == short.truncated + short_held.truncated
    assert dropped.conversations + dropped_held.conversations == 24 - dropped.dropped - dropped_held.dropped


def _alone_loss_and_grads(model, sample_tokens, sample_mask):
    """The token-loss sum of one conversation as its own sequence, its labels the targets of its mask."""
    x = torch.as_tensor(sample_tokens[:-1], dtype=torch.int64)[None]
    y = torch.where(torch.as_tensor(sample_mask[1:], dtype=torch.bool), torch.as_tensor(sample_tokens[1:],
                    dtype=torch.int64), IGNORE_INDEX)[None]
    logits = model(x)
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten(), ignore_index=IGNORE_INDEX,
                                             reduction="sum"), int((y != IGNORE_INDEX).sum())


def test_a_packed_batch_with_the_document_mask_equals_each_conversation_alone(tmp_path):
    train, _, tokenizer = _packed(tmp_path, seq_len=256)
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=tokenizer.vocab_size, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64,
                      max_seq_len=256)
    packed_model, alone = Transformer(ModelConfig(**{**cfg.__dict__, "document_eos": tokenizer.eos_id})), Transformer(cfg)
    alone.load_state_dict(packed_model.state_dict())
    rows = [i for i in range(len(train)) if len(_inside(train, i)) > 1][:3]
    assert len(rows) == 3  # samples of several conversations each
    inputs, labels = train.get_batch(rows)
    logits = packed_model(inputs)
    loss_sum = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX,
                                                 reduction="sum")
    count = int((labels != IGNORE_INDEX).sum())
    (loss_sum / count).backward()
    total, alone_count = 0.0, 0
    for row in rows:
        for a, b in _inside(train, row):
            part, n = _alone_loss_and_grads(alone, train.stream.tokens[a:b], train.stream.mask[a:b])
            (part / count).backward()
            total, alone_count = total + part.item(), alone_count + n
    assert alone_count == count
    assert abs(loss_sum.item() - total) / total <= 1e-5
    for (name, p), q in zip(packed_model.named_parameters(), alone.parameters()):
        assert ((p.grad - q.grad).norm() / q.grad.norm()).item() <= 1e-5, name


def _inside(dataset: PackedDataset, index: int) -> list[tuple[int, int]]:
    """The conversations of one packed sample, as token bounds."""
    lo, hi = dataset.bounds[index].tolist()
    starts = [s for s in dataset.stream.documents.tolist() if lo <= s <= hi]
    return list(zip(starts[:-1], starts[1:]))


TINY = ["--n-layers", "2", "--dim", "32", "--n-heads", "4", "--n-kv-heads", "2", "--ffn-dim", "64",
        "--sample-tokens", "0", "--eval-every", "0", "--no-progress", "--precision", "fp32"]


def test_the_steps_loss_is_cross_entropy_over_the_assistant_targets_only(tmp_path):
    """The trainer's first-step loss (before any update) against cross-entropy by hand: each sample's tokens and
    the stored mask read from the prepared files, the model built from the same seed."""
    from paratrain.data.sampler import DataSampler
    from paratrain.train import build_model

    model = model_dir(tmp_path / "llama3", "llama3")
    data = write_jsonl(tmp_path / "chat.jsonl", _conversations(40))
    prepared = prepare_corpus(data, tmp_path / "prepared", str(model), progress=False)
    run = tmp_path / "run"
    assert main(["train", *TINY, "--data", str(prepared), "--out", str(run), "--steps", "1", "--seq-len", "96",
                 "--global-batch", "4", "--micro-batch", "2"]) == 0
    logged = read_metrics(run / "metrics.jsonl")[0]
    cfg = ModelConfig(**json.loads((run / "final" / "model_config.json").read_text()))
    assert cfg.document_eos is not None  # on by default for chat data
    train, _, _ = build_dataset(str(prepared), "auto", 96, progress=False)
    tokens, meta, _ = open_prepared(prepared)
    mask = open_mask(prepared, meta)
    ids = DataSampler(len(train), 4, seed=0).next_batch()
    net = build_model(cfg, torch.device("cpu"), 0)
    nll, targets = _by_hand(net, tokens, mask, [train.bounds[i].tolist() for i in ids])
    assert logged["tokens"] == targets
    assert logged["loss"] == pytest.approx(nll / targets, rel=1e-6)


def _by_hand(net, tokens, mask, bounds) -> tuple[float, int]:
    """(summed negative log-likelihood, targets) of the samples `bounds` of a stream: each token whose mask is set,
    predicted from the tokens before it in its sample."""
    nll, targets = 0.0, 0
    with torch.no_grad():
        for lo, hi in bounds:
            x = torch.as_tensor(np.asarray(tokens[lo:hi - 1], dtype=np.int64))[None]
            log_probs = torch.log_softmax(net(x)[0].double(), dim=-1)
            for j in range(hi - lo - 1):
                if mask[lo + j + 1]:  # the next token is an assistant token or its end-of-turn
                    nll -= log_probs[j, int(tokens[lo + j + 1])].item()
                    targets += 1
    return nll, targets


def test_chat_eval_data_scores_the_answers_only(tmp_path):
    """--eval-data of chat data: its loss, logged at the last step, is the final model's cross-entropy over the
    held-out set's assistant targets alone, by hand."""
    from safetensors.torch import load_file

    from paratrain.data.dataset import load_token_stream, sequences

    model = model_dir(tmp_path / "qwen", "chatml")
    data = write_jsonl(tmp_path / "chat.jsonl", _conversations(40))
    held = write_jsonl(tmp_path / "held.jsonl", _conversations(12, seed=1))
    run = tmp_path / "run"
    assert main(["train", *TINY, "--data", str(data), "--tokenizer", str(model), "--out", str(run), "--steps", "2",
                 "--seq-len", "192", "--global-batch", "4", "--eval-data", f"held={held}", "--eval-batches", "1"]) == 0
    logged = read_metrics(run / "metrics.jsonl")[-1]["eval_losses"]["held"]
    cfg = ModelConfig(**json.loads((run / "final" / "model_config.json").read_text()))
    net = Transformer(cfg)
    net.load_state_dict(load_file(run / "final" / "model.safetensors"), strict=False)
    if cfg.tie_embeddings:
        net.output.weight = net.tok_embeddings.weight
    stream, _ = load_token_stream(str(held), str(model), progress=False)
    held_set = sequences(stream, 192)
    assert isinstance(held_set, PackedDataset)
    nll, targets = _by_hand(net, stream.tokens, stream.mask, held_set.bounds[:4].tolist())
    assert 0 < targets < (held_set.bounds[:4, 1] - held_set.bounds[:4, 0]).sum() / 2  # the answers are the lesser part
    assert logged == pytest.approx(nll / targets, rel=1e-5)


BAD = [
    ({"foo": 1}, "a chat record has 'messages', 'conversations' or 'prompt' and 'completion'"),
    ({"messages": [{"content": "hi"}]}, "messages message 1 has no 'role'"),
    ({"messages": [{"role": "user"}]}, "messages message 1 has no 'content'"),
    ({"messages": [{"role": "bot", "content": "x"}]}, "has role 'bot'; use one of system, user, assistant, tool"),
    ({"conversations": [{"from": "alien", "value": "x"}]}, "is from 'alien'"),
]


@pytest.mark.parametrize("record, message", BAD)
def test_a_bad_record_is_refused_in_one_line_with_its_file_and_line(tmp_path, capsys, record, message):
    model = model_dir(tmp_path / "qwen", "chatml")
    data = write_jsonl(tmp_path / "bad.jsonl", [RECORDS[0], record])
    assert main(["prepare", "--data", str(data), "--tokenizer", str(model), "--format", "chat", "--out",
                 str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"{data}:2: " in err and message in err


ALTERNATE = ("{% for m in messages %}{% if (m['role'] == 'assistant') != (loop.index0 % 2 == 1) %}"
             "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant') }}{% endif %}"
             "{{ m['role'] + ': ' + m['content'] + '\\n' }}{% endfor %}"
             "{% if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}")


def test_a_template_that_raises_is_refused_with_its_message_and_a_record_without_answers_is_counted(tmp_path, capsys):
    model = model_dir(tmp_path / "strict", "chatml", template=ALTERNATE)
    twice = {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                          {"role": "assistant", "content": "c"}]}
    data = write_jsonl(tmp_path / "chat.jsonl", [RECORDS[1], RECORDS[3], twice])
    assert main(["prepare", "--data", str(data), "--tokenizer", str(model), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"{data}:3: " in err
    assert "refused the conversation: Conversation roles must alternate" in err
    write_jsonl(data, [RECORDS[1], RECORDS[3]] + [RECORDS[2]] * 2)
    assert main(["prepare", "--data", str(data), "--tokenizer", str(model), "--out", str(tmp_path / "o")]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert out[0] == "prepare: chat data (detected from the first record), loss on assistant"
    assert "3 conversations, 1 without an assistant turn skipped" in out[-1]


def test_a_directory_without_a_template_is_refused_for_messages(tmp_path, capsys):
    model = model_dir(tmp_path / "bare", "chatml", template="")
    data = write_jsonl(tmp_path / "chat.jsonl", RECORDS[:1])
    assert main(["prepare", "--data", str(data), "--tokenizer", str(model), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "has no chat template" in err and "--chat-template FILE" in err


def test_a_template_that_reaches_outside_the_sandbox_is_refused_and_nothing_runs(tmp_path, capsys):
    marker = tmp_path / "escaped"
    escape = tmp_path / "escape.jinja"
    escape.write_text("{{ cycler.__init__.__globals__.os.system('touch " + str(marker) + "') }}"
                      "{% for m in messages %}{{ m['content'] }}{% endfor %}")
    model = model_dir(tmp_path / "qwen", "chatml")
    data = write_jsonl(tmp_path / "chat.jsonl", RECORDS[:1])
    assert main(["prepare", "--data", str(data), "--tokenizer", str(model), "--chat-template", str(escape),
                 "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "reaches outside jinja2's sandbox" in err and f"{data}:1: " in err
    assert not marker.exists() and not (tmp_path / "o").exists()


def test_prepare_cuts_or_drops_what_is_longer_than_max_seq_len_and_counts_it(tmp_path, capsys):
    model = model_dir(tmp_path / "qwen", "chatml")
    data = write_jsonl(tmp_path / "chat.jsonl", _conversations(30))
    for long in ("drop", "truncate"):
        assert main(["prepare", "--data", str(data), "--tokenizer", str(model), "--max-seq-len", "60", "--long", long,
                     "--out", str(tmp_path / long)]) == 0
    last = capsys.readouterr().out.strip().splitlines()
    dropped = json.loads((tmp_path / "drop" / "meta.json").read_text())["chat"]
    cut = json.loads((tmp_path / "truncate" / "meta.json").read_text())["chat"]
    assert dropped["dropped"] > 0 and dropped["dropped"] == cut["truncated"] + cut["no_assistant"]
    assert f"{dropped['dropped']} dropped" in last[1]
    documents, tokenizer, _ = _documents(tmp_path / "truncate")
    assert max(len(t) for t, _ in documents) == 61 and all(t[-1] == tokenizer.eos_id for t, _ in documents)


def test_a_token_stream_slice_keeps_its_mask_and_documents():
    stream = TokenStream(np.arange(10), mask=np.ones(10, dtype=np.uint8), documents=np.array([0, 4, 7, 10]))
    part = stream.slice(4, 10)
    assert part.documents.tolist() == [0, 3, 6] and len(part.mask) == 6
    with pytest.raises(DataError, match="--long"):
        ChatOptions(long="keep")


@pytest.mark.parametrize("override", [False, True], ids=["directory's", "--chat-template"])
def test_an_exported_chat_run_renders_chats_in_transformers_as_it_trained(tmp_path, override):
    """prepare (from a model directory, or with --chat-template FILE) → train → export: transformers' tokenizer
    of the exported directory renders a conversation with the template the data was rendered with, and encodes
    it to the ids prepare stored."""
    from transformers import AutoTokenizer

    from paratrain.data.chat import load_chat_template

    model = model_dir(tmp_path / "llama3", "llama3")
    template_file = tmp_path / "marked.jinja"
    template_file.write_text(CHATML_GENERATION)
    conversations = _conversations(40)
    data = write_jsonl(tmp_path / "chat.jsonl", conversations)
    options = ChatOptions(chat_template=str(template_file)) if override else ChatOptions()
    prepared = prepare_corpus(data, tmp_path / "prepared", str(model), progress=False, chat=options)
    run = tmp_path / "run"
    assert main(["train", *TINY, "--data", str(prepared), "--out", str(run), "--steps", "1", "--seq-len", "96",
                 "--global-batch", "4", "--micro-batch", "2"]) == 0
    assert main(["export", str(run), str(tmp_path / "hf")]) == 0
    theirs = AutoTokenizer.from_pretrained(tmp_path / "hf")
    used = load_chat_template(model, str(template_file) if override else "")
    assert theirs.chat_template == used.text
    for messages in (RECORDS[0]["messages"], conversations[0]["messages"]):
        text = theirs.apply_chat_template(messages, tokenize=False)
        assert text == used.render(messages, "x")[0]
    (stored, _), *_ = _documents(prepared)[0]  # the first conversation, closed by end-of-text
    assert theirs(text, add_special_tokens=False)["input_ids"] == stored.tolist()[:-1]
