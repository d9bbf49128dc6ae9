"""Conversations into tokens and a loss mask: chat records rendered by the model's own chat template.

A record of chat data has one of the shapes the field uses:

- ``messages``: OpenAI's ``[{"role": "system" | "user" | "assistant" | "tool", "content": "..."}, ...]``;
- ``conversations``: ShareGPT's ``[{"from": "human" | "gpt" | "system" | "tool", "value": "..."}, ...]``;
- ``prompt`` and ``completion``: two strings (a user turn and an assistant turn; without a template, the text
  of the prompt followed by the completion's), or two lists of messages (TRL's conversational form).

A conversation is rendered by the chat template that came with the model (``tokenizer_config.json``'s
``chat_template``, or ``chat_template.jinja``; ``--chat-template FILE`` overrides it) through transformers' own
rendering (`render_jinja_template`), which runs the template in jinja2's ``ImmutableSandboxedEnvironment``: a
template is data that came with a download, and one that reaches for what lies outside the sandbox
(``__globals__``, ``os``) is refused in one line before anything of it runs.

The loss mask says which tokens are targets. Under ``assistant`` (the default) it covers each assistant turn's
content and the template's end-of-turn token after it, found by rendering, never by guessing token ids: where
the template marks the turns (``{% generation %}``), those marks; otherwise the conversation's prefixes are
rendered turn by turn (up to the turn's generation prompt, and through the turn) and the difference taken, less
the whitespace the template puts between turns. ``completion``: the last assistant turn alone (a
prompt/completion record's completion); ``all``: every token. A conversation's first token is never a
target (nothing precedes it in its own sequence), and an end-of-text token closes each conversation, where
the document mask (`--document-mask`) restarts attention and positions.
"""

from __future__ import annotations

import contextlib
import functools
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np

from paratrain.errors import DataError

FORMATS = ("auto", "chat", "text")
LOSS_ON = ("assistant", "all", "completion")
LONG = ("drop", "truncate")
ROLES = ("system", "user", "assistant", "tool")
# ShareGPT's speakers, as its datasets name them, to OpenAI's roles
SHAREGPT_ROLES = {"system": "system", "human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "tool": "tool", "function_response": "tool", "observation": "tool"}
TEMPLATE_FILE = "chat_template.jinja"
CONFIG_FILE = "tokenizer_config.json"
_SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")
_BATCH_RECORDS = 512  # records handed to the tokenizer at once


@dataclass(frozen=True)
class ChatOptions:
    """How chat data becomes tokens: the options `paratrain prepare` and `paratrain train` share."""

    format: str = "auto"  # chat, text, or auto: from the first record
    chat_template: str = ""  # a template file overriding the tokenizer directory's
    loss_on: str = "assistant"
    long: str = "drop"  # a conversation longer than a sequence: dropped, or its start kept
    max_seq_len: int = 0  # prepare: the sequence length `long` applies to (0: none; training packs at --seq-len)

    def __post_init__(self):
        for name, allowed in (("format", FORMATS), ("loss_on", LOSS_ON), ("long", LONG)):
            if getattr(self, name) not in allowed:
                raise DataError(f"--{name.replace('_', '-')} {getattr(self, name)!r}: use one of {', '.join(allowed)}")
        if isinstance(self.max_seq_len, bool) or not isinstance(self.max_seq_len, int) or self.max_seq_len < 0:
            raise DataError(f"--max-seq-len {self.max_seq_len!r}: use a positive number of tokens (0: no limit)")


def fits(length: int, seq_len: int) -> bool:
    """Whether a conversation of `length` tokens fits one sequence of `seq_len` inputs: its first token is never a
    target, so seq_len + 1 tokens train whole."""
    return length <= seq_len + 1


# --- records ---------------------------------------------------------------------------------------------------

def record_shape(record) -> str | None:
    """'messages', 'conversations' or 'prompt' (prompt/completion) for a chat record, None for anything else."""
    if not isinstance(record, dict):
        return None
    for key in ("messages", "conversations"):
        if isinstance(record.get(key), list):
            return key
    return "prompt" if "prompt" in record and "completion" in record else None


def detect_format(first_record) -> str:
    """'chat' if the first record has a chat shape, else 'text'."""
    return "chat" if record_shape(first_record) else "text"


def messages_of(record, where: str) -> tuple[list[dict], list[dict]]:
    """(context messages, completion messages) of a chat record, each message {"role", "content", ...}; the
    completion is empty except for a prompt/completion record of message lists. One line naming `where` if the
    record is not chat."""
    shape = record_shape(record)
    if shape is None:
        keys = ", ".join(list(record)[:8]) if isinstance(record, dict) else type(record).__name__
        raise DataError(f"{where}: a chat record has 'messages', 'conversations' or 'prompt' and 'completion' "
                        f"(its keys: {keys or 'none'}); fix the record or pass --format text")
    if shape == "prompt":
        prompt, completion = record["prompt"], record["completion"]
        if isinstance(prompt, str) and isinstance(completion, str):
            return [{"role": "user", "content": prompt}], [{"role": "assistant", "content": completion}]
        if isinstance(prompt, list) and isinstance(completion, list):
            return _checked(prompt, where, "prompt"), _checked(completion, where, "completion")
        raise DataError(f"{where}: 'prompt' and 'completion' are both strings or both lists of messages")
    if shape == "conversations":
        return _checked([_from_sharegpt(m, i, where) for i, m in enumerate(record[shape], 1)], where, shape), []
    return _checked(record[shape], where, shape), []


def _from_sharegpt(message, index: int, where: str) -> dict:
    if not isinstance(message, dict) or "from" not in message or "value" not in message:
        raise DataError(f"{where}: conversations message {index} needs 'from' and 'value'")
    speaker = message["from"]
    if speaker not in SHAREGPT_ROLES:
        raise DataError(f"{where}: conversations message {index} is from {speaker!r}; use one of "
                        f"{', '.join(SHAREGPT_ROLES)}")
    return {"role": SHAREGPT_ROLES[speaker], "content": message["value"]}


def _checked(messages, where: str, key: str) -> list[dict]:
    if not isinstance(messages, list):
        raise DataError(f"{where}: {key!r} is a list of messages, got {type(messages).__name__}")
    for i, m in enumerate(messages, 1):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            missing = "a JSON object" if not isinstance(m, dict) else "'role'" if "role" not in m else "'content'"
            raise DataError(f"{where}: {key} message {i} has no {missing}; each message has 'role' and 'content'")
        if m["role"] not in ROLES:
            raise DataError(f"{where}: {key} message {i} has role {m['role']!r}; use one of {', '.join(ROLES)}")
    return messages


# --- the template ----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ChatTemplate:
    """A chat template and what it is rendered with (the tokenizer's special tokens, as transformers passes them)."""

    text: str
    source: str  # where it came from, for messages
    special: dict = field(default_factory=dict)

    @property
    def marks_generation(self) -> bool:
        """Whether the template marks the assistant's turns with {% generation %}."""
        return re.search(r"\{%-?\s*generation\s*-?%\}", self.text) is not None

    def render(self, messages: list[dict], where: str, *, add_generation_prompt: bool = False,
               track: bool = False) -> tuple[str, list[tuple[int, int]]]:
        """(text, [(start, end)] of the {% generation %} blocks when `track`) of one conversation, by transformers'
        sandboxed rendering; one line naming `where` for a template that raises or leaves the sandbox."""
        if not track:
            return self.render_prefixes(messages, [(len(messages), add_generation_prompt)], where)[0], []
        with self._refusals(where):
            renderer = _renderer(self.text)
            text, spans = renderer.tracked(messages=renderer.data(messages), tools=None, documents=None,
                                           add_generation_prompt=add_generation_prompt, **renderer.data(self.special))
        return text, [tuple(s) for s in spans]

    def render_prefixes(self, messages: list[dict], ends: Sequence[tuple[int, bool]], where: str) -> list[str]:
        """messages[:end] rendered (with the generation prompt where asked) for each (end, add_generation_prompt) of
        `ends`, each exactly as transformers' `render_jinja_template` renders it: its compiled template (jinja2's
        ImmutableSandboxedEnvironment with transformers' filters and globals, compiled once per template) given
        its own template data (plain JSON types, reasoning fields aliased), made once for every prefix."""
        with self._refusals(where):
            renderer = _renderer(self.text)
            messages, special = renderer.data(messages), renderer.data(self.special)
            return [renderer.render(messages=messages[:end], tools=None, documents=None, add_generation_prompt=prompt,
                                    **special) for end, prompt in ends]

    @contextlib.contextmanager
    def _refusals(self, where: str):
        """A template that leaves the sandbox, raises or fails, as one line naming `where` and the template."""
        import jinja2

        try:
            yield
        except jinja2.exceptions.SecurityError as exc:
            raise ChatTemplateRefused(f"{where}: the chat template ({self.source}) reaches outside jinja2's sandbox "
                                      f"({_first_line(exc)}); refused, nothing of it ran") from None
        except jinja2.exceptions.TemplateError as exc:  # raise_exception(...) in the template, or a syntax error
            raise DataError(f"{where}: the chat template ({self.source}) refused the conversation: "
                            f"{_first_line(exc)}") from None
        except DataError:
            raise
        except Exception as exc:  # noqa: BLE001 - a template's own bug surfaces as any Python error
            raise DataError(f"{where}: the chat template ({self.source}) failed on the conversation "
                            f"({type(exc).__name__}: {_first_line(exc)})") from None


class _Renderer:
    """transformers' `render_jinja_template` in the pieces a conversation's prefixes share: its template compiled
    once per template text, in transformers' environment (jinja2's ImmutableSandboxedEnvironment with its filters and
    globals) overlaid with `_quick_lookups`, and the conversion of what a template sees into plain data (`data`),
    whose private pieces these are. Rendering each prefix through `render_jinja_template` itself converts the
    conversation again for each one (a third of a prefix's render); and `Template.render` merges the template's
    globals (a chained map, walked twice) into each render's context, here merged once: the context each render
    starts from holds the same names and values. A template that marks the assistant's turns is rendered once, by
    transformers' tracker of its {% generation %} blocks (`tracked`). tests/data/test_chat.py checks that every prefix
    renders to `render_jinja_template`'s text, and the marked spans to its spans."""

    def __init__(self, text: str):
        from transformers.utils.chat_template_utils import (_alias_reasoning_fields, _compile_jinja_template,
                                                            _plain_template_data, _render_with_assistant_indices)

        environment = _compile_jinja_template(text).environment.overlay()  # its own copy: transformers' untouched
        _quick_lookups(environment)
        self.template = environment.from_string(text)
        self.globals = dict(self.template.globals)
        self._plain, self._alias = _plain_template_data, _alias_reasoning_fields
        self._tracked = _render_with_assistant_indices

    def data(self, value):
        """`value` as transformers hands it to a template: plain JSON types, a conversation's reasoning aliased."""
        value = self._plain(value)
        return self._alias(value) if isinstance(value, list) else value

    def render(self, **variables) -> str:
        """The template rendered with `variables` (template data) beside its globals, as `Template.render` does."""
        template = self.template
        context = template.new_context({**self.globals, **variables}, shared=True)
        return template.environment.concat(template.root_render_func(context))

    def tracked(self, **variables) -> tuple[str, list]:
        """(the render, the (start, end) of each {% generation %} block in it), by transformers' tracker."""
        return self._tracked(self.template, **variables)


class _PublicRenderer:
    """The same three answers by transformers' public `render_jinja_template` alone, one call per render: what a
    transformers without `_Renderer`'s private pieces gets (the same texts and spans, each prefix converted again)."""

    def __init__(self, text: str):
        from transformers.utils.chat_template_utils import render_jinja_template

        self.text, self._render = text, render_jinja_template

    def data(self, value):
        return value  # render_jinja_template converts what it is given itself

    def render(self, *, messages, tools, documents, **variables) -> str:
        rendered, _ = self._render([messages], tools=tools, documents=documents, chat_template=self.text, **variables)
        return rendered[0]

    def tracked(self, *, messages, tools, documents, **variables) -> tuple[str, list]:
        rendered, spans = self._render([messages], tools=tools, documents=documents, chat_template=self.text,
                                       return_assistant_tokens_mask=True, **variables)
        return rendered[0], spans[0]


@functools.lru_cache(maxsize=16)
def _renderer(text: str) -> _Renderer | _PublicRenderer:
    try:
        return _Renderer(text)
    except (ImportError, AttributeError):  # a transformers whose private pieces moved: its public function, slower
        return _PublicRenderer(text)


_VERDICTS_KEPT = 4096  # attribute verdicts remembered per template, at most (a template that computes names)


def _quick_lookups(environment) -> None:
    """The sandbox's two lookups that a chat template makes for every message, answered as jinja2's sandbox answers
    them without its slow path (half a render's time):

    - `message.role` on a plain dict: the sandbox tries the attribute first and takes the item when there is
      none; a name that is no attribute of `dict` is the item at once (or undefined, as the sandbox's);
    - whether an attribute is safe (`loop.first`, `text.strip`): jinja2's verdict depends on the object's type and
      the name only (a run of isinstance checks against the unsafe types), so it is asked once per exact type of
      plain data or loop and name; any other object is asked every time.

    Installed only over jinja2's own ImmutableSandboxedEnvironment methods, whose answers these are;
    tests/data/test_chat.py checks them against a fresh sandbox's."""
    from jinja2.runtime import LoopContext
    from jinja2.sandbox import ImmutableSandboxedEnvironment, SandboxedEnvironment

    sandbox = type(environment)
    if (sandbox.getattr is not SandboxedEnvironment.getattr
            or sandbox.is_safe_attribute is not ImmutableSandboxedEnvironment.is_safe_attribute):
        return
    dict_attributes = frozenset(dir(dict))
    remembered = frozenset((dict, list, str, int, float, bool, type(None), LoopContext))
    verdicts: dict[tuple[type, str], bool] = {}

    def lookup(obj, attribute):
        if type(obj) is dict and attribute not in dict_attributes:
            try:
                return obj[attribute]
            except KeyError:
                return environment.undefined(obj=obj, name=attribute)
        return sandbox.getattr(environment, obj, attribute)

    def is_safe_attribute(obj, attribute, value):
        key = (type(obj), attribute)
        verdict = verdicts.get(key)
        if verdict is None:
            verdict = sandbox.is_safe_attribute(environment, obj, attribute, value)
            if key[0] in remembered and len(verdicts) < _VERDICTS_KEPT:
                verdicts[key] = verdict
        return verdict

    environment.getattr, environment.is_safe_attribute = lookup, is_safe_attribute


class ChatTemplateRefused(DataError):
    """A chat template tried to reach outside the sandbox."""


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]


def load_chat_template(tokenizer_dir: str | Path | None, override: str = "") -> ChatTemplate | None:
    """The template of a model directory (`chat_template.jinja`, else `tokenizer_config.json`'s `chat_template`,
    a string or transformers' list of named templates, 'default' taken), or the file `override`; None without one.
    The special tokens come from `tokenizer_config.json` either way."""
    directory = Path(tokenizer_dir) if tokenizer_dir else None
    if directory is not None and directory.is_file():
        directory = directory.parent
    config = _read_config(directory / CONFIG_FILE) if directory is not None else {}
    special = {key: _token_text(config[key]) for key in _SPECIAL_KEYS if config.get(key) is not None}
    if override:
        path = Path(override)
        if not path.is_file():
            raise DataError(f"--chat-template {override}: no such file; pass a Jinja template file")
        return ChatTemplate(path.read_text(encoding="utf-8"), str(path), special)
    if directory is not None and (directory / TEMPLATE_FILE).is_file():
        return ChatTemplate((directory / TEMPLATE_FILE).read_text(encoding="utf-8"), str(directory / TEMPLATE_FILE),
                            special)
    template = config.get("chat_template")
    if isinstance(template, list):  # [{"name": ..., "template": ...}]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    if isinstance(template, str) and template.strip():
        return ChatTemplate(template, str(directory / CONFIG_FILE), special)
    return None


def _read_config(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise DataError(f"cannot read {str(path)!r} ({exc}); is it the tokenizer_config.json of a model?") from None
    return config if isinstance(config, dict) else {}


def _token_text(value) -> str:
    """A special token as tokenizer_config.json writes it: its text, or an AddedToken object with 'content'."""
    return value.get("content", "") if isinstance(value, dict) else str(value)


# --- rendering and the mask ------------------------------------------------------------------------------------

def target_spans(template: ChatTemplate | None, record, where: str,
                 loss_on: str) -> tuple[str, list[tuple[int, int]]] | None:
    """(rendered text, [(start, end)] character spans of its targets) of one record; None for a conversation with
    no assistant turn (skipped). Under `all` the span is the whole text."""
    context, completion = messages_of(record, where)
    messages = context + completion
    if not any(m["role"] == "assistant" for m in messages):
        return None
    if template is not None and loss_on == "all":  # one render: no turn to find
        text = template.render(messages, where)[0]
        return text, [(0, len(text))]
    if template is None:
        if len(messages) != 2 or messages[0]["role"] != "user":
            raise DataError(f"{where}: the tokenizer has no chat template (tokenizer_config.json's chat_template "
                            f"or chat_template.jinja) to render messages with; pass --chat-template FILE")
        prompt, answer = str(messages[0]["content"]), str(messages[1]["content"])  # plain prompt/completion text
        text, spans = prompt + answer, [(len(prompt), len(prompt) + len(answer))]
    elif template.marks_generation:
        text, spans = template.render(messages, where, track=True)
    else:
        text, spans = _spans_by_prefixes(template, messages, where)
    if loss_on == "all":
        return text, [(0, len(text))]
    if loss_on == "completion":
        spans = spans[-1:]
    return (text, spans) if spans else None


def _spans_by_prefixes(template: ChatTemplate, messages: list[dict], where: str) -> tuple[str, list[tuple[int, int]]]:
    """(the whole text, each assistant turn's span in it): from the end of the conversation before the turn rendered
    with the generation prompt to the end of the conversation through it (less trailing whitespace), each a prefix
    of the whole. The whole and every prefix are rendered in one pass over the conversation's template data."""
    turns = [k for k, m in enumerate(messages) if m["role"] == "assistant"]
    inner = [k for k in turns if k + 1 < len(messages)]  # a turn that ends the conversation ends with the whole
    ends = [(len(messages), False)] + [(k, True) for k in turns] + [(k + 1, False) for k in inner]
    whole, *rest = template.render_prefixes(messages, ends, where)
    befores, throughs = rest[:len(turns)], rest[len(turns):] + [whole] * (len(turns) - len(inner))
    spans = []
    for k, before, through in zip(turns, befores, throughs):
        if not (whole.startswith(through) and through.startswith(before)):
            raise DataError(f"{where}: the chat template renders the conversation up to assistant message {k + 1} "
                            f"as other than the start of the whole (it rewrites earlier turns); mark the assistant "
                            f"turns with {{% generation %}} in a --chat-template FILE")
        spans.append((len(before), len(through.rstrip())))
    return whole, spans


def token_mask(encoding, spans: Sequence[tuple[int, int]]) -> np.ndarray:
    """uint8 mask of the tokens of `encoding` (a `tokenizers` Encoding) whose first character lies in one of the
    character `spans`: two look-ups per span (the whole offsets list costs more than the tokenization)."""
    mask = np.zeros(len(encoding.ids), dtype=np.uint8)
    for a, b in spans:
        first, last = encoding.char_to_token(a), encoding.char_to_token(b - 1) if b > a else None
        if first is None or last is None:  # a character no token covers (a normalizer dropped it): read them all
            starts = np.asarray([o[0] for o in encoding.offsets], dtype=np.int64)
            mask |= (starts >= a) & (starts < b)
            continue
        if encoding.token_to_chars(first)[0] < a:  # a token that begins before the span is not its
            first += 1
        mask[first:last + 1] = 1
    return mask


KEPT, NO_ASSISTANT, DROPPED, TRUNCATED = range(4)  # what became of an input record (`Encoded.status`)
STATUS_NAMES = ("conversations", "no_assistant", "dropped", "truncated")


@dataclass
class Encoded:
    """A batch of input items (texts, records) as tokens: the stream piece, each item's length in it (0: left out),
    the loss mask (None: every token a target), and what became of each item (None: all kept; else `KEPT`,
    `NO_ASSISTANT`, `DROPPED` or `TRUNCATED`)."""

    tokens: np.ndarray
    lengths: np.ndarray
    mask: np.ndarray | None = None
    status: np.ndarray | None = None


def status_counts(status: np.ndarray) -> dict:
    """{"conversations": kept, "no_assistant": n, "dropped": n, "truncated": n} of `Encoded.status` values
    (a truncated conversation is also kept)."""
    counts = np.bincount(status, minlength=len(STATUS_NAMES)) if len(status) else np.zeros(4, dtype=np.int64)
    named = dict(zip(STATUS_NAMES, (int(c) for c in counts)))
    named["conversations"] += named["truncated"]
    return named


class ChatEncoder:
    """Chat records to tokens and mask, batch by batch (picklable: it runs in `prepare`'s worker processes too)."""

    def __init__(self, tokenizer, template: ChatTemplate | None, options: ChatOptions, dtype: np.dtype):
        if getattr(tokenizer, "backend", None) is None:
            raise DataError("chat data needs the model's own tokenizer: pass --tokenizer DIR, a model directory "
                            "with tokenizer.json and tokenizer_config.json")
        if tokenizer.eos_id is None:
            raise DataError(f"tokenizer {tokenizer.spec} has no end-of-text token to close each conversation with")
        self.tokenizer, self.template, self.options, self.dtype = tokenizer, template, options, np.dtype(dtype)
        self._backend = None

    def __getstate__(self):
        return {**self.__dict__, "_backend": None}

    @property
    def backend(self):
        """The tokenizer with its special tokens recognised in text, as transformers encodes a rendered chat
        (the text tokenizer reads them as plain text: in a document they are text)."""
        if self._backend is None:
            from tokenizers import Tokenizer as HFTokenizer
            self._backend = HFTokenizer.from_str(self.tokenizer.backend.to_str())
            if hasattr(self._backend, "encode_special_tokens"):
                self._backend.encode_special_tokens = False
        return self._backend

    def __call__(self, batch: Sequence[tuple[object, str]]) -> Encoded:
        status = np.full(len(batch), KEPT, dtype=np.uint8)
        rendered = []
        for i, (record, where) in enumerate(batch):
            found = target_spans(self.template, record, where, self.options.loss_on)
            if found is None:
                status[i] = NO_ASSISTANT
            else:
                rendered.append((i, *found))
        encodings = self.backend.encode_batch([text for _, text, _ in rendered], add_special_tokens=False)
        parts, masks, lengths = [], [], np.zeros(len(batch), dtype=np.int64)
        for (i, text, spans), encoding in zip(rendered, encodings):
            ids, mask, status[i] = self._conversation(encoding, spans)
            if ids is not None:
                parts.append(ids)
                masks.append(mask)
                lengths[i] = len(ids)
        tokens = np.concatenate(parts) if parts else np.empty(0, dtype=self.dtype)
        mask = np.concatenate(masks) if masks else np.empty(0, dtype=np.uint8)
        return Encoded(tokens, lengths, mask, status)

    def _conversation(self, encoding, spans) -> tuple[np.ndarray | None, np.ndarray | None, int]:
        """(ids, mask, status) of one rendered conversation: closed by end-of-text, cut to --max-seq-len."""
        eos = self.tokenizer.eos_id
        ids = np.asarray(encoding.ids, dtype=self.dtype)
        mask = token_mask(encoding, spans)
        if not len(ids) or ids[-1] != eos:  # every conversation ends with end-of-text: the document mask's cue
            ids = np.append(ids, self.dtype.type(eos))
            mask = np.append(mask, np.uint8(self.options.loss_on == "all"))
        mask[0] = 0  # the first token has nothing before it in its own sequence
        status, limit = KEPT, self.options.max_seq_len
        if limit and not fits(len(ids), limit):
            if self.options.long == "drop":
                return None, None, DROPPED
            # its start, still closed by end-of-text: packed at a longer --seq-len, the next conversation restarts
            ids, mask, status = np.append(ids[:limit], ids[-1]), np.append(mask[:limit], mask[-1]), TRUNCATED
        if not mask.any():  # its answers lie past the cut: nothing to learn from it
            return None, None, NO_ASSISTANT
        return ids, mask, status


def record_batches(records: Iterable[tuple[object, str]]) -> Iterable[list[tuple[object, str]]]:
    """`records` in batches for the tokenizer's parallel encoding."""
    batch = []
    for item in records:
        batch.append(item)
        if len(batch) >= _BATCH_RECORDS:
            yield batch
            batch = []
    if batch:
        yield batch
