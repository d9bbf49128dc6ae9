"""Model directories for chat tests, built here with the `tokenizers` library (no download): a byte-level
tokenizer whose every byte is one token (so a hand-listed expectation is exact text), its special tokens, and
the chat template of one model family in tokenizer_config.json."""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

# Qwen2.5's template (ChatML), its tool branches left out: a system prompt by default, no {% generation %}.
CHATML = (
    "{%- if messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if (message.role == 'user') or (message.role == 'system' and not loop.first) or (message.role == 'assistant') %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{{- '<|im_start|>user\\n<tool_response>\\n' + message.content + '\\n</tool_response><|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
CHATML_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

# Llama 3's template (header tokens, <|eot_id|>), its date and tool branches left out.
LLAMA3 = (
    "{{- bos_token }}"
    "{%- if messages[0]['role'] == 'system' %}"
    "{%- set system_message = messages[0]['content']|trim %}{%- set messages = messages[1:] %}"
    "{%- else %}{%- set system_message = '' %}{%- endif %}"
    "{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' + system_message + '<|eot_id|>' }}"
    "{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)
LLAMA3_SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]

# The ChatML template with the assistant turns marked, as transformers' documentation shows.
CHATML_GENERATION = (
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' }}{% generation %}{{ message.content + '<|im_end|>' }}{% endgeneration %}"
    "{{- '\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def byte_tokenizer(specials: list[str]) -> Tokenizer:
    """Byte-level BPE without merges: every byte one token (ids 0..255), then the special tokens."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet(), key=lambda c: bytes_to_unicode_rank(c))
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    return tok


def bytes_to_unicode_rank(char: str) -> int:
    """The byte that GPT-2's byte-to-unicode table maps to `char` (so token i is byte i)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(map(chr, cs), bs))[char]


def model_dir(path: Path, family: str, template: str | None = None) -> Path:
    """A model directory of `family` ('chatml' or 'llama3'): tokenizer.json and tokenizer_config.json with the
    family's chat template (or `template`; '' for none)."""
    path.mkdir(parents=True, exist_ok=True)
    specials = CHATML_SPECIALS if family == "chatml" else LLAMA3_SPECIALS
    byte_tokenizer(specials).save(str(path / "tokenizer.json"))
    config = {"bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"} if family == "chatml" else \
        {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}
    text = (CHATML if family == "chatml" else LLAMA3) if template is None else template
    if text:
        config["chat_template"] = text
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


def write_jsonl(path: Path, records: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path
