"""Any transformers causal LM through paratrain: built on meta from its directory, loaded tensor by tensor, trained
as transformers computes it, exported to a directory transformers loads, refused in one line where it cannot be.

Families (`hf_families`): Qwen2, Qwen3, Mistral, Gemma 2, Phi-3, Qwen3-MoE, random weights saved with
save_pretrained (no download).
"""

from __future__ import annotations

import functools
import json
import shutil

import pytest
import torch
import torch.nn.functional as F

from hf_families import FAMILIES, VOCAB, hf_loss, hf_model, save_family
from paratrain import DataParallel, forkserver, init_mesh, parallelize
from paratrain.cli import main
from paratrain.metrics import read_metrics
from paratrain.interop.hf_weights import weight_initializer
from paratrain.models.hf import HFCausalLM, HFModelError, read_model_dir
from paratrain.train import train_step

SEQ = 24


@pytest.fixture(autouse=True)
def _process_group_left_behind():
    """`init_mesh()` in this process starts a process group of one; later tests must not find it."""
    yield
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def _tokens(batch: int = 2) -> torch.Tensor:
    return torch.randint(3, VOCAB, (batch, SEQ + 1), generator=torch.Generator().manual_seed(7))


def _built(directory, init_from=True):
    config = read_model_dir(directory)
    model = HFCausalLM.build(config)
    return model, weight_initializer(model, str(directory) if init_from else None, seed=0)


@pytest.mark.parametrize("family", FAMILIES)
def test_the_first_steps_loss_is_transformers_own(family, tmp_path):
    """fp32, one process: paratrain's first-step loss on a batch equals transformers' loss(labels) on it (1e-6)."""
    hf = hf_model(family)
    hf.save_pretrained(tmp_path)
    tokens = _tokens()
    model, init = _built(tmp_path)
    assert model.config.params == sum(p.numel() for p in hf.parameters())
    pmodel, optimizer = parallelize(model, init_mesh(), optimizer=functools.partial(torch.optim.AdamW, lr=1e-3),
                                    data=DataParallel(grad_reduction="sum"), init=init)
    outcome = train_step(pmodel, optimizer, [(tokens[:, :-1], tokens[:, 1:])], 1.0)
    expected = hf_loss(hf, tokens)
    assert abs(outcome.loss - expected) <= 1e-6 * expected, (outcome.loss, expected)


@pytest.mark.parametrize("family", FAMILIES)
def test_export_loads_in_transformers_with_the_same_logits(family, tmp_path):
    """A final/ directory of a transformers model exports to one AutoModelForCausalLM loads: logits equal (1e-5)."""
    from transformers import AutoModelForCausalLM

    from paratrain.data.tokenizer import ByteTokenizer
    from paratrain.run.export import export_hf
    from paratrain.train import save_final

    save_family(family, tmp_path / "hf", seed=1)
    model, init = _built(tmp_path / "hf")
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    weights = ((n, init(n, s)) for n, s in shapes.items())
    save_final(tmp_path / "run", model.config, ByteTokenizer(), shapes, weights)
    export_hf(tmp_path / "run" / "final", tmp_path / "out", max_shard_bytes=40_000)
    assert (tmp_path / "out" / "model.safetensors.index.json").is_file()
    assert json.loads((tmp_path / "out" / "generation_config.json").read_text())["eos_token_id"] == ByteTokenizer().eos_id
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    again, init_again = _built(tmp_path / "out")  # --init-from of the export reads the sharded index
    from paratrain.parallel.materialize import to_empty

    to_empty(again, "cpu")
    with torch.no_grad():
        for name, p in again.named_parameters():
            p.copy_(init_again(name, p.shape))
        tokens = _tokens()
        ours = again.eval()(tokens)
        theirs = back(tokens).logits
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ours, hf_model(family, seed=1)(tokens).logits, rtol=1e-5, atol=1e-5)


TRAIN = ["train", "--steps", "2", "--global-batch", "4", "--micro-batch", "4", "--seq-len", str(SEQ),
         "--precision", "fp32", "--sample-tokens", "0", "--eval-every", "0"]


def test_train_init_from_export_and_continue(tmp_path, capsys):
    """`paratrain train --init-from DIR` (Gemma 2: soft-capping, scaled and tied embeddings), its checkpoint exported
    under transformers' names, the export trained on with --init-from; `--model DIR` trains from scratch."""
    save_family("gemma2", tmp_path / "hf")
    assert main([*TRAIN, "--init-from", str(tmp_path / "hf"), "--out", str(tmp_path / "run"),
                 "--checkpoint-every", "2"]) == 0
    losses = [row["loss"] for row in read_metrics(tmp_path / "run" / "metrics.jsonl") if "loss" in row]
    assert len(losses) == 2 and all(0 < loss < 10 for loss in losses)
    assert main(["export", str(tmp_path / "run"), str(tmp_path / "out")]) == 0
    assert json.loads((tmp_path / "out" / "config.json").read_text())["architectures"] == ["Gemma2ForCausalLM"]
    assert main([*TRAIN, "--init-from", str(tmp_path / "out"), "--out", str(tmp_path / "again")]) == 0
    first = read_metrics(tmp_path / "again" / "metrics.jsonl")[0]["loss"]
    assert first < losses[0] + 0.5
    assert main([*TRAIN, "--model", str(tmp_path / "hf"), "--out", str(tmp_path / "scratch")]) == 0
    capsys.readouterr()


def test_a_checkpoint_resumes_and_exports_with_its_model_directory_gone(tmp_path, capsys):
    """A run of `--init-from DIR` (Qwen2, a tokenizer with its chat template, chat data) resumed with `--resume RUN`
    alone after DIR moved away continues bit-exact: the checkpoint carries the model's config and the tokenizer
    (`paratrain.run.carried`); `export` writes config and tokenizer from there; an --init-from of another model is
    refused in one line."""
    from chat_fixtures import model_dir, write_jsonl

    hf = model_dir(save_family("qwen2", tmp_path / "hf"), "chatml")
    chats = [{"messages": [{"role": "user", "content": f"hi {i}"}, {"role": "assistant", "content": f"yo {i}"}]}
             for i in range(24)]
    run = tmp_path / "run"
    train = [*TRAIN, "--seq-len", "96", "--data", str(write_jsonl(tmp_path / "chat.jsonl", chats))]
    assert main([*train, "--init-from", str(hf), "--out", str(run), "--checkpoint-every", "1"]) == 0
    expected = [float.hex(r["loss"]) for r in read_metrics(run / "metrics.jsonl")]
    shutil.rmtree(run / "checkpoints" / "step-00000002")
    moved = hf.rename(tmp_path / "moved")
    capsys.readouterr()
    assert main(["train", "--resume", str(run)]) == 0
    first = next(line for line in capsys.readouterr().out.splitlines() if "parameters)" in line)
    assert first.startswith("paratrain: Qwen2ForCausalLM"), first
    assert [float.hex(r["loss"]) for r in read_metrics(run / "metrics.jsonl")] == expected
    assert main(["export", str(run), str(tmp_path / "export")]) == 0
    config = json.loads((tmp_path / "export" / "config.json").read_text())
    assert config["architectures"] == ["Qwen2ForCausalLM"] and config["num_key_value_heads"] == 2
    assert "<|im_start|>" in json.loads((tmp_path / "export" / "tokenizer_config.json").read_text())["chat_template"]
    assert (tmp_path / "export" / "tokenizer.json").read_bytes() == (moved / "tokenizer.json").read_bytes()
    other = save_family("qwen3", tmp_path / "other")
    refusal = _refusal(capsys, ["train", "--resume", str(run), "--init-from", str(other)])
    assert "model_type is 'qwen2' there, 'qwen3' here" in refusal and "drop --init-from" in refusal, refusal


def _refusal(capsys, argv) -> str:
    """A refused command's one line; a refused launch (--nproc) leaves no worker server of its own behind."""
    capsys.readouterr()
    had_server = forkserver.running()
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err, err
    assert forkserver.running() == had_server
    return err


def test_bad_directories_are_refused_in_one_line(tmp_path, capsys):
    save_family("qwen2", tmp_path / "ok")
    doc = json.loads((tmp_path / "ok" / "config.json").read_text())
    remote = tmp_path / "remote"
    remote.mkdir()
    (remote / "config.json").write_text(json.dumps({**doc, "auto_map": {"AutoModelForCausalLM": "x.Y"}}))
    assert "remote code" in _refusal(capsys, [*TRAIN, "--init-from", str(remote)])
    unknown = tmp_path / "unknown"
    unknown.mkdir()
    (unknown / "config.json").write_text(json.dumps({**doc, "model_type": "no_such_model"}))
    assert "model_type 'no_such_model'" in _refusal(capsys, [*TRAIN, "--model", str(unknown)])
    wrong = tmp_path / "wrong"
    save_family("qwen2", wrong)
    (wrong / "config.json").write_text(json.dumps({**doc, "intermediate_size": 48}))
    assert "mlp.gate_proj.weight' has shape [64, 32] but config.json implies [48, 32]" in \
        _refusal(capsys, [*TRAIN, "--init-from", str(wrong)])
    (wrong / "model.safetensors").unlink()
    assert "neither model.safetensors nor model.safetensors.index.json" in \
        _refusal(capsys, [*TRAIN, "--init-from", str(wrong)])
    assert "tp 3" in \
        _refusal(capsys, [*TRAIN, "--init-from", str(tmp_path / "ok"), "--tp", "3", "--nproc", "3"])
    assert "pp 4" in \
        _refusal(capsys, [*TRAIN, "--init-from", str(tmp_path / "ok"), "--pp", "4", "--nproc", "4"])


def test_what_a_family_cannot_do_under_a_layout_is_refused_in_one_line(tmp_path, capsys):
    save_family("gemma2", tmp_path / "gemma2")
    save_family("phi3", tmp_path / "phi3")
    gemma2 = [*TRAIN, "--init-from", str(tmp_path / "gemma2"), "--nproc", "2"]
    assert "gemma2 runs transformers' eager attention" in _refusal(capsys, [*gemma2, "--cp", "2"])
    phi3 = [*TRAIN, "--init-from", str(tmp_path / "phi3"), "--nproc", "2"]
    assert "--document-mask with --cp 2: transformers' model builds its document mask from the chunks" in \
        _refusal(capsys, [*phi3, "--cp", "2", "--document-mask"])
    qwen2 = [*TRAIN, "--init-from", str(tmp_path / "qwen2"), "--nproc", "2"]
    save_family("qwen2", tmp_path / "qwen2")
    assert "--ep 2: transformers' qwen2 has no mixture of experts that expert parallelism splits" in \
        _refusal(capsys, [*qwen2, "--ep", "2"])
    windowed = save_family("mistral_window", tmp_path / "mistral")  # a window of 32 tokens
    assert "--cp 2: mistral attends over a sliding window of 32 tokens, shorter than --seq-len 48" in \
        _refusal(capsys, [*TRAIN, "--init-from", str(windowed), "--nproc", "2", "--cp", "2", "--seq-len", "48"])
    assert "--document-mask: mistral attends over a sliding window of 32 tokens" in \
        _refusal(capsys, [*TRAIN, "--init-from", str(windowed), "--document-mask", "--seq-len", "48"])
    import transformers

    gpt2 = transformers.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64)
    transformers.AutoModelForCausalLM.from_config(gpt2).save_pretrained(tmp_path / "gpt2")
    assert "--pp 2: pipeline stages lay out transformers' llama, mistral" in \
        _refusal(capsys, [*TRAIN, "--init-from", str(tmp_path / "gpt2"), "--nproc", "2", "--pp", "2"])


def test_plan_proposes_pipeline_stages_only_where_the_trainer_lays_them_out(tmp_path, capsys):
    """`plan --model DIR` reads the trainer's rule (`rules.pipeline_model_violations`): a family pipeline stages do
    not lay out (Gemma 1) gets no --pp layout, every one refused for that reason; Gemma 2 (its head tied to the
    embedding) gets pp 2."""
    import transformers

    from hf_families import _COMMON

    gemma = transformers.GemmaConfig(**{**_COMMON, "head_dim": 8})
    transformers.AutoModelForCausalLM.from_config(gemma).save_pretrained(tmp_path / "gemma")
    save_family("gemma2", tmp_path / "gemma2")
    searched = {}
    for family in ("gemma", "gemma2"):
        capsys.readouterr()
        assert main(["plan", "--model", str(tmp_path / family), "--gpus", "4", "--seq-len", "32", "--global-batch",
                     "8", "--top", "1000", "--json"]) == 0  # every feasible layout
        searched[family] = json.loads(capsys.readouterr().out)
    assert searched["gemma"]["layouts"] and {layout["pp"] for layout in searched["gemma"]["layouts"]} == {1}
    refused = {entry["rule"]: entry for entry in searched["gemma"]["infeasible"]}
    assert "gemma's is not known to be" in refused["pp_model"]["summary"]
    assert searched["gemma2"]["workload"]["config"]["tie_embeddings"]
    assert 2 in {layout["pp"] for layout in searched["gemma2"]["layouts"]}


@pytest.mark.parametrize("family", FAMILIES)
def test_plan_counts_the_directorys_parameters_exactly(family, tmp_path, capsys):
    hf = hf_model(family)
    hf.save_pretrained(tmp_path)
    capsys.readouterr()
    assert main(["plan", "--model", str(tmp_path), "--dp", "2", "--seq-len", "32", "--global-batch", "4",
                 "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["workload"]["num_params"] == sum(p.numel() for p in hf.parameters())


def test_a_plan_without_a_counterpart_refuses_tp_naming_the_module(tmp_path):
    """Phi-3 fuses q, k, v (and gate, up) in one projection, which its plan splits by rows and gathers whole (the
    module cuts the parts from the whole output), the next projection keeping its rank's features; a style paratrain
    has none for is refused naming the module."""
    from paratrain.models.tp_plans import hf_plan
    from paratrain.parallel.tensor import TensorParallelError

    save_family("phi3", tmp_path)
    model, _ = _built(tmp_path)
    plan = hf_plan(model)
    assert plan["model.layers.*.self_attn.qkv_proj"].gather_output and plan["model.layers.*.mlp.gate_up_proj"].gather_output
    assert plan["model.layers.*.self_attn.o_proj"].split_input and plan["model.layers.*.mlp.down_proj"].split_input
    model.hf_config.base_model_tp_plan = {**model.hf_config.base_model_tp_plan,
                                          "layers.*.self_attn.qkv_proj": "colwise_interleaved"}
    with pytest.raises(TensorParallelError, match="qkv_proj as 'colwise_interleaved'"):
        hf_plan(model)


def test_every_family_maps_to_a_plan_of_paratrains_styles(tmp_path):
    from paratrain.models.tp_plans import hf_plan
    from paratrain.parallel.tensor import AttentionRegion, OutputHead, PartialGradients, VocabEmbedding

    save_family("qwen3", tmp_path)
    model, _ = _built(tmp_path)
    plan = hf_plan(model)
    assert isinstance(plan["model.layers.*.self_attn"], AttentionRegion)
    assert isinstance(plan["model.layers.*.self_attn.q_norm"], PartialGradients)
    assert isinstance(plan["model.embed_tokens"], VocabEmbedding) and isinstance(plan["lm_head"], OutputHead)
    sp = hf_plan(model, sequence_parallel=True)
    assert sp["model.embed_tokens"].defer_sp_reduce and "model.layers.0" in sp and "model.norm" in sp


def test_the_seeded_initialization_is_transformers_own_and_layout_free(tmp_path):
    """--model DIR: each parameter by transformers' `_init_weights` of its module, from (seed, name) alone."""
    save_family("qwen2", tmp_path)
    model, init = _built(tmp_path, init_from=False)
    q = init("model.layers.0.self_attn.q_proj.weight", (32, 32))
    assert torch.equal(q, init("model.layers.0.self_attn.q_proj.weight", (32, 32)))
    assert abs(q.std().item() - model.hf_config.initializer_range) < 0.005
    assert torch.equal(init("model.norm.weight", (32,)), torch.ones(32))
    assert not torch.equal(q, init("model.layers.1.self_attn.q_proj.weight", (32, 32)))


def test_a_directory_that_is_not_a_model_is_refused(tmp_path):
    with pytest.raises(HFModelError, match="has no config.json"):
        read_model_dir(tmp_path)


@pytest.mark.parametrize("family", ["qwen2", "gemma2"])
def test_document_mask_keeps_packed_documents_apart(family, tmp_path):
    """--document-mask (SDPA's boolean mask; Gemma 2's eager attention, an additive one): a packed sequence's logits
    equal each document run alone."""
    import dataclasses

    hf = hf_model(family)
    hf.save_pretrained(tmp_path)
    model, init = _built(tmp_path)
    model = HFCausalLM.build(dataclasses.replace(model.config, document_eos=2))
    from paratrain.parallel.materialize import to_empty

    to_empty(model, "cpu")
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(init(name, p.shape))
        g = torch.Generator().manual_seed(3)
        first, second = torch.randint(3, VOCAB, (7,), generator=g), torch.randint(3, VOCAB, (9,), generator=g)
        first[-1] = 2
        packed = model.eval()(torch.cat([first, second])[None])
        alone = torch.cat([hf(first[None]).logits, hf(second[None]).logits], dim=1)
    torch.testing.assert_close(packed, alone, rtol=1e-5, atol=1e-5)


def test_a_model_directorys_bos_and_eos_are_what_it_states(tmp_path, capsys):
    """The tokenizer of a model directory: BOS / EOS as generation_config.json states them (else config.json),
    else the one token its post-processor puts before a sequence, else a token of a known name; kept by the
    tokenizer's saved copy (what a checkpoint carries); an id that is no token refused in one line, and a
    tokenizer with more ids than the config's vocabulary refused before any process starts."""
    from tokenizers import processors

    from chat_fixtures import byte_tokenizer
    from paratrain.data.tokenizer import tokenizer_from_file
    from paratrain.errors import DataError

    directory = save_family("qwen2", tmp_path / "qwen2")  # generation_config.json: bos 1, eos 2 (hf_families)
    tok = byte_tokenizer(["<s>", "</s>", "<|im_end|>"])  # ids 256, 257, 258
    tok.post_processor = processors.TemplateProcessing(single="<|im_end|> $A", special_tokens=[("<|im_end|>", 258)])
    tok.save(str(directory / "tokenizer.json"))
    stated = tokenizer_from_file(directory)
    assert (stated.bos_id, stated.eos_id) == (1, 2)
    copy = tmp_path / "copy"
    stated.save(copy)
    assert (tokenizer_from_file(copy).bos_id, tokenizer_from_file(copy).eos_id) == (1, 2)
    (directory / "generation_config.json").unlink()
    doc = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**doc, "bos_token_id": None, "eos_token_id": [257, 2]}))
    fallback = tokenizer_from_file(directory)
    assert (fallback.bos_id, fallback.eos_id) == (258, 257)  # the post-processor's, config.json's first
    (directory / "config.json").write_text(json.dumps({**doc, "eos_token_id": 400}))
    with pytest.raises(DataError, match="config.json: eos_token_id 400 is no token of the tokenizer beside it"):
        tokenizer_from_file(directory)
    (directory / "config.json").write_text(json.dumps(doc))
    byte_tokenizer([f"<extra_{i}>" for i in range(70)]).save(str(directory / "tokenizer.json"))  # ids up to 325
    assert "the tokenizer has 326 tokens but model" in _refusal(capsys, [*TRAIN, "--init-from", str(directory)])


@pytest.mark.parametrize("family", ["qwen2", "qwen3_moe"])
def test_a_shard_reads_its_rows_alone(family, tmp_path):
    """What a ZeRO-3 shard asks of a directory (sharded files with their index; the mixture's experts stored one
    tensor per expert): its rows of each parameter, equal to those rows of the whole tensor, read alone."""
    save_family(family, tmp_path, max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    model, init = _built(tmp_path)
    for name, param in model.named_parameters():
        whole = init(name, param.shape)
        rows = param.shape[0]
        for lo, hi in ((0, 1), (rows // 2, rows), (1, rows - 1)):
            assert torch.equal(init.rows(name, param.shape, lo, hi), whole[lo:hi]), (name, lo, hi)


def test_a_fused_mixture_routed_for_expert_parallelism_computes_transformers_logits():
    """Qwen3-MoE's fused experts made a mixture paratrain's expert parallelism splits (`route_experts`): the same
    parameters under the same names, transformers' logits bit for bit (its loop's order of adding the experts)."""
    from paratrain.models.hf_experts import route_experts
    from paratrain.parallel.expert import moe_layers

    hf = hf_model("qwen3_moe")
    tokens = _tokens()
    with torch.no_grad():
        want = hf(tokens).logits
        names = list(hf.state_dict())
        assert route_experts(hf) == 2 and len(moe_layers(hf)) == 2
        assert list(hf.state_dict()) == names
        assert torch.equal(hf(tokens).logits, want)
