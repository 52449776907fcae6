"""The Grain pipelines behind :class:`experiments.data.ReplicaStreams`.

Each (replica r, data shard d) has its own Grain ``MapDataset`` whose element k is that shard's
part of round k, ``[H, b, L + 1]`` int32 windows (``b = B / D`` rows of the replica's batch B).
:func:`rounds` zips the R x D shards into the global ``[R, H, B, L + 1]`` round: shard d holds
the rows ``d b .. (d + 1) b - 1`` of replica r's batch, the rows the ``data`` mesh axis gives
its d-th device.

Corpora (:class:`Windows`): a training range of n tokens is cut into ``(n - 1) // L`` windows
of ``L + 1`` tokens at stride L (each token is a target once); a pool of windows is shuffled by
seed with Grain's index shuffle (a permutation, reshuffled each epoch) and repeated without
end. The G replicas reading one pool deal its shuffled windows out in turn: the reader at
position p, data shard d, takes windows ``p + G (d + D n)``, n = 0, 1, ...; so replicas read
disjoint windows within an epoch, and a replica's windows do not depend on D.

Markov (:class:`MarkovRounds`): element k of replica r is drawn exactly as before Grain,
``default_rng([seed, 0, k, r])`` for the whole ``[H, B, L + 1]`` block; shard d takes its rows.

Every element is a pure function of its index, so :meth:`grain.MapDataset.__getitem__` reads
round k directly, and an iterator's state (``{"next_index": k}``, saved in a checkpoint with
``grain.checkpoint.CheckpointSave``) resumes at exactly the round an uninterrupted run reads
next.

Example:
  >>> import numpy as np
  >>> w = Windows([(np.arange(100), 0, 100)], width=9)
  >>> len(w), w[0].tolist(), int(w[1][0])
  (12, [0, 1, 2, 3, 4, 5, 6, 7, 8], 8)
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

import grain
import numpy as np
from grain.experimental import ZipMapDataset

ENDLESS = 1 << 62
"""The length of a Markov stream (rounds are drawn on demand: it has no end)."""
_SHUFFLE_MAX = (1 << 32) - 1  # Grain's index shuffle works on 32-bit indices


class Windows:
    """Random access to windows of ``width`` = L + 1 tokens at stride L over token ranges.

    ``parts``: ``(tokens, start, stop)`` triples; window i of a range starts at
    ``start + i L`` and a range of n tokens holds ``(n - 1) // L`` of them. The ranges' windows
    are numbered one after another.
    """

    def __init__(self, parts: Sequence[tuple[np.ndarray, int, int]], width: int):
        self.parts, self.width, stride = list(parts), int(width), max(int(width) - 1, 1)
        counts = [max((stop - start - 1) // stride, 0) for _, start, stop in self.parts]
        self._first = np.cumsum([0, *counts])
        if self._first[-1] == 0:
            raise ValueError(f"seq_len={self.width - 1}: no window of {self.width} tokens fits")
        if self._first[-1] > _SHUFFLE_MAX:
            raise ValueError(
                f"seq_len={self.width - 1}: {self._first[-1]} windows, more than a shuffle of "
                "32-bit indices holds (use a longer seq_len or a smaller corpus)"
            )
        self._stride = stride

    def __len__(self) -> int:
        return int(self._first[-1])

    def __getitem__(self, index: int) -> np.ndarray:
        i = int(index)
        part = int(np.searchsorted(self._first, i, side="right")) - 1
        tokens, start, _ = self.parts[part]
        a = start + (i - int(self._first[part])) * self._stride
        return np.asarray(tokens[a : a + self.width], np.int32)


class MarkovRounds:
    """Round k of one replica, ``draw(k)`` (a ``[H, B, L + 1]`` block), for ``ENDLESS``
    rounds. The last two blocks are kept, so the D data shards of a round draw it once."""

    def __init__(self, draw: Callable[[int], np.ndarray]):
        self._draw, self._kept, self._lock = draw, {}, threading.Lock()

    def __len__(self) -> int:
        return ENDLESS

    def __getitem__(self, index: int) -> np.ndarray:
        k = int(index)
        with self._lock:
            block = self._kept.get(k)
        if block is None:
            block = self._draw(k)
            with self._lock:
                self._kept[k] = block
                while len(self._kept) > 2:
                    del self._kept[min(self._kept)]
        return block


def shuffle_seed(seed: int, pool: int) -> int:
    """The 32-bit seed of pool ``pool``'s shuffle: ``SeedSequence([seed, 2, pool])`` (the
    second word keeps it apart from the Markov rounds' ``[seed, 0, ...]`` and the eval
    batch's ``[seed, 1]``)."""
    return int(np.random.SeedSequence([seed, 2, pool]).generate_state(1)[0])


def window_shard(
    windows: Windows,
    seed: int,
    position: int,
    readers: int,
    shard: int,
    shards: int,
    batch: int,
    steps: int,
) -> grain.MapDataset:
    """The rounds (``[steps, batch, L + 1]``) of the reader at ``position`` of ``readers``,
    data shard ``shard`` of ``shards``, over a pool of ``windows`` shuffled by ``seed``."""
    pool = grain.MapDataset.source(windows).shuffle(seed=seed).repeat()
    return pool[position + readers * shard :: readers * shards].batch(batch).batch(steps)


def markov_shard(rounds: MarkovRounds, shard: int, rows: int) -> grain.MapDataset:
    """Data shard ``shard`` (``rows`` rows of each step's batch) of one replica's rounds."""
    lo = shard * rows
    return grain.MapDataset.source(rounds).map(lambda block: block[:, lo : lo + rows])


def rounds(shards: Sequence[Sequence[grain.MapDataset]]) -> grain.MapDataset:
    """The global rounds, ``[R, H, B, L + 1]``, of ``shards[r][d]`` (each ``[H, b, L + 1]``):
    row ``d b + j`` of replica r's batch is row j of shard (r, d)."""
    R, D = len(shards), len(shards[0])

    def assemble(parts: Sequence[np.ndarray]) -> np.ndarray:
        x = np.stack(parts)  # [R D, H, b, W]
        _, h, b, w = x.shape
        return np.ascontiguousarray(
            x.reshape(R, D, h, b, w).transpose(0, 2, 1, 3, 4).reshape(R, h, D * b, w)
        )

    parents = [s for row in shards for s in row]
    n = min(len(s) for s in parents)  # endless streams, cut to one (astronomical) length
    return ZipMapDataset(parents=[s[:n] for s in parents]).map(assemble)


READ_OPTIONS = grain.ReadOptions(num_threads=1, prefetch_buffer_size=1)
"""One thread draws the next round while this one trains (more would contend with the
compute for the host's cores; rounds are large elements)."""
