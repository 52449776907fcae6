"""Token sources for the experiment streams: a synthetic Markov language and real text.

:class:`MarkovSource` (synthetic, with a known entropy rate: the loss floor), :class:`Corpus`
(any flat token array), :class:`ByteText` (bytes of text files, vocab 256;
:func:`stdlib_corpus` lists a real corpus present on every machine) and :class:`TokenFile`
(pre-tokenized flat ``.bin``). :mod:`experiments.data` cuts them into replica streams.

What counts as text is one rule, :func:`is_text`, for ``data.kind=text`` (:class:`ByteText`)
and for :mod:`experiments.tokenize_corpus` alike: a file is text when it is not empty, holds
no NUL byte and decodes as UTF-8. :func:`keep_text` keeps those among the files a path names
and counts the others by kind; none of them text is refused in one line naming the path (a
single file: ``is empty``, ``is not UTF-8 text``), some of them is not (the caller warns,
saying how many were skipped). ``data.kind=stdlib`` reads the standard library's files as
they are (a fixed corpus: a few test modules there are Latin-1).

A token file without a sidecar is read as the dtype asked for (uint16 for ``auto``), and a
dtype its content contradicts is refused, naming the dtype rather than the vocabulary: a
uint16 file read as uint32 (ids far beyond any vocabulary, which read as uint16 are small) or
a 32-bit file read as uint16 (every second id 0).

Example:
  >>> import pathlib, tempfile
  >>> d = pathlib.Path(tempfile.mkdtemp())
  >>> _ = (d / "a.txt").write_text("some text")
  >>> _ = (d / "b.bin").write_bytes(bytes(range(256)))
  >>> is_text(d / "a.txt"), is_text(d / "b.bin")
  (True, False)
  >>> text = ByteText(d)
  >>> text.tokens.tobytes(), text.skipped
  (b'some text', {'not UTF-8 text': 1})
"""

from __future__ import annotations

import codecs
import glob
import json
import math
import os
import sysconfig
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

_CHUNK = 1 << 24
FORMAT, VERSION = "co2jax.tokens", 1
"""A token file's sidecar (``<file>.json``, :mod:`experiments.tokenize_corpus`): its format."""


def checked_int(name: str, value: Any, lo: int) -> int:
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
        v = self.vocab_size = checked_int("vocab_size", vocab_size, 2)
        k = self.branching = checked_int("branching", branching, 2)
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
        batch, length = checked_int("batch", batch, 1), checked_int("length", length, 1)
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
            if checked_int("vocab_size", vocab_size, 1) <= hi:
                raise ValueError(f"vocab_size={vocab_size}: {name} holds token id {hi}")
        self.vocab_size = checked_int("vocab_size", vocab_size, 1)
        if self.vocab_size > np.iinfo(np.int32).max:
            raise ValueError(f"vocab_size={vocab_size}: must fit in int32")

    def __len__(self) -> int:
        return int(self.tokens.size)

    entropy_rate = None


def resolve_paths(paths: str | os.PathLike | Sequence[str | os.PathLike]) -> list[Path]:
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


EMPTY, NOT_TEXT, UNREADABLE = "empty", "not UTF-8 text", "unreadable"
_TEXT_CHUNK = 1 << 20


def text_kind(path: str | os.PathLike, limit: int | None = None) -> str:
    """``"text"``, or why the file at ``path`` is not: ``"empty"``, ``"not UTF-8 text"`` (bytes
    that are not UTF-8, or a NUL byte: binary) or ``"unreadable"``. With ``limit``, only its
    first ``limit`` bytes are judged (a character cut at the limit is not held against it)."""
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size == 0:
                return EMPTY
            want = size if limit is None else min(size, limit)
            decoder, done = codecs.getincrementaldecoder("utf-8")(), 0
            while done < want:
                chunk = f.read(min(_TEXT_CHUNK, want - done))
                if not chunk:
                    break
                done += len(chunk)
                if b"\0" in chunk:
                    return NOT_TEXT
                if not (chunk.isascii() and not decoder.getstate()[0]):  # ASCII: valid as is
                    decoder.decode(chunk)
            decoder.decode(b"", final=want >= size)
    except UnicodeDecodeError:
        return NOT_TEXT
    except OSError:
        return UNREADABLE
    return "text"


def is_text(path: str | os.PathLike, limit: int | None = None) -> bool:
    """Whether ``path`` is a text file: not empty, no NUL byte, UTF-8 (:func:`text_kind`). The
    one rule of ``data.kind=text`` and :mod:`experiments.tokenize_corpus`."""
    return text_kind(path, limit) == "text"


def skipped_note(skipped: dict[str, int]) -> str:
    """``{"empty": 1, "not UTF-8 text": 2}`` as ``"1 empty, 2 not UTF-8 text"``."""
    return ", ".join(f"{n} {kind}" for kind, n in sorted(skipped.items()))


def keep_text(
    files: Sequence[Path],
    entries: str | os.PathLike | Sequence[str | os.PathLike],
    name: str = "path",
    max_bytes: float = math.inf,
) -> tuple[list[Path], dict[str, int]]:
    """The text files (:func:`is_text`) among ``files`` (what ``entries`` matched,
    :func:`resolve_paths`), in order, and how many of each other kind were skipped. With
    ``max_bytes``, files are judged only until that many bytes of text are kept (the last
    one up to the cap). Raises ``ValueError`` naming ``name=entries`` when none is text."""
    texts: list[Path] = []
    skipped: dict[str, int] = {}
    kept = 0
    for f in files:
        if kept >= max_bytes:
            break
        kind = text_kind(f, None if max_bytes == math.inf else int(max_bytes - kept))
        if kind == "text":
            texts.append(f)
            kept += f.stat().st_size
        else:
            skipped[kind] = skipped.get(kind, 0) + 1
    if texts:
        return texts, skipped
    listed = [entries] if isinstance(entries, str | os.PathLike) else list(entries)
    shown = str(listed[0]) if len(listed) == 1 else [str(e) for e in listed]
    n = sum(skipped.values())
    if len(listed) == 1 and n == 1 and Path(listed[0]).is_file():
        why = "cannot be read" if UNREADABLE in skipped else f"is {next(iter(skipped))}"
    elif set(skipped) == {EMPTY}:
        why = f"its {n} files are empty" if n > 1 else "its 1 file is empty"
    else:
        why = f"none of its {n} files is UTF-8 text ({skipped_note(skipped)})"
    raise ValueError(f"{name}={shown!r}: {why}")


class ByteText(Corpus):
    """Byte-level tokens (vocab 256) of text files, concatenated in order.

    ``paths``: a file, directory or glob, or a list of them (see ``resolve_paths``). Files that
    are not text (:func:`is_text`: empty, binary, not UTF-8) are skipped and counted in
    ``skipped`` (``{"not UTF-8 text": 2}``); none of them text is refused, naming the path.
    ``text_only=False`` reads every file's bytes as they are. A single file is
    memory-mapped; several are read into one ``uint8`` array, stopping once ``max_bytes``
    (if given) are in; the result is truncated to ``max_bytes``.
    """

    def __init__(self, paths, max_bytes: int | None = None, text_only: bool = True):
        files = resolve_paths(paths)
        cap = math.inf if max_bytes is None else checked_int("max_bytes", max_bytes, 1)
        self.skipped: dict[str, int] = {}
        if text_only:
            files, self.skipped = keep_text(files, paths, "path", cap)
        elif sum(f.stat().st_size for f in files) == 0:
            raise ValueError(f"path={str(paths)!r}: the matched files are empty")
        self.paths = files
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
    cap = checked_int("max_bytes", max_bytes, 1)
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

    With a sidecar ``<path>.json`` (written by :mod:`experiments.tokenize_corpus`) the dtype
    and vocabulary are the sidecar's: ``dtype="auto"`` takes them, another dtype or a
    ``vocab_size`` that disagrees is refused in one line. Without one, ``dtype="auto"`` is
    uint16 and ``vocab_size`` defaults to ``max id + 1``; see :class:`Corpus` for the range
    check. Without one, a dtype the content contradicts is refused naming the dtype (not the
    vocabulary): uint16 ids read as uint32, or 32-bit ids read as uint16 (module docstring).
    """

    def __init__(self, path, dtype: str = "auto", vocab_size: int | None = None, check=True):
        name = None
        if dtype != "auto":
            try:
                name = np.dtype(dtype).name
            except TypeError:
                name = None
            if name not in ("uint16", "uint32"):
                raise ValueError(f"dtype={dtype!r}: must be 'auto', 'uint16' or 'uint32'")
        p = Path(path)
        if not p.is_file():
            raise ValueError(f"path={str(path)!r}: is not a file")
        self.info = read_sidecar(p)
        if self.info is not None:
            side, held = sidecar_path(p).name, self.info["dtype"]
            if name not in (None, held):
                raise ValueError(f"dtype={dtype!r}: {p.name} holds {held} tokens ({side})")
            if vocab_size is not None and vocab_size != self.info["vocab_size"]:
                raise ValueError(
                    f"vocab_size={vocab_size}: {p.name} was tokenized with a vocabulary of "
                    f"{self.info['vocab_size']} ({side}): set it to {self.info['vocab_size']}"
                )
            name, vocab_size = held, self.info["vocab_size"]
        name = name or "uint16"
        size, item = p.stat().st_size, np.dtype(name).itemsize
        if size == 0 or size % item:
            raise ValueError(
                f"path={str(path)!r}: {size} bytes is not a positive multiple of the "
                f"{name} itemsize {item} (wrong dtype?)"
            )
        self.path = p
        tokens = np.memmap(p, name, mode="r")
        if self.info is None and name == "uint16" and _every_second_zero(tokens):
            raise ValueError(
                f"dtype={dtype!r}: read as uint16, every second id in {p.name} is 0: it looks "
                f"like 32-bit ids (uint32, or int32; it has no sidecar "
                f"{sidecar_path(p).name} to say which)"
            )
        try:
            super().__init__(tokens, vocab_size, name=str(p), check=check)
        except ValueError:
            if self.info is None and name == "uint32":
                _refuse_uint16_as_uint32(p, dtype)
            raise
        if self.info is None and name == "uint32" and self.vocab_size > 1 << 16:
            _refuse_uint16_as_uint32(p, dtype)


def _every_second_zero(tokens: np.ndarray) -> bool:
    """Whether every odd-indexed id is 0 and some even-indexed one is not: the two halves of
    little-endian 32-bit ids read as uint16. Stops at the first chunk that says otherwise."""
    if tokens.size < 2 or tokens.size % 2:
        return False
    some = False
    for i in range(0, tokens.size, _CHUNK):  # _CHUNK is even: chunks start at even ids
        chunk = tokens[i : i + _CHUNK]
        if chunk[1::2].any():
            return False
        some = some or bool(chunk[0::2].any())
    return some


def _refuse_uint16_as_uint32(p: Path, dtype: str) -> None:
    """Raises ``ValueError`` naming the dtype when ``p``, read as uint32, looks like uint16
    ids: its largest uint32 id is more than 256 times its largest id read as uint16 (a real
    vocabulary of up to 2**24 ids read as uint16 already gives 65535)."""
    hi32 = _extreme(np.memmap(p, np.uint32, mode="r"), np.max)
    hi16 = _extreme(np.memmap(p, np.uint16, mode="r"), np.max)
    if hi32 >= 1 << 16 and hi32 > 256 * (hi16 + 1):
        raise ValueError(
            f"dtype={dtype!r}: read as uint32, {p.name} holds id {hi32:,}, far beyond any "
            f"vocabulary; read as uint16 its ids are 0..{hi16}: it looks like uint16 tokens "
            f"(it has no sidecar {sidecar_path(p).name} to say which)"
        )


def sidecar_path(path: str | os.PathLike) -> Path:
    """Where a token file's description lives: ``<path>.json``."""
    return Path(f"{path}.json")


def read_sidecar(path: str | os.PathLike) -> dict[str, Any] | None:
    """The description of token file ``path`` (:func:`tokenize_corpus`), or None without one.
    Raises ``ValueError`` for a sidecar that is not one, or that does not describe the file."""
    side = sidecar_path(path)
    if not side.is_file():
        return None
    try:
        info = json.loads(side.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(
            f"path={str(path)!r}: its sidecar {side.name} is unreadable ({e})"
        ) from None
    keys = ("dtype", "vocab_size", "tokens")
    if (
        not isinstance(info, dict)
        or info.get("format") != FORMAT
        or any(k not in info for k in keys)
    ):
        raise ValueError(f"path={str(path)!r}: {side.name} is not a co2jax token file sidecar")
    if info["dtype"] not in ("uint16", "uint32"):
        raise ValueError(f"path={str(path)!r}: {side.name} names dtype {info['dtype']!r}")
    size = Path(path).stat().st_size if Path(path).is_file() else None
    expected = info["tokens"] * np.dtype(info["dtype"]).itemsize
    if size is not None and size != expected:
        raise ValueError(
            f"path={str(path)!r}: {size} bytes, but {side.name} describes {info['tokens']} "
            f"{info['dtype']} tokens ({expected} bytes): the two files are from different runs"
        )
    return info
