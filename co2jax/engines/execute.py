"""The round engine's driver of the schedule walk: a round as one program of segments.

:func:`co2jax.engines.walk.run` walks the round; this driver says how each piece runs inside
the replica's manual region (whole logical tensors, the data and model layout left to the
compiler):

- a segment of inner steps is one ``lax.scan`` (one step: straight-line code);
- a transfer in one piece sent at one boundary and applied at a later one (a delayed
  algorithm: steps 0 and H; a Streaming DiLoCo fragment: its send step and tau steps later)
  is reduced at its send and consumed at its apply, outside the loops between them, so the
  compiler may run its collective under their compute; from an outer state split over
  ``data`` it is reduced as one chunk split over the replica's devices, each sending its
  slice, and read only together with the parameters the loops return (an optimization
  barrier), which keeps its all-gather in flight across them on TPU;
- a transfer in chunks (``Transfer(chunks=K)``) is held in the loop's carry as a
  :class:`co2jax.comm.chunks.Buffer`; step k reduces the chunk due then, independent of that
  step's forward and backward pass, so the collective can hide under the step's compute.

No action runs under a ``lax.cond``: a loop with a branch per action measured 1.39x DiLoCo's
round time for Streaming DiLoCo on CPU, the segments 1.12x (XLA:CPU copies a branch's
operands in and out at every step). Chunks are cut on the payload's wire form, so a transfer
in chunks reduces to exactly its whole reduction's values (:mod:`co2jax.comm.chunks`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from co2jax.axes import DATA, REPLICA, axis_size
from co2jax.comm import chunks
from co2jax.comm.reducer import values
from co2jax.engines import gradients, recovery
from co2jax.engines.layout import constrain, without
from co2jax.engines.program import split_over
from co2jax.engines.walk import Segment, Walk
from co2jax.protocol import OuterOptimizer
from co2jax.tree import tree_select, varying_like


class Carry(NamedTuple):
    """What a round carries through its loops.

    Attributes:
      params, inner_state, outer_state: the replica's.
      sums: ``[transfers, 3]``: ``|payload|^2``, ``|reduced|^2`` and ``<payload, reduced>``
        of this round's transfers (their values; for the metrics).
      inflight: per transfer, its :class:`~co2jax.comm.chunks.Buffer` while it is in
        chunks, else ``()``.
      model_state: the replica's model state that is not parameters (``()`` for none).
    """

    params: Any
    inner_state: Any
    outer_state: Any
    sums: jax.Array
    inflight: tuple
    model_state: Any = ()


class Specs(NamedTuple):
    """Per-replica ``PartitionSpec`` trees the round keeps its state in; ``outer_params``:
    where the parameters lie while the outer step reads them (as the outer state)."""

    params: Any
    inner_state: Any
    outer_state: Any
    outer_params: Any


def sums(payload_values: list, reduced_values: list) -> jax.Array:
    """``[|p|^2, |r|^2, <p, r>]`` over pairs of arrays, in float32."""
    total = jnp.zeros(3, jnp.float32)
    for p, r in zip(payload_values, reduced_values, strict=True):
        p, r = p.astype(jnp.float32), r.astype(jnp.float32)
        total = total + jnp.stack([jnp.sum(p * p), jnp.sum(r * r), jnp.sum(p * r)])
    return total


def cosine(s: jax.Array) -> jax.Array:
    """The cosine of :func:`sums`' payload and reduction (0 where either is 0)."""
    pp, rr, pr = s[..., 0], s[..., 1], s[..., 2]
    ok = pp * rr > 0
    return jnp.where(ok, pr / jnp.sqrt(jnp.where(ok, pp * rr, 1.0)), 0.0)


class RoundDriver:
    """Runs a :class:`~co2jax.engines.walk.Walk` inside one replica's round program.

    Args:
      outer: the algorithm.
      walk: the round's walk (transfers as run).
      reducers: one per transfer.
      step: ``step(carry, batch_k, k) -> (carry, (loss, aux))``, one inner step.
      batch: the round's batch, ``[H, ...]`` leaves.
      specs: where the state is kept (:class:`Specs`).
      shards: the replica's devices a chunk is split over (:func:`co2jax.comm.chunks.plan`).
      split: per transfer, whether one sent in one piece is reduced as one chunk split over
        the ``shards`` devices (:func:`co2jax.engines.program.splits_whole`); empty: none.
      offload: the outer state lives in host memory (``pinned_host``): it is moved to the
        device for each send and apply and back after, and stays out of the inner loops'
        carry (no inner step reads it), so the accelerator holds it only around the outer
        step.
    """

    def __init__(
        self,
        outer: OuterOptimizer,
        walk: Walk,
        reducers: tuple,
        step: Callable,
        batch: Any,
        specs: Specs,
        shards: int = 1,
        offload: bool = False,
        split: tuple = (),
    ):
        self.outer, self.walk, self.reducers, self.shards = outer, walk, reducers, shards
        self.split = split or (False,) * len(walk.transfers)
        self.offload = offload
        self.step, self.batch, self.specs = step, batch, specs
        self.store: dict[int, tuple[Any, Any]] = {}  # a transfer in one piece, in flight
        self.plans: dict[int, chunks.Plan] = {}
        self.split_plans: dict[int, chunks.Plan] = {}  # a transfer in one piece, split
        self.losses: list[jax.Array] = []  # [steps] per segment
        self.aux: list[Any] = []  # the loss function's auxiliary outputs, [steps] leaves

    def _hold(self, c: Carry, i: int, held) -> Carry:
        return c._replace(inflight=(*c.inflight[:i], held, *c.inflight[i + 1 :]))

    def _add(self, c: Carry, i: int, s: jax.Array) -> Carry:
        return c._replace(sums=c.sums.at[i].add(s))

    def _outer_in(self, state: Any) -> Any:
        return jax.device_put(state, jax.memory.Space.Device) if self.offload else state

    def _outer_out(self, state: Any) -> Any:
        state = constrain(state, self.specs.outer_state)
        return jax.device_put(state, jax.memory.Space.Host) if self.offload else state

    def send(self, c: Carry, i: int) -> Carry:
        params = constrain(c.params, self.specs.outer_params)
        payload, state = self.outer.send(params, self._outer_in(c.outer_state), i)
        c = c._replace(outer_state=self._outer_out(state))
        t = self.walk.transfers[i]
        shards = split_over(self.reducers[i], self.shards)  # 1 for a weighted reduction
        if t.chunks == 1 and not (self.split[i] and shards > 1):
            self.store[i] = (payload, self.reducers[i](payload))
            return c
        pieces = chunks.pieces(self.reducers[i], t.chunks)
        replicas = axis_size(REPLICA)
        cut = chunks.plan(payload, self.reducers[i], pieces, shards=shards, replicas=replicas)
        if t.chunks == 1:  # one piece, each device's slice reduced here: kept out of the
            # loop's carry, so its collective may stay in flight across the loop
            piece = chunks.take(chunks.split(cut, payload), 0)
            self.split_plans[i] = cut
            self.store[i] = (piece, chunks.reduce(cut, self.reducers[i], piece))
            return c
        self.plans[i] = cut
        # a staged reducer (co2jax.comm.staged) scatters each piece at its step and gathers
        # it at the next: K pieces over the transfer's K + 1 steps (chunks.reduce_chunk)
        return self._hold(c, i, chunks.fill(cut, payload, varying_like, self.reducers[i]))

    def chunk(self, c: Carry, i: int, k: Any) -> Carry:
        plan = self.plans[i]
        buffer, piece, reduced = chunks.reduce_chunk(plan, self.reducers[i], c.inflight[i], k)
        c = self._add(c, i, sums(chunks.piece_values(plan, piece), reduced))
        return self._hold(c, i, buffer)

    def apply(self, c: Carry, i: int) -> Carry:
        if i in self.plans:
            reduced = chunks.result(self.plans.pop(i), c.inflight[i])
            c = self._hold(c, i, ())
        elif i in self.split_plans:
            cut, (piece, vectors) = self.split_plans.pop(i), self.store.pop(i)
            # the reduction read only with the loop's parameters: left free, XLA:TPU moved
            # the slices' layout back to the payload's (collectives over data) before the
            # loop and kept the all-gather synchronous there (docs/overlap.md)
            vectors, _ = jax.lax.optimization_barrier((vectors, c.params))
            # each group's reduction in the dtype a chunk's is kept in, as a spread transfer's
            acc = [v[None].astype(d) for v, d in zip(vectors, cut.dtypes, strict=True)]
            reduced = chunks.finish(cut, acc)
            c = self._add(c, i, sums(chunks.piece_values(cut, piece), vectors))
        else:
            payload, reduced = self.store.pop(i)
            pairs = (jax.tree.leaves(values(payload)), jax.tree.leaves(values(reduced)))
            c = self._add(c, i, sums(*pairs))
        params = constrain(c.params, self.specs.outer_params)
        params, state = self.outer.apply(params, self._outer_in(c.outer_state), i, reduced)
        return c._replace(
            params=constrain(params, self.specs.params), outer_state=self._outer_out(state)
        )

    def restart_poisoned(self, c: Carry, inner_init: Callable) -> Carry:
        """The round's end state with a poisoned replica restarted from the anchor
        (:func:`co2jax.engines.recovery.restart_poisoned`)."""
        outer_state = self._outer_in(c.outer_state)
        fresh_inner = lambda p: varying_like(inner_init(p), c.inner_state)
        params, inner_state, outer_state = recovery.restart_poisoned(
            constrain(c.params, self.specs.outer_params),
            c.inner_state,
            outer_state,
            fresh_inner,
            self.outer.init,
        )
        return c._replace(
            params=constrain(params, self.specs.params),
            inner_state=constrain(inner_state, self.specs.inner_state),
            outer_state=self._outer_out(outer_state),
        )

    def segment(self, c: Carry, segment: Segment) -> Carry:
        if self.offload:  # the loop runs without it: it stays in host memory meanwhile
            held = c.outer_state
            return self._segment(c._replace(outer_state=None), segment)._replace(outer_state=held)
        return self._segment(c, segment)

    def _segment(self, c: Carry, segment: Segment) -> Carry:
        start, stop = segment.start, segment.stop
        sends = {i: self.walk.transfers[i].send for i in segment.chunked}

        def one(c: Carry, xs) -> tuple[Carry, jax.Array]:
            b, k = xs
            for i, send in sends.items():  # no branch: each step's collective independent
                c = self.chunk(c, i, k - send)
            return self.step(c, b, k)

        xs = (jax.tree.map(lambda x: x[start:stop], self.batch), jnp.arange(start, stop))
        if stop - start == 1:  # one step: straight-line code, not a loop of one
            c, (loss, aux) = one(c, jax.tree.map(lambda x: x[0], xs))
            self.losses.append(loss[None])
            self.aux.append(jax.tree.map(lambda x: x[None], aux))
            return c
        c, (losses, aux) = jax.lax.scan(one, self._placed(c), xs)
        self.losses.append(losses)
        self.aux.append(aux)
        return self._placed(c)

    def step_aux(self) -> Any:
        """The loss function's auxiliary outputs of every step, ``[H]`` leaves."""
        return jax.tree.map(lambda *a: jnp.concatenate(a), *self.aux)

    def _placed(self, c: Carry) -> Carry:
        """The state where the layout says around a loop: the loop's carry keeps it (sharding
        propagation from an outer update on a split outer state would otherwise split the
        parameters in the loop and gather them at every step)."""
        outer_state = c.outer_state
        if outer_state is not None:
            outer_state = constrain(outer_state, self.specs.outer_state)
        return c._replace(
            params=constrain(c.params, self.specs.params),
            inner_state=constrain(c.inner_state, self.specs.inner_state),
            outer_state=outer_state,
        )


def inner_step(
    loss_fn, inner, specs: Specs, taken=None, by_slices: bool = True, check_vma: bool = True
) -> Callable:
    """``step(carry, batch_k, k) -> (carry, (loss, aux))``: one inner step of the replica on
    its batch of the step (:func:`co2jax.engines.gradients.value_and_grad`: ``by_slices``,
    each ``data`` device's slice and one mean over ``data``; the ``model`` axis the
    compiler's). ``loss_fn(params, batch, model_state) -> (loss, (aux, model_state))``; the
    carry's ``model_state`` is replaced by the one it returns. ``taken``: the replica's step
    count this round; a step at or past it leaves the parameters, the inner state and the
    model state as they are."""

    def step(c: Carry, batch, k) -> tuple[Carry, jax.Array]:
        # the loop's carry where the layout says, at the step's start and end: sharding
        # propagation would otherwise carry a split outer state's layout into the steps
        held = c.outer_state is not None  # None: held outside the loop (offloaded)
        outer_state = constrain(c.outer_state, specs.outer_state) if held else None
        c = c._replace(
            params=constrain(c.params, specs.params),
            inner_state=constrain(c.inner_state, specs.inner_state),
            outer_state=outer_state,
        )
        params = c.params
        if not by_slices:  # FSDP: each parameter gathered over data for the step (the batch
            # and its activations stay split), its gradient scattered back where it lies
            params = constrain(params, without(specs.params, DATA))
        (loss, (aux, model_state)), grads = gradients.value_and_grad(
            loss_fn, params, batch, by_slices, check_vma, c.model_state
        )
        if not by_slices:
            grads = constrain(grads, specs.params)
        updates, inner_state = inner.update(grads, c.inner_state, c.params)
        params = optax.apply_updates(c.params, updates)
        if taken is not None:  # a replica with fewer steps this round holds after them
            params, inner_state, model_state = tree_select(
                k < taken,
                (params, inner_state, model_state),
                (c.params, c.inner_state, c.model_state),
            )
        params = constrain(params, specs.params)
        inner_state = constrain(inner_state, specs.inner_state)
        if held:
            outer_state = constrain(c.outer_state, specs.outer_state)
        c = c._replace(
            params=params, inner_state=inner_state, outer_state=outer_state,
            model_state=model_state,
        )  # fmt: skip
        return c, (loss, aux)

    return step
