"""An outer optimizer's schedule run inside one round program: before, in and after the loop.

The inner steps of a round are ``lax.scan`` loops: one loop, or (when a transfer acts inside
the round) one loop per *segment*, the round cut at every step where a transfer is sent or
applied or its chunks start or stop. Each transfer of the schedule
(:func:`co2jax.protocol.plan`) is run where its steps fall:

- in one piece, sent at one boundary and applied at a later one (a delayed algorithm: steps
  0 and H; a Streaming DiLoCo fragment: its send step and tau steps later): its reduction is
  issued at the send boundary and consumed at the apply boundary;
- sent and applied at the same boundary (a synchronous algorithm: after the last step);
- in chunks (``Transfer(chunks=K)``, the spread schedule): its payload goes into the
  segment's carry, cut into chunks (:mod:`co2jax.comm.chunks`); iteration k reduces the
  chunk due at step k, independent of that step's forward and backward pass, so the compiler
  can run the collective under the step's compute.

No action runs under a ``lax.cond``: a loop with a branch per action measured 1.39x DiLoCo's
round time for Streaming DiLoCo on CPU, the segments 1.12x (XLA:CPU copies a branch's
operands in and out at every step).

Chunks are cut on the payload's wire form, so a transfer in chunks reduces to exactly the
values of its whole reduction (:mod:`co2jax.comm.chunks`).
"""

from __future__ import annotations

import itertools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from co2jax.axes import REPLICA
from co2jax.comm import chunks
from co2jax.comm.reducer import values
from co2jax.engines.sharding import split_sums
from co2jax.protocol import OuterOptimizer, Transfer
from co2jax.tree import varying_axes


class Carry(NamedTuple):
    params: Any
    inner_state: Any
    outer_state: Any
    sums: jax.Array  # [transfers, 3]: |payload|^2, |reduced|^2, <payload, reduced> this round
    inflight: tuple  # per transfer: its chunk buffers in the loop, or ()


def _cosine(sums: jax.Array) -> jax.Array:
    pp, rr, pr = sums[..., 0], sums[..., 1], sums[..., 2]
    ok = pp * rr > 0
    return jnp.where(ok, pr / jnp.sqrt(jnp.where(ok, pp * rr, 1.0)), 0.0)


def _like(zeros: Any, ref: Any) -> Any:
    """``zeros`` typed as varying over the mesh axes ``ref`` varies over (a scan carry and a
    ``lax.cond`` branch keep their types)."""

    def leaf(z, r):
        axes = varying_axes(r)
        missing = tuple(sorted((axes or frozenset()) - (varying_axes(z) or frozenset())))
        return jax.lax.pcast(z, missing, to="varying") if missing else z

    return jax.tree.map(leaf, zeros, ref)


class RoundSchedule:
    """The schedule of ``outer`` for rounds of ``steps`` inner steps, one reducer per transfer.

    ``payload_shapes``: per transfer, the (whole-parameter) shapes of its payload's values,
    for the metrics of a split outer state; ``layout``: the engine's
    :class:`~co2jax.engines.sharding.Layout`.
    """

    def __init__(
        self,
        outer: OuterOptimizer,
        transfers: tuple[Transfer, ...],
        reducers: tuple,
        layout,
        steps: int,
        payload_shapes: list,
    ):
        self.outer, self.transfers, self.reducers = outer, transfers, reducers
        self.layout, self.steps, self.payload_shapes = layout, steps, payload_shapes
        # in the loop's carry: a transfer in chunks; one in one piece is reduced where it is
        # sent, at a boundary, and consumed at its apply boundary
        self.carried = tuple(t.send != t.apply and t.chunks > 1 for t in transfers)

    # --------------------------------------------------------------------------------------

    def _send(self, c: Carry, i: int):
        payload, state = self.outer.send(self.layout.shard(c.params), c.outer_state, i)
        return c._replace(outer_state=state), payload

    def _apply(self, c: Carry, i: int, reduced) -> Carry:
        shards, state = self.outer.apply(self.layout.shard(c.params), c.outer_state, i, reduced)
        return c._replace(
            params=self.layout.unshard(shards, c.params),
            outer_state=self.layout.data_invariant(state, c.outer_state),
        )

    def _add(self, c: Carry, i: int, triple: jax.Array) -> Carry:
        return c._replace(sums=c.sums.at[i].add(triple))

    def _whole_stats(self, i: int, payload, reduced) -> jax.Array:
        pairs = zip(
            jax.tree.leaves(values(payload)),
            jax.tree.leaves(values(reduced)),
            jax.tree.leaves(self.payload_shapes[i]),
            strict=True,
        )
        return self.layout.sums(list(pairs))

    def _piece_stats(self, i: int, plan, piece, reduced) -> jax.Array:
        """The statistics of one chunk: a group holding a data shard is summed over data."""
        full = jax.tree.leaves(self.payload_shapes[i])
        sharded = [
            any(plan.form.shapes[j] != tuple(full[j].shape) for j in group)
            for group in plan.form.groups
        ]
        pieces = chunks.piece_values(plan, piece)
        return split_sums(list(zip(pieces, reduced, sharded, strict=True)))

    # buffers of a transfer in chunks: {"wire": chunk buffer, "acc": reduced chunks or None
    # (a plain payload's reduced chunk replaces its own wire chunk)}

    def _fill(self, plan, payload) -> dict:
        wire = chunks.split(plan, payload)
        if not plan.encoded:
            return {"wire": wire, "acc": None}
        # typed as the group's wire arrays: what a reduced chunk of them varies over
        refs = [jax.tree.leaves(w)[0] for w in wire]
        return {"wire": wire, "acc": _like(chunks.zeros(plan), refs)}

    def _reduce_chunk(self, c: Carry, i: int, plan, chunk) -> Carry:
        held = c.inflight[i]
        piece = chunks.take(held["wire"], chunk)
        reduced = chunks.reduce(plan, self.reducers[i], piece)
        stats = self._piece_stats(i, plan, piece, reduced)
        if plan.encoded:
            held = {"wire": held["wire"], "acc": chunks.put(held["acc"], chunk, reduced)}
        else:
            held = {"wire": chunks.put(held["wire"], chunk, reduced), "acc": None}
        return self._add(self._hold(c, i, held), i, stats)

    def _finish_chunks(self, c: Carry, i: int, plan) -> Carry:
        held = c.inflight[i]
        reduced = chunks.finish(plan, held["acc"] if plan.encoded else held["wire"])
        return self._apply(c, i, reduced)

    def _sync(self, c: Carry, i: int) -> Carry:
        c, payload = self._send(c, i)
        reduced = self.reducers[i](payload)
        return self._add(self._apply(c, i, reduced), i, self._whole_stats(i, payload, reduced))

    # --------------------------------------------------------------------------------------

    def segments(self) -> list[tuple[int, int]]:
        """The loop's segments ``[start, stop)``: the round cut at every step where a
        transfer is sent or applied or its chunks stop (a delayed or synchronous algorithm:
        one loop)."""
        H = self.steps
        cuts = {0, H}
        for t in self.transfers:
            cuts |= {t.send, t.apply}
            if t.chunks > 1:
                cuts.add(min(H, t.send + t.chunks))
        cuts = sorted(cuts)
        return list(itertools.pairwise(cuts))

    def boundary(self, b: int, c: Carry, store: dict, plans: dict) -> Carry:
        """The actions at boundary ``b`` between segments, in :func:`co2jax.protocol.plan`'s
        order: applies (and transfers sent and applied there), then sends."""
        if b == 0:
            c = c._replace(sums=_like(c.sums, jax.lax.axis_index(REPLICA)))
        for i, t in enumerate(self.transfers):  # applied at b
            if t.apply != b:
                continue
            if t.send == t.apply:
                c = self._sync(c, i)
            elif self.carried[i]:
                c = self._finish_chunks(c, i, plans[i])
                c = self._hold(c, i, ())
            else:
                payload, reduced = store.pop(i)
                c = self._add(self._apply(c, i, reduced), i, self._whole_stats(i, payload, reduced))
        for i, t in enumerate(self.transfers):  # sent at b, applied later
            if t.send != b or t.apply == b:
                continue
            if not self.carried[i]:
                c, payload = self._send(c, i)
                store[i] = (payload, self.reducers[i](payload))
            else:
                c, payload = self._send(c, i)
                plans[i] = chunks.plan(payload, self.reducers[i], t.chunks)
                c = self._hold(c, i, self._fill(plans[i], payload))
        return c

    def _hold(self, c: Carry, i: int, held) -> Carry:
        return c._replace(inflight=(*c.inflight[:i], held, *c.inflight[i + 1 :]))

    def in_step(self, k: jax.Array, c: Carry, plans: dict, segment: tuple[int, int]) -> Carry:
        """Before inner step ``k`` of ``segment``: the chunks due (one per step and transfer
        in chunks over this segment; no branch, each step's collective independent)."""
        for i, t in enumerate(self.transfers):
            if self.carried[i] and t.send <= segment[0] < t.send + t.chunks:
                c = self._reduce_chunk(c, i, plans[i], k - t.send)
        return c

    def metrics(self, c: Carry) -> tuple[jax.Array, jax.Array]:
        """The round's payload norm (all transfers) and mean cosine to the reduced mean."""
        if not self.transfers:
            return jnp.float32(0), jnp.float32(0)
        return jnp.sqrt(jnp.sum(c.sums[:, 0])), jnp.mean(_cosine(c.sums))
