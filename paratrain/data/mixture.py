"""Mixtures of corpora: which source each sample of the global stream comes from.

    --data "0.7:web.jsonl.gz,0.3:code/"         # weights, each source anything --data takes
    --eval-data wiki=wiki.parquet --eval-data code=code-eval/   # named held-out sets, each its own eval loss

The global sample stream (`DataSampler`'s: step k reads positions [k·B, (k+1)·B), data rank r
its contiguous share) is dealt out to the sources in a fixed pattern of `PERIOD` positions in
which source i holds n_i = its weight's share of the slots, spread evenly (smooth weighted
round robin). Position p belongs to source ``pattern[p % PERIOD]``, and is that source's
c-th sample, c = (p // PERIOD)·n_i + the source's slots before p within its period; c runs
through the source's own epochs of shuffled samples (seeded by (seed, source, epoch)). Every
quantity is a function of p alone: any layout, any number of data ranks and a resume see the
same stream, and the sampler's state is one integer, the position.

Each source keeps its own held-out tail (`split_train_eval`); a mixture's eval loss is the
weighted mean of its sources' eval losses, each also logged under the source's name.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np
import torch

from paratrain.errors import DataError
from paratrain.data.chat import ChatOptions
from paratrain.data.dataset import PackedDataset, build_dataset, load_token_stream, sequences
from paratrain.data.prepare import is_prepared_dir
from paratrain.data.sampler import DataSampler

PERIOD = 1000  # slots of the pattern: weights are kept to 0.001
_WEIGHTED = re.compile(r"\s*([^:,\s]*)\s*:(.+)")
_NAME = re.compile(r"[A-Za-z0-9_.-]+")


@dataclass(frozen=True)
class Source:
    """One corpus of a mixture: its name (for metrics), path and share of the samples."""

    name: str
    path: str
    weight: float


def parse_mixture(spec: str) -> list[Source] | None:
    """The sources of ``--data "W:PATH,W:PATH"``, weights normalized to sum 1; None for a single corpus.

    A --data value is a mixture when its first entry starts with a number and a colon.
    """
    entries = spec.split(",")
    first_weight, colon, _ = entries[0].partition(":")
    if not colon or not _is_number(first_weight.strip()):
        return None
    sources = []
    for entry in entries:
        match = _WEIGHTED.fullmatch(entry)
        if match is None or not match.group(2).strip():
            raise DataError(f"--data {spec!r}: entry {entry.strip()!r} is not WEIGHT:SOURCE; write every source of "
                            f"a mixture as WEIGHT:SOURCE, e.g. 0.7:a.jsonl,0.3:b/")
        weight = float(match.group(1)) if _is_number(match.group(1)) else float("nan")
        if not weight > 0 or weight == float("inf"):
            raise DataError(f"--data {spec!r}: weight {match.group(1)!r} of {match.group(2).strip()!r} is not a "
                            f"positive number")
        sources.append((weight, match.group(2).strip()))
    total = sum(w for w, _ in sources)
    names = _unique_names([path for _, path in sources])
    mixture = [Source(name, path, w / total) for name, (w, path) in zip(names, sources)]
    if any(s.weight < 1 / PERIOD for s in mixture):
        raise DataError(f"--data {spec!r}: every share must be at least {1 / PERIOD} of the mixture")
    return mixture


def parse_eval_data(spec: str) -> list[tuple[str, str]]:
    """[(name, path)] of ``--eval-data NAME=PATH,...`` (the option repeated joins with commas)."""
    out = []
    for entry in filter(None, (e.strip() for e in spec.split(","))):
        name, sep, path = entry.partition("=")
        if not sep or not _NAME.fullmatch(name.strip()) or not path.strip():
            raise DataError(f"--eval-data {entry!r}: write NAME=PATH (NAME of letters, digits, '_', '-', '.')")
        out.append((name.strip(), path.strip()))
    names = [name for name, _ in out]
    if len(set(names)) != len(names):
        raise DataError(f"--eval-data names {names} repeat a name; give each held-out set its own")
    return out


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _unique_names(paths: Sequence[str]) -> list[str]:
    """A short name per source for metrics: its file or directory name without suffixes, numbered if repeated."""
    stems = [re.sub(r"[^A-Za-z0-9_.-]+", "_", Path(p.rstrip("/")).name.split(".")[0] or "source") for p in paths]
    return [stem if stems.count(stem) == 1 else f"{stem}{stems[:i].count(stem)}" for i, stem in enumerate(stems)]


def slot_counts(weights: Sequence[float]) -> np.ndarray:
    """Slots of each source in one period: largest remainders of weight·PERIOD, each at least 1."""
    exact = np.asarray(weights, dtype=np.float64) * PERIOD
    counts = np.maximum(np.floor(exact).astype(np.int64), 1)
    order = np.argsort(-(exact - np.floor(exact)), kind="stable")
    for i in order[:max(0, PERIOD - int(counts.sum()))]:
        counts[i] += 1
    while counts.sum() > PERIOD:  # the minimum of 1 pushed the sum over: take from the largest
        counts[np.argmax(counts)] -= 1
    return counts


def slot_pattern(counts: np.ndarray) -> np.ndarray:
    """The sources of one period's slots, each source's slots spread evenly (smooth weighted round robin)."""
    current, pattern = np.zeros(len(counts), dtype=np.int64), np.empty(PERIOD, dtype=np.int64)
    for slot in range(PERIOD):
        current += counts
        chosen = int(np.argmax(current))
        current[chosen] -= PERIOD
        pattern[slot] = chosen
    return pattern


class MixtureSampler:
    """`DataSampler`'s interface over a mixture: global sample ids into `MixtureDataset`'s concatenated index."""

    def __init__(self, sizes: Sequence[int], weights: Sequence[float], global_batch: int, dp_rank: int = 0,
                 dp_size: int = 1, seed: int = 0, shuffle: bool = True):
        DataSampler(1, global_batch, dp_rank, dp_size, seed, shuffle)  # the same argument checks
        if any(int(n) < 1 for n in sizes):
            raise DataError(f"every source of a mixture needs at least one training sequence; sizes {list(sizes)}")
        self.sizes = [int(n) for n in sizes]
        self.weights = [float(w) for w in weights]
        self.offsets = np.concatenate(([0], np.cumsum(self.sizes)[:-1])).astype(np.int64)
        self.global_batch, self.local_batch = int(global_batch), int(global_batch) // int(dp_size)
        self.dp_rank, self.seed, self.shuffle = int(dp_rank), int(seed), bool(shuffle)
        self.counts = slot_counts(self.weights)
        self.pattern = slot_pattern(self.counts)
        # before[i, j]: slots of source i among the period's first j
        self.before = np.zeros((len(self.sizes), PERIOD + 1), dtype=np.int64)
        for i in range(len(self.sizes)):
            self.before[i, 1:] = np.cumsum(self.pattern == i)
        self.samples_consumed = 0
        self._perms: dict[int, tuple[int, np.ndarray]] = {}

    def next_batch(self) -> list[int]:
        """This rank's sample ids of the next step; advances by one global batch."""
        ids = self._read(self.samples_consumed + self.dp_rank * self.local_batch, self.local_batch)
        self.samples_consumed += self.global_batch
        return ids

    def __iter__(self) -> Iterator[list[int]]:
        while True:
            yield self.next_batch()

    def source_counts(self, start: int, count: int) -> np.ndarray:
        """Samples of each source at global positions [start, start + count)."""
        return np.bincount(self.pattern[np.arange(start, start + count) % PERIOD], minlength=len(self.sizes))

    def ids(self, start: int, count: int) -> list[int]:
        """The sample ids (into `MixtureDataset`'s index) at global positions [start, start + count)."""
        return self._read(start, count)

    def _read(self, start: int, count: int) -> list[int]:
        positions = np.arange(start, start + count, dtype=np.int64)
        sources = self.pattern[positions % PERIOD]
        nth = (positions // PERIOD) * self.counts[sources] + self.before[sources, positions % PERIOD]
        out = []
        for source, n in zip(sources.tolist(), nth.tolist()):
            epoch, pos = divmod(n, self.sizes[source])
            out.append(int(self.offsets[source] + self._permutation(source, epoch)[pos]))
        return out

    def _permutation(self, source: int, epoch: int) -> np.ndarray:
        """The order of a source's samples in its `epoch`: a function of (seed, source, epoch) alone."""
        cached = self._perms.get(source)
        if cached is None or cached[0] != epoch:
            n = self.sizes[source]
            perm = (np.random.default_rng([self.seed, source, epoch]).permutation(n) if self.shuffle
                    else np.arange(n, dtype=np.int64))
            self._perms[source] = cached = (epoch, perm)
        return cached[1]

    def state_dict(self) -> dict:
        return {"position": self.samples_consumed, "seed": self.seed, "sizes": list(self.sizes),
                "weights": list(self.weights), "global_batch": self.global_batch, "shuffle": int(self.shuffle)}

    def load_state_dict(self, state: dict) -> None:
        if "sizes" not in state:
            raise DataError("the checkpoint's data stream is a single corpus, this run's a mixture; start a new "
                            "stage on the mixture with --reset data")
        for key, mine in (("sizes", self.sizes), ("seed", self.seed), ("shuffle", int(self.shuffle))):
            if state.get(key) != mine:
                raise DataError(f"sampler state has {key}={state.get(key)} but this run has {key}={mine}; resume "
                                f"with the same mixture, or start a new stage on this data with --reset data")
        if not np.allclose(state.get("weights", []), self.weights):
            raise DataError(f"the checkpoint's mixture weights {state.get('weights')} differ from this run's "
                            f"{self.weights}; resume with the same weights, or start a new stage with --reset data")
        self.samples_consumed = int(state["position"])


class MixtureDataset:
    """The sources' `SequenceDataset`s behind one index: source i's samples at [offsets[i], offsets[i] + len_i)."""

    def __init__(self, datasets: Sequence, names: Sequence[str]):
        self.datasets, self.names = list(datasets), list(names)
        self.offsets = np.cumsum([0] + [len(d) for d in self.datasets])
        self.seq_len = self.datasets[0].seq_len
        self.stream = self.datasets[0].stream  # what `describe` reads the unigram entropy from: the first source

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def targets_by_source(self, indices: Sequence[int]) -> np.ndarray:
        """The target tokens (the labels the loss counts) of the samples `indices`, summed per source."""
        idx = np.asarray(indices, dtype=np.int64).reshape(-1)
        which = np.searchsorted(self.offsets, idx, side="right") - 1
        return np.asarray([int(self.datasets[s].targets(idx[which == s] - self.offsets[s]).sum())
                           for s in range(len(self.datasets))], dtype=np.int64)

    def get_batch(self, indices: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        idx = np.asarray(indices, dtype=np.int64).reshape(-1)
        which = np.searchsorted(self.offsets, idx, side="right") - 1
        inputs = torch.empty(len(idx), self.seq_len, dtype=torch.int64)
        labels = torch.empty_like(inputs)
        for source in np.unique(which):
            rows = np.flatnonzero(which == source)
            x, y = self.datasets[source].get_batch((idx[rows] - self.offsets[source]).tolist())
            inputs[rows], labels[rows] = x, y
        return inputs, labels


@dataclass
class TrainingData:
    """What a run trains and evaluates on: the training samples, the held-out sets, the tokenizer.

    `held_out`: {name: held-out tail} of each training source ("" for a single corpus), whose
    `weights`-weighted mean is the run's eval loss; `extra`: the named --eval-data sets.
    `sources`: the mixture's source names in sampler order (None for a single corpus).
    """

    train: object
    held_out: dict
    weights: dict
    extra: dict
    tokenizer: object
    sources: list | None = None

    @property
    def chat(self) -> bool:
        """Whether any training source is chat data (packed conversations)."""
        return any(isinstance(d, PackedDataset) for d in getattr(self.train, "datasets", [self.train]))

    def describe(self, loss_on: str) -> str:
        """What the run reads, for its first line: text, or chat data with its conversations and what was left out."""
        parts = []
        for name, d in zip(self.sources or [""], getattr(self.train, "datasets", [self.train])):
            label = f"{name}: " if name else ""
            if not isinstance(d, PackedDataset):
                parts.append(f"{label}text")
                continue
            left = [f"{n} {what}" for n, what in ((d.dropped, "dropped"), (d.truncated, "truncated")) if n]
            parts.append(f"{label}chat data, {d.conversations:,} conversations packed, loss on {loss_on}"
                         + (f" ({', '.join(left)} as longer than a sequence: --long)" if left else ""))
        return ", ".join(parts)

    @property
    def eval_sets(self) -> dict:
        """Every held-out set by the name its loss is logged under."""
        return {**self.held_out, **self.extra}

    def sampler(self, global_batch: int, dp_rank: int, dp_size: int, seed: int):
        """This data rank's sampler of `train`: a mixture's positions dealt to its sources, or one corpus's."""
        if self.sources:
            return MixtureSampler([len(d) for d in self.train.datasets], [self.weights[n] for n in self.sources],
                                  global_batch, dp_rank, dp_size, seed=seed)
        return DataSampler(len(self.train), global_batch, dp_rank, dp_size, seed=seed)


def load_training_data(data: str, eval_data: str, tokenizer_spec: str, seq_len: int, cache_dir=None, *,
                       eval_fraction: float = 0.02, progress: bool = True, text_key: str = "text",
                       chat: ChatOptions | None = None) -> TrainingData:
    """The corpus (or mixture) of --data split into train and held-out tails, and the --eval-data sets; each
    source text or chat (`chat`: detected per source by default)."""
    chat = chat or ChatOptions()
    mixture = parse_mixture(data)
    if mixture is not None and tokenizer_spec.startswith("bpe:"):
        raise DataError(f"--tokenizer {tokenizer_spec} with a mixture: train one tokenizer for every source first "
                        f"(`paratrain prepare SOURCE OUT --tokenizer {tokenizer_spec}`), then pass its tokenizer.json")
    options = dict(eval_fraction=eval_fraction, progress=progress, text_key=text_key, chat=chat)
    first_path = data if mixture is None else mixture[0].path
    if mixture is None:
        train, held_out, tokenizer = build_dataset(data, tokenizer_spec, seq_len, cache_dir, **options)
        data_sets, held_out, weights, sources = train, {"": held_out}, {"": 1.0}, None
    else:
        trains, held_out, tokenizer = [], {}, None
        for source in mixture:
            train, tail, tok = build_dataset(source.path, tokenizer_spec, seq_len, None, **options)
            tokenizer = tokenizer or tok
            _check_same_tokenizer(tokenizer, tok, mixture[0].path, source.path)
            trains.append(train)
            held_out[source.name] = tail
        names = [s.name for s in mixture]
        data_sets, weights, sources = MixtureDataset(trains, names), {s.name: s.weight for s in mixture}, names
    extra = {}
    for name, path in parse_eval_data(eval_data):
        if name in held_out:
            raise DataError(f"--eval-data {name}={path}: {name!r} already names a source of --data; pick another name")
        # a prepared set brings its own tokenizer (checked below); text is tokenized with the run's, which under
        # 'auto' is the first (prepared) source's directory
        spec = "auto" if is_prepared_dir(path) else tokenizer_spec if tokenizer_spec != "auto" else first_path
        stream, tok = load_token_stream(path, spec, None, progress=progress, text_key=text_key, chat=chat)
        _check_same_tokenizer(tokenizer, tok, data, path)
        held = sequences(stream, seq_len, chat.long)
        if len(held) == 0:
            raise DataError(f"--eval-data {name}={path} holds {len(stream)} tokens, fewer than one sequence of "
                            f"--seq-len {seq_len}")
        extra[name] = held
    return TrainingData(data_sets, held_out, weights, extra, tokenizer, sources)


def _check_same_tokenizer(first, other, first_path: str, other_path: str) -> None:
    if (first.spec, first.vocab_size) != (other.spec, other.vocab_size):
        raise DataError(f"{other_path} is tokenized with {other.spec} ({other.vocab_size} tokens) but {first_path} "
                        f"with {first.spec} ({first.vocab_size}); every source must share one tokenizer: pass "
                        f"--tokenizer")
