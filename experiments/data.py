"""Deterministic, resumable token streams for the round engine, on Grain.

One round is H inner steps on each of R replicas; the engine takes token windows shaped
``[R, H, B, L + 1]`` (int32; inputs ``w[..., :-1]``, targets ``w[..., 1:]``).
:attr:`ReplicaStreams.dataset` is a Grain ``MapDataset`` whose element k is round k, zipped
from one pipeline per (replica, data shard) (:mod:`experiments.pipeline`): corpora are cut into
windows, shuffled by seed and dealt out so that replicas read disjoint windows; the Markov
source draws each replica's round from its own stream. Every round is a pure function of
``(seed, k)``, so :meth:`ReplicaStreams.round_batch` reads round k directly, and
:meth:`ReplicaStreams.iterator` (a Grain iterator that draws the next round in a thread) saves
its position with the checkpoint and resumes at exactly the round an uninterrupted run reads.

Randomness: replica ``r`` of round ``k`` of a Markov stream draws from
``np.random.default_rng([seed, 0, k, r])``; the held-out batch from ``default_rng([seed, 1])``;
a corpus pool's shuffle from ``SeedSequence([seed, 2, pool])``. The second word separates the
domains, so training and evaluation never share a stream (SeedSequence zero-pads short keys,
so a length difference alone would not be enough).

Sources: :class:`MarkovSource` (synthetic, with a known entropy rate: the loss floor),
:class:`Corpus` (any flat token array), :class:`ByteText` (bytes of text files, vocab 256;
:func:`stdlib_corpus` lists a real corpus present on every machine) and :class:`TokenFile`
(pre-tokenized flat ``.bin``), in :mod:`experiments.sources`. :func:`make_streams` builds
streams from a config dict.

Example:
  >>> src = MarkovSource(vocab_size=32, branching=4, seed=0)
  >>> streams = ReplicaStreams(src, replicas=2, batch=4, seq_len=8, steps_per_round=4, seed=0,
  ...                          data_shards=2)
  >>> x = streams.round_batch(5)
  >>> x.shape, x.dtype
  ((2, 4, 4, 9), dtype('int32'))
  >>> bool((x == streams.round_batch(5)).all()), bool((x == streams.round_batch(6)).all())
  (True, False)
  >>> it = streams.iterator(start=5)
  >>> bool((next(it) == x).all()), it.get_state()
  (True, {'next_index': 6})
  >>> bool(0 < streams.entropy_rate < np.log(4))
  True
"""

from __future__ import annotations

import math
import sys
from collections.abc import Iterator, Mapping
from typing import Any

import grain
import numpy as np

from experiments import pipeline
from experiments.sources import (
    ByteText,
    Corpus,
    MarkovSource,
    TokenFile,
    checked_int,
    skipped_note,
    stdlib_corpus,
)

KINDS = ("markov", "text", "stdlib", "tokens")
__all__ = [
    "KINDS",
    "ByteText",
    "Corpus",
    "MarkovSource",
    "ReplicaStreams",
    "TokenFile",
    "make_streams",
    "stdlib_corpus",
]


class ReplicaStreams:
    """Per-replica token windows, a pure function of ``(seed, round_index)``.

    Windows are ``L + 1 = seq_len + 1`` tokens. A corpus is split into a training part and a
    held-out tail (the last ``eval_fraction`` of its tokens), which training never reads.

    * ``iid=True``: Markov: every replica draws from all sources with its own stream, each
      window from a source picked uniformly. Corpora: the training windows of all sources
      (``(n - 1) // L`` of ``L + 1`` tokens at stride L per source) form one pool, shuffled by
      seed each epoch and dealt out in turn, so the replicas read disjoint windows.
    * ``iid=False``: replica r draws only from ``sources[r % len(sources)]`` (replicas sharing
      a corpus deal its windows out between them); with one corpus, replica r instead reads
      the r-th of R disjoint contiguous shards of its training part (so replicas see different
      files/regions). One Markov source cannot be non-iid.

    ``data_shards`` = D splits each step's batch B into D parts of ``B / D`` rows, one Grain
    pipeline each (the ``data`` mesh axis's devices; a replica's windows do not depend on D).

    ``entropy_rate`` (Markov only, else None) is the mean of the sources' rates over replicas,
    ``mean_r H(sources[r % S])`` non-iid and ``mean_s H(sources[s])`` iid: the expected loss of
    the ideal predictor (given the sequence's chain) on a training and on an eval batch.
    """

    def __init__(
        self,
        sources,
        replicas: int,
        batch: int,
        seq_len: int,
        steps_per_round: int,
        seed: int = 0,
        iid: bool = True,
        eval_fraction: float = 0.05,
        data_shards: int = 1,
    ):
        one = isinstance(sources, MarkovSource | Corpus)
        self.sources = (sources,) if one else tuple(sources)
        if not self.sources or not all(isinstance(s, MarkovSource | Corpus) for s in self.sources):
            raise ValueError("sources: must be one or more MarkovSource or Corpus objects")
        kinds = {isinstance(s, MarkovSource) for s in self.sources}
        if len(kinds) > 1:
            raise ValueError("sources: cannot mix MarkovSource and Corpus objects")
        self.markov = kinds.pop()
        self.replicas = r_ = checked_int("replicas", replicas, 1)
        self.batch = checked_int("batch", batch, 1)
        self.seq_len = checked_int("seq_len", seq_len, 1)
        self.steps_per_round = checked_int("steps_per_round", steps_per_round, 1)
        self.seed, self.iid = checked_int("seed", seed, 0), bool(iid)
        self.data_shards = checked_int("data_shards", data_shards, 1)
        if self.batch % self.data_shards:
            raise ValueError(
                f"batch={self.batch}: must be a multiple of data_shards={self.data_shards}"
            )
        if not 0 < eval_fraction < 1:
            raise ValueError(f"eval_fraction={eval_fraction!r}: must be in (0, 1)")
        n_src, w = len(self.sources), self.seq_len + 1
        own = [r % n_src for r in range(r_)]
        if self.markov:
            if not iid and n_src == 1 and r_ > 1:
                raise ValueError("sources: non-iid Markov streams need several MarkovSources")
            self._pools = [[(s, 0, 0) for s in ([o] if not iid else range(n_src))] for o in own]
            self._eval = self._pools[0]
            self.dataset = self._markov_dataset()
            return
        train, self._eval = [], []
        for s, src in enumerate(self.sources):
            n = len(src)
            cut = n - math.ceil(eval_fraction * n)
            if min(cut, n - cut) < w:
                raise ValueError(
                    f"seq_len={self.seq_len}: corpus {src.name} has {n} tokens; its training "
                    f"part ({cut}) and held-out tail ({n - cut}, eval_fraction={eval_fraction}) "
                    f"each need >= seq_len + 1 = {w}"
                )
            train.append((s, 0, cut))
            self._eval.append((s, cut, n))
        if iid:
            self._pools = [train] * r_
        elif n_src > 1:
            self._pools = [[train[o]] for o in own]
        else:
            cut = train[0][2]
            bounds = [round(i * cut / r_) for i in range(r_ + 1)]
            if min(np.diff(bounds)) < w:
                raise ValueError(
                    f"seq_len={self.seq_len}: non-iid shards of corpus {self.sources[0].name} "
                    f"are {min(np.diff(bounds))} tokens, need >= seq_len + 1 = {w}"
                )
            self._pools = [[(0, bounds[r], bounds[r + 1])] for r in range(r_)]
        self.dataset = self._corpus_dataset()

    def _markov_dataset(self) -> grain.MapDataset:
        shape, rows = self.shape[1:], self.batch // self.data_shards

        def draw(k: int, r: int) -> np.ndarray:
            rng = np.random.default_rng([self.seed, 0, k, r])
            return self._draw(rng, self._pools[r], math.prod(shape[:2])).reshape(shape)

        replicas = [pipeline.MarkovRounds(lambda k, r=r: draw(k, r)) for r in range(self.replicas)]
        return pipeline.rounds(
            [[pipeline.markov_shard(m, d, rows) for d in range(self.data_shards)] for m in replicas]
        )

    def _corpus_dataset(self) -> grain.MapDataset:
        readers: dict[tuple, list[int]] = {}  # a pool of windows -> the replicas reading it
        for r, pool in enumerate(self._pools):
            readers.setdefault(tuple(pool), []).append(r)
        shards: list[list] = [[] for _ in range(self.replicas)]
        for n, (pool, group) in enumerate(readers.items()):
            parts = [(self.sources[s].tokens, a, b) for s, a, b in pool]
            windows = pipeline.Windows(parts, self.seq_len + 1)
            seed = pipeline.shuffle_seed(self.seed, n)
            for position, r in enumerate(group):
                shards[r] = [
                    pipeline.window_shard(
                        windows,
                        seed,
                        position,
                        len(group),
                        d,
                        self.data_shards,
                        self.batch // self.data_shards,
                        self.steps_per_round,
                    )
                    for d in range(self.data_shards)
                ]
        return pipeline.rounds(shards)

    @property
    def vocab_size(self) -> int:
        return max(s.vocab_size for s in self.sources)

    @property
    def entropy_rate(self) -> float | None:
        if not self.markov:
            return None
        return float(np.mean([self.sources[s].entropy_rate for p in self._pools for s, _, _ in p]))

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return (self.replicas, self.steps_per_round, self.batch, self.seq_len + 1)

    def _draw(self, rng: np.random.Generator, pool: list, n: int) -> np.ndarray:
        w = self.seq_len + 1
        if len(pool) == 1:
            which = np.zeros(n, np.int64)
        else:
            weight = np.array([1.0 if self.markov else b - a - w + 1 for _, a, b in pool])
            which = rng.choice(len(pool), size=n, p=weight / weight.sum())
        out = np.empty((n, w), np.int32)
        for i, (s, a, b) in enumerate(pool):
            rows = np.flatnonzero(which == i)
            if not rows.size:
                continue
            if self.markov:
                out[rows] = self.sources[s].sample(rng, rows.size, w)
            else:
                start = rng.integers(a, b - w + 1, size=rows.size)
                out[rows] = self.sources[s].tokens[start[:, None] + np.arange(w)]
        return out

    def round_batch(self, round_index: int) -> np.ndarray:
        """``[R, H, B, seq_len + 1]`` int32 windows of round ``round_index`` (read directly)."""
        return self.dataset[checked_int("round_index", round_index, 0)]

    def iterator(self, start: int = 0) -> grain.DatasetIterator:
        """A Grain iterator over the rounds from ``start`` on, drawing the next one in a
        thread (:data:`experiments.pipeline.READ_OPTIONS`). Its state, ``{"next_index": k}``,
        is the next round it yields: save it with ``grain.checkpoint.CheckpointSave``."""
        it = iter(self.dataset.to_iter_dataset(pipeline.READ_OPTIONS))
        if checked_int("start", start, 0):
            it.set_state({"next_index": start})
        return it

    def rounds(self, start: int = 0) -> Iterator[tuple[int, np.ndarray]]:
        """``(k, round_batch(k))`` for k = start, start + 1, ... (from :meth:`iterator`)."""
        yield from enumerate(self.iterator(start), start)

    def eval_batch(self, n: int, seed: int | None = None) -> np.ndarray:
        """``[n, seq_len + 1]`` held-out windows, fixed by ``seed`` (default: the stream seed).

        Corpora: windows inside the held-out tails, sources weighted by their tail windows.
        Markov: fresh chains from an independent stream; non-iid, window j comes from the
        source of replica ``j % R`` (so the mean rate is ``entropy_rate``).
        """
        n = checked_int("n", n, 1)
        rng = np.random.default_rng(
            [self.seed if seed is None else checked_int("seed", seed, 0), 1]
        )
        if not (self.markov and not self.iid):
            return self._draw(rng, self._eval, n)
        out = np.empty((n, self.seq_len + 1), np.int32)
        for r in range(min(n, self.replicas)):
            rows = np.arange(r, n, self.replicas)
            out[rows] = self._draw(rng, self._pools[r], rows.size)
        return out


_OPTIONS = {
    "replicas", "steps_per_round", "batch", "seq_len", "seed", "iid", "eval_fraction",
    "path", "vocab_size", "branching", "temperature", "token_dtype", "max_bytes", "source_seed",
    "data_shards",
}  # fmt: skip


def make_streams(kind: str | Mapping[str, Any], /, **options: Any) -> ReplicaStreams:
    """Streams from a kind and options, or from one dict holding ``kind`` (e.g.
    ``dataclasses.asdict(config.data)``) plus keyword extras such as ``replicas`` and
    ``steps_per_round`` (both required). Options a kind does not use are ignored.

    * ``markov``: ``vocab_size`` (64), ``branching`` (4), ``temperature`` (1.0),
      ``source_seed`` (``seed``); non-iid builds one chain per replica, seeds
      ``[source_seed, r]``.
    * ``text``: ``path`` (file, directory, glob or list), ``max_bytes`` (None); files that are
      not text (:func:`experiments.sources.is_text`) are skipped with a one-line warning on
      stderr saying how many, and a path with no text file is refused.
    * ``stdlib``: ``max_bytes`` (20 MB) of :func:`stdlib_corpus`.
    * ``tokens``: ``path`` to a ``.bin``, ``token_dtype`` ('auto': its sidecar's, else
      uint16), ``vocab_size`` (default: the sidecar's, else max id + 1; one that disagrees
      with the sidecar is refused). :mod:`experiments.tokenize_corpus` writes both files.

    Common: ``batch`` (8), ``seq_len`` (64), ``seed`` (0), ``iid`` (True),
    ``eval_fraction`` (0.05), ``data_shards`` (1: the pipelines per replica, ``batch`` split
    over them). Bad input raises ValueError naming the field.
    """
    if isinstance(kind, Mapping):
        options = {**kind, **options}
        kind = options.pop("kind", None)
    unknown = sorted(set(options) - _OPTIONS)
    if unknown:
        raise ValueError(f"{unknown[0]}={options[unknown[0]]!r}: unknown data option")
    if kind not in KINDS:
        raise ValueError(f"kind={kind!r}: must be one of {KINDS}")
    for name in ("replicas", "steps_per_round"):
        if name not in options:
            raise ValueError(f"{name}: is required")
    o = {"batch": 8, "seq_len": 64, "seed": 0, "iid": True, "eval_fraction": 0.05} | options
    o.setdefault("data_shards", 1)
    names = ("replicas", "batch", "seq_len", "steps_per_round", "seed", "iid", "data_shards")
    common = {k: o[k] for k in names}
    for name in ("replicas", "batch", "seq_len", "steps_per_round", "seed", "source_seed"):
        checked_int(name, o.get(name, 0), 0 if "seed" in name else 1)  # before loading anything
    vocab, path = o.get("vocab_size"), o.get("path")
    if kind in ("text", "tokens") and not path:
        raise ValueError(f"path={path!r}: is required for kind={kind!r}")
    if kind == "markov":
        args = (o.get("vocab_size", 64), o.get("branching", 4))
        seed, temp = o.get("source_seed", o["seed"]), o.get("temperature", 1.0)
        seeds = [seed] if o["iid"] else [[seed, r] for r in range(common["replicas"])]
        sources = [MarkovSource(*args, seed=s, temperature=temp) for s in seeds]
    elif kind in ("text", "stdlib"):
        if vocab is not None and checked_int("vocab_size", vocab, 1) < 256:
            raise ValueError(f"vocab_size={vocab}: byte-level text needs vocab_size >= 256")
        cap = o.get("max_bytes", None if kind == "text" else 20_000_000)
        if kind == "stdlib":  # a fixed corpus, read as it is (a few files there are Latin-1)
            sources = [ByteText(stdlib_corpus(cap), max_bytes=cap, text_only=False)]
        else:
            sources = [ByteText(path, max_bytes=cap)]
            if sources[0].skipped:
                n, kept = sum(sources[0].skipped.values()), len(sources[0].paths)
                print(
                    f"warning: data.path={path}: skipped {n} of {n + kept} files "
                    f"({skipped_note(sources[0].skipped)}); reading the other {kept}",
                    file=sys.stderr,
                )
    else:
        dtype = o.get("token_dtype", "auto")
        if dtype not in ("auto", "uint16", "uint32"):
            raise ValueError(f"token_dtype={dtype!r}: must be 'auto', 'uint16' or 'uint32'")
        try:
            sources = [TokenFile(path, dtype, vocab)]
        except ValueError as e:  # named as this function's options
            message = str(e)
            raise ValueError(
                "token_" + message if message.startswith("dtype=") else message
            ) from None
    return ReplicaStreams(sources, eval_fraction=o["eval_fraction"], **common)
