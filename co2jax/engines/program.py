"""What a round program runs, chosen once when it is built: an immutable record.

For a schedule, the payloads' shapes and the mesh, :func:`choose` decides the transfers as the
program runs them (overlapped ones cut into chunks where spread,
:func:`co2jax.comm.policy.spreads`), the reducer of each (:func:`co2jax.comm.policy.select`),
the bytes one replica sends per round and the walk of the schedule
(:func:`co2jax.engines.walk.walk`). The engine builds its program from the record and hands
the record out (:meth:`co2jax.RoundTrainer.program`); nothing is decided while tracing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax

from co2jax.axes import REPLICA
from co2jax.comm import chunks, policy
from co2jax.comm.reducer import Reducer
from co2jax.engines.walk import Walk, walk
from co2jax.kernels.api import LOWERED
from co2jax.protocol import OuterOptimizer, Transfer
from co2jax.protocol import spread as spread_transfers
from co2jax.tree import tree_bytes


class RoundPlan(NamedTuple):
    """What one round program runs.

    Attributes:
      transfers: the schedule as run (chunks included).
      reducers: one per transfer.
      kinds: per transfer, the reducer's label (``"outer"``: the algorithm's own kept).
      wire_bytes: bytes one replica sends per round (every chunk, by its reducer).
      walk: the schedule's segments (:class:`~co2jax.engines.walk.Walk`).
      payload_shapes: per transfer, its payload's value shapes (one replica).
      shards: the devices of one replica a chunk is split over before it crosses the replica
        axis (:func:`co2jax.comm.chunks.reduce`; 1: each device sends whole chunks).
      split: per transfer, whether one sent in one piece goes as a single chunk split over
        the ``shards`` devices (:func:`splits_whole`); empty: none does.
    """

    transfers: tuple[Transfer, ...]
    reducers: tuple[Reducer, ...]
    kinds: tuple[str, ...]
    wire_bytes: float
    walk: Walk
    payload_shapes: tuple
    shards: int = 1
    split: tuple[bool, ...] = ()

    @property
    def reducer_kind(self) -> str:
        """One label for the round: the kind every transfer uses, or each joined by ``/``."""
        kinds = set(self.kinds)
        return kinds.pop() if len(kinds) == 1 else "/".join(self.kinds)


class RoundProgram(NamedTuple):
    """A compiled-on-first-call round: its :class:`RoundPlan` and the jitted function
    ``fn(state, batch, (weights, steps)) -> (state, metrics)``."""

    plan: RoundPlan
    fn: Callable

    @property
    def reducer_kind(self) -> str:
        return self.plan.reducer_kind

    @property
    def transfers(self) -> tuple[Transfer, ...]:
        return self.plan.transfers


def check_spread(spread: Any) -> Any:
    if not (
        spread is None or isinstance(spread, bool) or (isinstance(spread, int) and spread >= 1)
    ):
        raise ValueError(
            f"spread must be None, True, False or a chunk count >= 1, got spread={spread!r}"
        )
    return spread


def spread_schedule(
    outer: OuterOptimizer, transfers: tuple, spread: Any, platform: str, payload_shapes: list
) -> tuple[Transfer, ...]:
    """The transfers as the program runs them: overlapped ones in chunks where spread
    (``None``: on the platforms that overlap chunks, :func:`co2jax.comm.policy.spreads`)."""
    if spread is not None and spread is not False and not outer.reducer.chunkable:
        raise ValueError(
            f"spread={spread!r}: the reducer {outer.reducer.name!r} sends its payload only "
            "whole (it cannot be cut into chunks); use spread=None or False"
        )
    if spread is None:
        spread = policy.spreads(platform) and outer.reducer.chunkable
    if spread is False:
        return transfers
    if spread is True:
        count = lambda t, i: policy.chunk_count(t.apply - t.send, tree_bytes(payload_shapes[i]))
    else:
        count = lambda t, i: spread
    return spread_transfers(transfers, count)


def split_over(reducer: Reducer, shards: int) -> int:
    """The devices a chunked payload for ``reducer`` is split over
    (:func:`co2jax.comm.chunks.reduce`): ``shards`` when the reducer is ``splittable``, and
    neither hands the payloads to a fused update gathered nor stands only whole; else 1."""
    ok = reducer.splittable and reducer.chunkable and not reducer.gathered
    return shards if ok else 1


def splits_whole(t: Transfer, reducer: Reducer, split_state: bool, shards: int) -> bool:
    """Whether transfer ``t``, sent in one piece, is reduced as one chunk split over the
    replica's ``shards`` devices (:func:`co2jax.comm.chunks.reduce`, ``chunks=1``): when it
    is overlapped (sent before the step it is applied at), the outer state it comes from is
    split inside the replica (``split_state``) and ``reducer`` can be split
    (:func:`split_over`).

    Such a payload already lies split over ``data``. Reduced whole, its one flat buffer was
    gathered over ``data`` first and its all-gather over ``replica`` then ran synchronously
    before the inner loop (TPU ahead of time, ``docs/overlap.md``); split, each device
    sends its 1/``shards`` of the rows, and that all-gather starts before the loop and is
    done after it. The values are the whole reduction's: a splittable reducer reduces whole
    units (rows of elements, codec blocks) on their own, :math:`\\bar p_u = \\frac1R
    \\sum_r p_{r,u}` for every unit :math:`u`, whichever device holds it.

    Example:
      >>> from co2jax.comm import all_gather_mean
      >>> from co2jax.protocol import Transfer
      >>> splits_whole(Transfer(0, 4), all_gather_mean(), True, 2)
      True
      >>> splits_whole(Transfer(4, 4), all_gather_mean(), True, 2)  # synchronous: as it was
      False
    """
    return bool(
        split_state and t.chunks == 1 and t.send < t.apply and split_over(reducer, shards) > 1
    )


def wire_bytes(
    run: tuple, payload_shapes: list, reducers: tuple, replicas: int, shards: int = 1
) -> float:
    """Bytes one replica sends per round: every transfer (every chunk) by its reducer. A
    transfer in one piece counts its payload's bytes, split over devices or not
    (:func:`splits_whole`: its padding to whole rows per device left out, so every layout
    reports the same count)."""
    total = 0.0
    for t, shapes, reducer in zip(run, payload_shapes, reducers, strict=True):
        if t.chunks == 1:
            total += reducer.wire_bytes(shapes, replicas)
            continue
        pieces = chunks.pieces(reducer, t.chunks)
        cut = chunks.plan(
            shapes, reducer, pieces, shards=split_over(reducer, shards), replicas=replicas
        )
        piece = [
            jax.ShapeDtypeStruct(cut.piece_shape(g), cut.dtypes[g]) for g in range(len(cut.units))
        ]
        # a staged reducer's t.chunks steps each scatter and gather a piece (two halves of a
        # ring all-reduce's bytes), one more step than it has pieces (chunks.reduce_chunk)
        total += t.chunks * reducer.wire_bytes(piece, replicas)
    return total


def choose(
    outer: OuterOptimizer,
    transfers: tuple[Transfer, ...],
    steps: int,
    payload_shapes: list,
    *,
    reducer: str,
    spread: Any,
    platform: str,
    replicas: int,
    split_state: bool = False,
    devices_per_replica: int = 1,
    split_payload: bool = True,
    shared_slices: bool = False,
) -> RoundPlan:
    """The :class:`RoundPlan` of ``outer``'s resolved ``transfers`` on a mesh of
    ``platform`` with ``replicas`` replicas (``reducer``: the engine's choice).
    ``split_state``: the outer state is split inside each replica; a compiled fused kernel
    runs whole on each device (:func:`co2jax.kernels.layout.whole_per_device`), so on a
    platform that compiles it the replicas' payloads are averaged before the update
    instead of being handed to it gathered. ``split_payload``: each chunk of a spread
    transfer is split over the replica's ``devices_per_replica`` devices, each sending its
    slice (:func:`co2jax.comm.policy.chunk_shards`); so is an overlapped transfer in one
    piece from a split outer state (:func:`splits_whole`). ``shared_slices``: several
    replicas share each of several TPU slices (:func:`co2jax.comm.policy.chunk_kind`)."""
    run = spread_schedule(outer, transfers, spread, platform, payload_shapes)
    gathered = outer.accepts_gathered and not (split_state and platform in LOWERED)
    chosen = [
        policy.select(
            outer.reducer,
            reducer,
            platform=platform,
            replicas=replicas,
            payload_elements=sum(x.size for x in jax.tree.leaves(shapes)),
            overlapped=t.send < t.apply,
            # spread, every overlapped transfer is reduced in pieces inside its steps
            whole=t.chunks == 1 and (run == transfers or t.send == t.apply),
            accepts_gathered=gathered,
            axis_name=REPLICA,
            steps=t.chunks,
            shared_slices=shared_slices,
        )
        for t, shapes in zip(run, payload_shapes, strict=True)
    ]
    shards = policy.chunk_shards(devices_per_replica) if split_payload else 1
    unfused = lambda r: r.unfused if r.unfused is not None else r
    split = tuple(
        splits_whole(t, unfused(r), split_state, shards)
        for t, (_, r) in zip(run, chosen, strict=True)
    )
    # a payload cut into chunks (or split) cannot use a fused kernel's whole-payload layout:
    # its reducer without it
    reducers = tuple(
        unfused(r) if t.chunks > 1 or cut else r
        for t, (_, r), cut in zip(run, chosen, split, strict=True)
    )
    return RoundPlan(
        run,
        reducers,
        tuple(k for k, _ in chosen),
        wire_bytes(run, payload_shapes, reducers, replicas, shards),
        walk(run, steps),
        tuple(payload_shapes),
        shards,
        split,
    )
