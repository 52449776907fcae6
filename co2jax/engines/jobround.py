"""The multi-job trainer's driver of the schedule walk: one job's round, exchanged with peers.

:func:`co2jax.engines.walk.run` walks the round (each chunk at a boundary of its own,
``chunks_in_steps=False``); this driver says how a job does each piece:

- a segment of inner steps: the job's local round engine on its own mesh (no sync);
- ``send``: take the payload (a transfer in one piece is encoded and published at once; its
  peers' payloads are pulled on a background thread while the next steps run);
- ``chunk``: publish chunk c of the payload, encoded;
- ``apply``: wait for what is left of the peers' payloads, combine the R in rank order (or
  the participants', weighted), and apply them.

The trainer (:class:`co2jax.engines.multijob.JobTrainer`) owns the exchanges, the membership
and the jitted pieces; this module only orders them.
"""

from __future__ import annotations

import time
from typing import Any, NamedTuple

import jax
import numpy as np

from co2jax.engines.walk import Segment, Walk


class JobCarry(NamedTuple):
    """A job's round between actions: ``local`` (its local engine's state: parameters and
    inner state with a replica axis of 1) and the outer state."""

    local: Any
    outer_state: Any


class JobRound:
    """One round of ``trainer`` on ``batch`` (``[H, B, ...]``), walked by
    :func:`co2jax.engines.walk.run`; ``fresh``: the job has just (re)joined, its payloads
    sent at step 0 weigh 0; ``label``: the round's name in errors and logs."""

    def __init__(self, trainer, walk: Walk, batch: Any, weight: float, fresh: bool, label: str):
        self.trainer, self.walk, self.batch = trainer, walk, batch
        self.weight, self.fresh, self.label = weight, fresh, label
        self.store: dict[int, tuple[Any, list]] = {}  # per transfer: payload, exchanges
        self.record = {"participants": [], "left_out": [], "admitted": (), "carried": []}
        self.losses: list[np.ndarray] = []
        self.compute = self.wait = 0.0
        applies = [a for s in walk.segments for a in s.actions] + list(walk.end)
        self.left = sum(a.kind in ("sync", "apply") for a in applies)  # applies to come

    def _params(self, c: JobCarry) -> Any:
        return jax.tree.map(lambda x: x[0], c.local.params)

    def _weight(self, i: int) -> float:
        return 0.0 if self.fresh and self.walk.transfers[i].send == 0 else self.weight

    def send(self, c: JobCarry, i: int) -> JobCarry:
        t = self.trainer
        payload, outer_state = t._send(self._params(c), c.outer_state, i)
        started = []
        if self.walk.transfers[i].chunks == 1:
            started.append(t._start(payload, f"{self.label}, transfer {i}", self._weight(i)))
        self.store[i] = (payload, started)
        return c._replace(outer_state=outer_state)

    def chunk(self, c: JobCarry, i: int, k: int) -> JobCarry:
        t = self.trainer
        payload, started = self.store[i]
        encoded = t._chunk(payload, i, k)
        started.append(t._start(encoded, f"{self.label}, transfer {i}, chunk {k}", self._weight(i)))
        return c

    def apply(self, c: JobCarry, i: int) -> JobCarry:
        t = self.trainer
        payload, started = self.store.pop(i)
        self.left -= 1
        began = time.perf_counter()
        reduced = [
            t._finish(p, self.left == 0 and j == len(started) - 1, self.record)
            for j, p in enumerate(started)
        ]
        self.wait += time.perf_counter() - began
        if self.walk.transfers[i].chunks > 1:
            reduced = [t._join([list(r) for r in reduced], payload, i)]
        params, outer_state = t._apply(self._params(c), c.outer_state, i, reduced[0])
        params = jax.tree.map(
            lambda x, ref: jax.device_put(x[None], ref.sharding), params, c.local.params
        )
        return JobCarry(c.local._replace(params=params), outer_state)

    def segment(self, c: JobCarry, segment: Segment) -> JobCarry:
        start, stop = segment.start, segment.stop
        began = time.perf_counter()
        steps = jax.tree.map(lambda x: x[None, start:stop], self.batch)
        local, metrics = self.trainer._trainer(stop - start).round(c.local, steps)
        self.losses.append(np.asarray(metrics.loss)[0])  # waits for the steps
        self.compute += time.perf_counter() - began
        return c._replace(local=local)
