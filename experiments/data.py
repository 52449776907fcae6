"""Deterministic, resumable token streams for the round engine.

One round is H inner steps on each of R replicas; the engine takes token windows shaped
``[R, H, B, L + 1]`` (int32; inputs ``w[..., :-1]``, targets ``w[..., 1:]``).
:meth:`ReplicaStreams.round_batch` is a pure function of ``(seed, round_index)`` and the source
definition, so the stream position *is* the round index: resuming at round ``k`` is calling
``round_batch(k)``; there is no iterator state to checkpoint.

Randomness: replica ``r`` of round ``k`` draws from ``np.random.default_rng([seed, 0, k, r])``;
the held-out batch from ``default_rng([seed, 1])``. The second word separates the two domains,
so training and evaluation never share a stream (SeedSequence zero-pads short keys, so a
length difference alone would not be enough).

Sources: :class:`MarkovSource` (synthetic, with a known entropy rate: the loss floor),
:class:`Corpus` (any flat token array), :class:`ByteText` (bytes of text files, vocab 256;
:func:`stdlib_corpus` lists a real corpus present on every machine) and :class:`TokenFile`
(pre-tokenized flat ``.bin``). :func:`make_streams` builds streams from a config dict.

Example:
  >>> src = MarkovSource(vocab_size=32, branching=4, seed=0)
  >>> streams = ReplicaStreams(src, replicas=2, batch=3, seq_len=8, steps_per_round=4, seed=0)
  >>> x = streams.round_batch(5)
  >>> x.shape, x.dtype
  ((2, 4, 3, 9), dtype('int32'))
  >>> bool((x == streams.round_batch(5)).all()), bool((x == streams.round_batch(6)).all())
  (True, False)
  >>> bool(0 < streams.entropy_rate < np.log(4))
  True
"""

from __future__ import annotations

import glob
import math
import os
import sysconfig
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

KINDS = ("markov", "text", "stdlib", "tokens")
_CHUNK = 1 << 24


def _int(name: str, value: Any, lo: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise ValueError(f"{name}={value!r}: must be an integer")
    if value < lo:
        raise ValueError(f"{name}={value!r}: must be >= {lo}")
    return int(value)


class MarkovSource:
    """Sparse random first-order Markov chain with an analytic entropy rate.

    Row ``i`` of the transition matrix ``P`` has ``branching`` = k nonzero entries: a self-loop
    ``i -> i``, a successor ``i -> sigma(i)`` on one random cycle through all ``vocab_size``
    tokens, and k - 2 further distinct random tokens. The cycle makes the chain irreducible and
    the self-loop makes it aperiodic, so the stationary distribution ``pi`` (``pi P = pi``) is
    unique and every chain started anywhere converges to it. Row probabilities are
    ``softmax(z / temperature)`` with ``z ~ N(0, 1)`` (logits floored at ``max - 50`` so none
    underflows to 0); lower temperature means peakier rows and a lower entropy rate

        H = sum_i pi_i H(P_i),   H(P_i) = -sum_j P_ij log P_ij   (nats / token),

    the expected loss of the ideal next-token predictor. ``pi`` is solved exactly (dense linear
    system) for vocab_size <= 2048, in closed form ``pi_i ∝ 1 / (1 - P_ii)`` for k = 2 (a lazy
    walk on the cycle), otherwise by power iteration on the sparse rows.
    """

    def __init__(
        self,
        vocab_size: int,
        branching: int,
        seed: int | Sequence[int] = 0,
        temperature: float = 1.0,
    ):
        v = self.vocab_size = _int("vocab_size", vocab_size, 2)
        k = self.branching = _int("branching", branching, 2)
        if k > v:
            raise ValueError(f"branching={k}: must be <= vocab_size={v}")
        if not (isinstance(temperature, int | float) and 0 < temperature < math.inf):
            raise ValueError(f"temperature={temperature!r}: must be a finite number > 0")
        self.temperature = float(temperature)
        try:
            rng = np.random.default_rng(seed)
        except (TypeError, ValueError) as e:
            raise ValueError(f"seed={seed!r}: {e}") from None
        order = rng.permutation(v)
        cycle = np.empty(v, np.int64)
        cycle[order] = np.roll(order, -1)
        succ = np.empty((v, k), np.int64)
        succ[:, 0], succ[:, 1] = np.arange(v), cycle
        x = rng.integers(0, v - 2, size=(v, k - 2)) if v > 2 else np.zeros((v, 0), np.int64)
        xs = np.sort(x, 1)
        for i in np.flatnonzero((xs[:, 1:] == xs[:, :-1]).any(1)):  # redraw rows with repeats
            x[i] = rng.choice(v - 2, size=k - 2, replace=False)
        lo, hi = np.minimum(succ[:, :1], succ[:, 1:2]), np.maximum(succ[:, :1], succ[:, 1:2])
        x = x + (x >= lo)  # skip the two tokens already in the row
        succ[:, 2:] = x + (x >= hi)
        logits = rng.standard_normal((v, k)) / self.temperature
        probs = np.exp(np.maximum(logits - logits.max(1, keepdims=True), -50.0))
        self.successors = succ
        self.probs = probs / probs.sum(1, keepdims=True)
        self.stationary = _stationary(self.successors, self.probs)
        self._cum = np.cumsum(self.probs, 1)[:, :-1]
        self._pi_cum = np.cumsum(self.stationary)

    @property
    def entropy_rate(self) -> float:
        """``sum_i pi_i H(P_i)`` in nats per token."""
        row_h = -(self.probs * np.log(self.probs)).sum(1)
        return float(self.stationary @ row_h)

    def dense(self) -> np.ndarray:
        """The transition matrix ``P`` as a dense ``[V, V]`` array (for small V)."""
        p = np.zeros((self.vocab_size, self.vocab_size))
        p[np.arange(self.vocab_size)[:, None], self.successors] = self.probs
        return p

    def sample(self, rng: np.random.Generator, batch: int, length: int) -> np.ndarray:
        """``[batch, length]`` int32 sequences; the first token is drawn from ``pi``.

        Vectorized over the batch: at each position, sequence b picks successor j of its
        current row x_b as ``#{m < k - 1 : cumsum(P_{x_b})_m <= u_b}``, u_b ~ U[0, 1).
        """
        batch, length = _int("batch", batch, 1), _int("length", length, 1)
        u = rng.random((length, batch))
        x = np.minimum(np.searchsorted(self._pi_cum, u[0], side="right"), self.vocab_size - 1)
        out = np.empty((batch, length), np.int32)
        out[:, 0] = x
        for t in range(1, length):
            j = (self._cum[x] <= u[t, :, None]).sum(1)
            x = self.successors[x, j]
            out[:, t] = x
        return out

    def log_prob(self, tokens: np.ndarray) -> np.ndarray:
        """``log P(x_{t+1} | x_t)`` for every transition, shape ``[..., L - 1]`` (-inf if
        impossible)."""
        t = np.asarray(tokens)
        prev, nxt = t[..., :-1], t[..., 1:]
        p = np.where(self.successors[prev] == nxt[..., None], self.probs[prev], 0.0).sum(-1)
        with np.errstate(divide="ignore"):
            return np.log(p)


def _stationary(succ: np.ndarray, probs: np.ndarray) -> np.ndarray:
    v, k = probs.shape
    if v <= 2048:  # (P^T - I) pi = 0 has rank V - 1; replace one equation by sum(pi) = 1
        a = np.zeros((v, v))
        a[np.arange(v)[:, None], succ] = probs
        a = a.T - np.eye(v)
        a[-1] = 1.0
        pi = np.linalg.solve(a, np.eye(v)[-1])
    elif k == 2:  # flow balance on the cycle: pi_i (1 - P_ii) is the same for every i
        pi = 1.0 / (1.0 - probs[:, 0])
    else:
        pi = np.full(v, 1.0 / v)
        for _ in range(100_000):
            new = np.bincount(succ.ravel(), (pi[:, None] * probs).ravel(), minlength=v)
            delta, pi = np.abs(new - pi).sum(), new
            if delta < 1e-13:
                break
        else:
            raise RuntimeError("stationary distribution: power iteration did not converge")
    pi = np.clip(pi, 0.0, None)
    return pi / pi.sum()


def _extreme(tokens: np.ndarray, fn) -> int:
    return int(max(fn(tokens[i : i + _CHUNK]) for i in range(0, tokens.size, _CHUNK)))


class Corpus:
    """A flat 1-D array of token ids, kept as given (a memmap stays a memmap).

    ``vocab_size`` defaults to ``max token + 1`` (one chunked pass); when given and ``check``
    is true, the same pass verifies every id is in ``[0, vocab_size)``.
    """

    def __init__(self, tokens, vocab_size: int | None = None, name: str = "corpus", check=True):
        t = tokens if isinstance(tokens, np.memmap) else np.asarray(tokens)
        if t.ndim != 1 or t.size == 0 or not np.issubdtype(t.dtype, np.integer):
            raise ValueError(f"tokens: {name} must be a non-empty 1-D integer array")
        self.tokens, self.name = t, name
        if vocab_size is None or check:
            lo, hi = _extreme(t, np.min), _extreme(t, np.max)
            if lo < 0:
                raise ValueError(f"tokens: {name} holds a negative token id {lo}")
            vocab_size = hi + 1 if vocab_size is None else vocab_size
            if _int("vocab_size", vocab_size, 1) <= hi:
                raise ValueError(f"vocab_size={vocab_size}: {name} holds token id {hi}")
        self.vocab_size = _int("vocab_size", vocab_size, 1)
        if self.vocab_size > np.iinfo(np.int32).max:
            raise ValueError(f"vocab_size={vocab_size}: must fit in int32")

    def __len__(self) -> int:
        return int(self.tokens.size)

    entropy_rate = None


def _resolve(paths: str | os.PathLike | Sequence[str | os.PathLike]) -> list[Path]:
    """Files named by each entry: a file, a directory (every non-hidden file under it,
    recursively, sorted) or a glob pattern (``**`` recurses; matches sorted)."""
    entries = [paths] if isinstance(paths, str | os.PathLike) else list(paths)
    if not entries:
        raise ValueError("path=[]: no paths given")
    files: list[Path] = []
    for entry in entries:
        p = Path(entry)
        if p.is_dir():
            found = sorted(
                f
                for f in p.rglob("*")
                if f.is_file() and not any(s.startswith(".") for s in f.relative_to(p).parts)
            )
        elif p.is_file():
            found = [p]
        else:
            found = sorted(Path(f) for f in glob.glob(str(entry), recursive=True))
            found = [f for f in found if f.is_file()]
        if not found:
            raise ValueError(f"path={str(entry)!r}: matches no file")
        files += found
    return files


class ByteText(Corpus):
    """Byte-level tokens (vocab 256) of text files, concatenated in order.

    ``paths``: a file, directory or glob, or a list of them (see ``_resolve``). A single file
    is memory-mapped; several are read into one ``uint8`` array, stopping once ``max_bytes``
    (if given) are in; the result is truncated to ``max_bytes``.
    """

    def __init__(self, paths, max_bytes: int | None = None):
        self.paths = _resolve(paths)
        cap = math.inf if max_bytes is None else _int("max_bytes", max_bytes, 1)
        if sum(f.stat().st_size for f in self.paths) == 0:
            raise ValueError(f"path={str(paths)!r}: the matched files are empty")
        if len(self.paths) == 1:
            tokens = np.memmap(self.paths[0], np.uint8, mode="r")
        else:
            parts, total = [], 0
            for f in self.paths:
                if total >= cap:
                    break
                parts.append(np.fromfile(f, np.uint8))
                total += parts[-1].size
            tokens = np.concatenate(parts)
        if max_bytes is not None:
            tokens = tokens[:cap]
        super().__init__(tokens, 256, name=str(paths), check=False)


def stdlib_corpus(max_bytes: int = 20_000_000) -> list[Path]:
    """The standard library's own ``.py`` files (site-/dist-packages excluded), sorted by
    relative path; a file is kept if it still fits under ``max_bytes`` in total."""
    cap = _int("max_bytes", max_bytes, 1)
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "dist-packages", "__pycache__"}
    files = sorted(
        (f for f in root.rglob("*.py") if not skip & set(f.relative_to(root).parts)),
        key=lambda f: f.relative_to(root).as_posix(),
    )
    chosen, total = [], 0
    for f in files:
        size = f.stat().st_size if f.is_file() else 0
        if 0 < size <= cap - total:
            chosen.append(f)
            total += size
    if not chosen:
        raise ValueError(f"max_bytes={max_bytes}: no stdlib .py file under {root} fits")
    return chosen


class TokenFile(Corpus):
    """A flat pre-tokenized ``.bin`` file (``np.tofile`` of uint16 or uint32 ids), memmapped.

    ``vocab_size`` defaults to ``max id + 1``; see :class:`Corpus` for the range check.
    """

    def __init__(self, path, dtype: str = "uint16", vocab_size: int | None = None, check=True):
        try:
            name = np.dtype(dtype).name
        except TypeError:
            name = None
        if name not in ("uint16", "uint32"):
            raise ValueError(f"dtype={dtype!r}: must be 'uint16' or 'uint32'")
        p = Path(path)
        if not p.is_file():
            raise ValueError(f"path={str(path)!r}: is not a file")
        size, item = p.stat().st_size, np.dtype(name).itemsize
        if size == 0 or size % item:
            raise ValueError(
                f"path={str(path)!r}: {size} bytes is not a positive multiple of the "
                f"{name} itemsize {item} (wrong dtype?)"
            )
        self.path = p
        super().__init__(np.memmap(p, name, mode="r"), vocab_size, name=str(p), check=check)


class ReplicaStreams:
    """Per-replica token windows, a pure function of ``(seed, round_index)``.

    Windows are ``L + 1 = seq_len + 1`` tokens. A corpus is split into a training part and a
    held-out tail (the last ``eval_fraction`` of its tokens), which training never reads.

    * ``iid=True``: every replica draws from all sources with its own stream: each window
      picks a source (Markov: uniformly; corpora: in proportion to their number of training
      windows) and then a fresh chain sample or a uniformly random offset.
    * ``iid=False``: replica r draws only from ``sources[r % len(sources)]``; with one corpus,
      replica r instead draws from the r-th of R disjoint contiguous shards of its training
      part (so replicas see different files/regions). One Markov source cannot be non-iid.

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
    ):
        one = isinstance(sources, MarkovSource | Corpus)
        self.sources = (sources,) if one else tuple(sources)
        if not self.sources or not all(isinstance(s, MarkovSource | Corpus) for s in self.sources):
            raise ValueError("sources: must be one or more MarkovSource or Corpus objects")
        kinds = {isinstance(s, MarkovSource) for s in self.sources}
        if len(kinds) > 1:
            raise ValueError("sources: cannot mix MarkovSource and Corpus objects")
        self.markov = kinds.pop()
        self.replicas = r_ = _int("replicas", replicas, 1)
        self.batch = _int("batch", batch, 1)
        self.seq_len = _int("seq_len", seq_len, 1)
        self.steps_per_round = _int("steps_per_round", steps_per_round, 1)
        self.seed, self.iid = _int("seed", seed, 0), bool(iid)
        if not 0 < eval_fraction < 1:
            raise ValueError(f"eval_fraction={eval_fraction!r}: must be in (0, 1)")
        n_src, w = len(self.sources), self.seq_len + 1
        own = [r % n_src for r in range(r_)]
        if self.markov:
            if not iid and n_src == 1 and r_ > 1:
                raise ValueError("sources: non-iid Markov streams need several MarkovSources")
            self._pools = [[(s, 0, 0) for s in ([o] if not iid else range(n_src))] for o in own]
            self._eval = self._pools[0]
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
        """``[R, H, B, seq_len + 1]`` int32 windows of round ``round_index``."""
        k = _int("round_index", round_index, 0)
        out = np.empty(self.shape, np.int32)
        for r in range(self.replicas):
            rng = np.random.default_rng([self.seed, 0, k, r])
            out[r] = self._draw(rng, self._pools[r], math.prod(self.shape[1:3])).reshape(
                self.shape[1:]
            )
        return out

    def rounds(self, start: int = 0) -> Iterator[tuple[int, np.ndarray]]:
        """``(k, round_batch(k))`` for k = start, start + 1, ...: resuming is choosing start."""
        k = _int("start", start, 0)
        while True:
            yield k, self.round_batch(k)
            k += 1

    def eval_batch(self, n: int, seed: int | None = None) -> np.ndarray:
        """``[n, seq_len + 1]`` held-out windows, fixed by ``seed`` (default: the stream seed).

        Corpora: windows inside the held-out tails, sources weighted by their tail windows.
        Markov: fresh chains from an independent stream; non-iid, window j comes from the
        source of replica ``j % R`` (so the mean rate is ``entropy_rate``).
        """
        n = _int("n", n, 1)
        rng = np.random.default_rng([self.seed if seed is None else _int("seed", seed, 0), 1])
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
}  # fmt: skip


def make_streams(kind: str | Mapping[str, Any], /, **options: Any) -> ReplicaStreams:
    """Streams from a kind and options, or from one dict holding ``kind`` (e.g.
    ``dataclasses.asdict(config.data)``) plus keyword extras such as ``replicas`` and
    ``steps_per_round`` (both required). Options a kind does not use are ignored.

    * ``markov``: ``vocab_size`` (64), ``branching`` (4), ``temperature`` (1.0),
      ``source_seed`` (``seed``); non-iid builds one chain per replica, seeds
      ``[source_seed, r]``.
    * ``text``: ``path`` (file, directory, glob or list), ``max_bytes`` (None).
    * ``stdlib``: ``max_bytes`` (20 MB) of :func:`stdlib_corpus`.
    * ``tokens``: ``path`` to a ``.bin``, ``token_dtype`` ('uint16'), ``vocab_size``
      (default: max id + 1).

    Common: ``batch`` (8), ``seq_len`` (64), ``seed`` (0), ``iid`` (True),
    ``eval_fraction`` (0.05). Bad input raises ValueError naming the field.
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
    common = {k: o[k] for k in ("replicas", "batch", "seq_len", "steps_per_round", "seed", "iid")}
    for name in ("replicas", "batch", "seq_len", "steps_per_round", "seed", "source_seed"):
        _int(name, o.get(name, 0), 0 if "seed" in name else 1)  # before loading anything
    vocab, path = o.get("vocab_size"), o.get("path")
    if kind in ("text", "tokens") and not path:
        raise ValueError(f"path={path!r}: is required for kind={kind!r}")
    if kind == "markov":
        args = (o.get("vocab_size", 64), o.get("branching", 4))
        seed, temp = o.get("source_seed", o["seed"]), o.get("temperature", 1.0)
        seeds = [seed] if o["iid"] else [[seed, r] for r in range(common["replicas"])]
        sources = [MarkovSource(*args, seed=s, temperature=temp) for s in seeds]
    elif kind in ("text", "stdlib"):
        if vocab is not None and _int("vocab_size", vocab, 1) < 256:
            raise ValueError(f"vocab_size={vocab}: byte-level text needs vocab_size >= 256")
        cap = o.get("max_bytes", None if kind == "text" else 20_000_000)
        sources = [ByteText(path if kind == "text" else stdlib_corpus(cap), max_bytes=cap)]
    else:
        dtype = o.get("token_dtype", "uint16")
        if dtype not in ("uint16", "uint32"):
            raise ValueError(f"token_dtype={dtype!r}: must be 'uint16' or 'uint32'")
        sources = [TokenFile(path, dtype, vocab)]
    return ReplicaStreams(sources, eval_fraction=o["eval_fraction"], **common)
