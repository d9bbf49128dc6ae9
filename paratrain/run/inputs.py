"""What the path options name, checked before any process starts and before anything is written.

A bad path must end with one line (exit 2) in the command that was typed, not in every
launched process after the run directory was claimed (or, under --max-restarts, once per
attempt). Each option is checked for what the run will do with it:

* ``--out``: a directory, or nothing yet, below a directory this process can write in;
* ``--data``: files that exist and can be read, holding at least the tokens that one training
  and one evaluation sequence need (each source of a mixture, whose weights must be positive);
* ``--eval-data``: NAME=PATH entries whose files exist and hold one sequence;
* ``--tokenizer`` (or the tokenizer of ``--init-from``): a tokenizer file that loads.

``--config``, ``--resume`` and ``--init-from`` are checked where they are read
(`paratrain.config.load_toml`, `check_resume_option`, `imported_model_config`).
"""

from __future__ import annotations

import os
import re
import tempfile
from pathlib import Path

from paratrain.config import Config, ConfigError
from paratrain.data.corpus import resolve_text_files
from paratrain.data.megatron import megatron_prefix
from paratrain.data.sources import parse_hub
from paratrain.data.mixture import parse_eval_data, parse_mixture
from paratrain.data.prepare import is_prepared_dir, open_prepared
from paratrain.data.tokenizer import ByteTokenizer, load_tokenizer


def check_paths(cfg: Config, tokenizer_spec: str) -> None:
    """Raise ConfigError (or the data pipeline's DataError) for a path option the run cannot use."""
    check_out_dir(cfg.run.out)
    d = cfg.data
    for source in parse_mixture(d.path) or ():  # the mixture's own syntax and weights first
        check_corpus(source.path, d.seq_len, flag=f"--data {d.path!r}: source")
    if parse_mixture(d.path) is None:
        check_corpus(d.path, d.seq_len)
    for name, path in parse_eval_data(d.eval_data):
        check_corpus(path, d.seq_len, flag=f"--eval-data {name}=", held_out=True)
    check_tokenizer(tokenizer_spec)


def check_out_dir(out: str) -> None:
    """--out must be a directory or not exist yet, and the directory that will hold it must be writable."""
    path = Path(out).expanduser()
    if path.exists() and not path.is_dir():
        raise ConfigError(f"--out {out} is a file, not a directory; choose another --out")
    existing = next(p for p in (path, *path.parents) if p.exists())
    if not existing.is_dir():
        raise ConfigError(f"--out {out}: {existing} is a file, so no directory can be made below it; "
                          f"choose another --out")
    _probe_writable(existing, out)


def _probe_writable(directory: Path, out: str) -> None:
    # os.access answers for root as if every directory were writable; a file created and
    # removed answers for read-only mounts, quotas and root alike, and leaves nothing behind.
    try:
        fd, name = tempfile.mkstemp(prefix=".paratrain-probe-", dir=directory)
    except OSError as exc:
        raise ConfigError(f"--out {out}: cannot write in {directory} ({exc.strerror}); choose a writable "
                          f"--out") from None
    os.close(fd)
    os.unlink(name)


def check_corpus(data: str, seq_len: int, flag: str = "--data ", held_out: bool = False) -> None:
    """The corpus files of --data exist, can be read, and can hold one training and one evaluation sequence (a
    held-out set: one sequence). `flag` starts each message."""
    # the standard library; a prepared corpus or Megatron's indexed dataset: their tokens are checked as they load
    if data == "default" or is_prepared_dir(data) or megatron_prefix(data) or parse_hub(data):
        return  # (a hub dataset: whether it streams is known when it is read)
    files = resolve_text_files(data)
    unreadable = [f for f in files if not os.access(f, os.R_OK)]
    if unreadable:
        raise ConfigError(f"{flag}{data}: cannot read {unreadable[0]} (permission denied)")
    size = sum(f.stat().st_size for f in files)
    # At most 3 tokens per byte (an undecodable byte becomes U+FFFD, 3 bytes of UTF-8), plus the
    # end-of-document token after each file: a bound no tokenizer exceeds.
    most, need = 3 * size + len(files), (1 if held_out else 2) * (seq_len + 1)
    if most < need:
        what = "is empty" if size == 0 else f"holds {size} bytes"
        needs = "one sequence" if held_out else "one training and one evaluation sequence"
        raise ConfigError(f"{flag}{data} {what} ({len(files)} file(s)): {needs} of --seq-len {seq_len} need {need} "
                          f"tokens; add text or lower --seq-len")


def check_tokenizer(spec: str) -> None:
    """A tokenizer given as a file or directory must load (a corrupt tokenizer.json is refused here)."""
    if spec in ("auto", "byte") or re.fullmatch(r"bpe:\d+", spec):
        return
    load_tokenizer(spec)  # DataError naming the file and what is wrong with it


def tokenizer_vocab(data: str, spec: str) -> int:
    """The vocabulary of the run's tokenizer (`spec` as `tokenizer_spec` resolved it) where it is known without
    tokenizing: a prepared corpus's own, the byte tokenizer's, a tokenizer file's; 0 where only loading the data
    tells (bpe:N, trained on it to at most N tokens; `resolve_model_config` checks it then again)."""
    if spec == "auto":  # every source a prepared directory (`tokenizer_spec`): the first one's tokenizer
        first = (parse_mixture(data) or [None])[0]
        return open_prepared(first.path if first else data)[2].vocab_size
    if spec == "byte":
        return ByteTokenizer.vocab_size
    return 0 if re.fullmatch(r"bpe:\d+", spec) else load_tokenizer(spec).vocab_size
