"""Gossip: each replica averages with a small group of peers, never with all of them.

At outer step ``t`` the R replicas are dealt into groups of ``n`` by a permutation every
replica can compute on its own (no coordinator): NoLoCo's rule draws
``numpy.random.default_rng(seed).permutation(R)`` with ``seed = (t + 1) * H + 1`` (the inner
step count at the sync, plus one) and deals its entries round-robin into ``R / n`` groups
(group g holds the entries g, g + R/n, g + 2R/n, ...). A replica then receives the payloads of
its ``n - 1`` group mates and returns the group's mean.

The groups of a round are a *matching*. A ``ppermute`` needs its permutation at trace time,
so :func:`gossip_mean` precomputes the matchings of rounds ``0 .. cycle - 1`` (after that the
sequence repeats), keeps the distinct ones, and selects one per round with ``lax.switch``:
each branch is ``n - 1`` collective-permutes with static source/target pairs, and only the
selected branch runs. Bytes per replica per sync are ``(n - 1)`` payloads whatever R is.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from co2jax._checks import check_axis_name, check_int
from co2jax.axes import REPLICA, axis_size
from co2jax.comm.reducer import Encoded, Payload, Reducer
from co2jax.tree import tree_bytes

Matching = tuple[tuple[int, ...], ...]


def gossip_groups(replicas: int, group_size: int, seed: int) -> Matching:
    """The groups of one round: ``default_rng(seed).permutation(replicas)`` dealt
    round-robin into ``replicas // group_size`` groups, each in dealing order.

    Example:
      >>> gossip_groups(4, 2, seed=5)
      ((3, 2), (1, 0))
    """
    count = replicas // group_size
    perm = [int(x) for x in np.random.default_rng(seed).permutation(replicas)]
    return tuple(tuple(perm[g::count]) for g in range(count))


def round_seed(round_index: int, sync_every: int) -> int:
    """The seed of round ``t``'s permutation: the inner step count at its sync, plus one."""
    return (round_index + 1) * sync_every + 1


@functools.lru_cache(maxsize=64)
def matchings(
    replicas: int, group_size: int, sync_every: int, cycle: int
) -> tuple[np.ndarray, tuple[Matching, ...]]:
    """``(table, distinct)``: ``distinct[table[t]]`` is round t's matching (t < cycle), every
    group sorted (a group's mean does not depend on its order)."""
    distinct: dict[Matching, int] = {}
    table = np.zeros(cycle, np.int32)
    for t in range(cycle):
        groups = gossip_groups(replicas, group_size, round_seed(t, sync_every))
        key = tuple(sorted(tuple(sorted(g)) for g in groups))
        table[t] = distinct.setdefault(key, len(distinct))
    return table, tuple(distinct)


def shifts(matching: Matching) -> list[list[tuple[int, int]]]:
    """The ``n - 1`` ppermute permutations that bring every group member's payload to every
    other: shift s sends member j of each group to member (j + s) mod n."""
    n = len(matching[0])
    return [[(g[j], g[(j + s) % n]) for g in matching for j in range(n)] for s in range(1, n)]


def group_mean(tree, matching: Matching, axis_name: str = REPLICA):
    """Every leaf's mean over its replica's group of ``matching`` (groups of one size n),
    by the ``n - 1`` collective-permutes of :func:`shifts`, summed in float32, in the
    leaves' dtypes."""
    perms = shifts(matching)

    def leaf(x):
        total = x.astype(jnp.float32)
        for perm in perms:
            total = total + jax.lax.ppermute(x, axis_name, perm).astype(jnp.float32)
        return (total / len(matching[0])).astype(x.dtype)

    return jax.tree.map(leaf, tree)


@dataclasses.dataclass(frozen=True)
class GossipForm:
    """The static form of a gossip payload: ``data = (values, round)``; decoding drops the
    round (replica-invariant and never sent: each replica computes the matching itself)."""

    def combine(self, data):
        tree, _ = data
        if any(x.shape[0] != 1 for x in jax.tree.leaves(tree)):
            raise ValueError(
                "a gossip payload is exchanged with a replica's group only: there is no "
                "all-gather form to combine R of them (run it in an SPMD driver)"
            )
        return jax.tree.map(lambda x: x[0], tree)


def gossip_payload(values: Payload, round_index: jax.Array) -> Encoded:
    """``values`` to send at round ``round_index`` (0-d int32, replica-invariant)."""
    return Encoded((values, round_index), GossipForm())


def gossip_mean(
    group_size: int = 2,
    sync_every: int = 1,
    cycle: int = 32,
    axis_name: str = REPLICA,
) -> Reducer:
    """The mean over each replica's gossip group of the round (:func:`gossip_groups`).

    Takes :func:`gossip_payload` (the values and the round index) and returns the group mean
    of the values in float32 sums, in their dtypes. With ``group_size`` equal to R every
    group is all replicas: the all-reduce mean, by ``R - 1`` collective-permutes.

    Args:
      group_size: n, replicas per group (R must be a multiple of it).
      sync_every: H, the inner steps per round (the permutation's seed counts inner steps).
      cycle: rounds whose matchings are precomputed; round t uses round ``t mod cycle``'s.
      axis_name: the replica axis.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> reduce = gossip_mean(2, sync_every=4)
      >>> x = jnp.arange(4.0)  # replica r holds r
      >>> jax.vmap(lambda v: reduce(gossip_payload(v, jnp.int32(0))), axis_name="replica")(x)
      Array([0.5, 0.5, 2.5, 2.5], dtype=float32)
    """
    group_size = check_int("group_size", group_size, 1)
    sync_every = check_int("sync_every", sync_every, 1)
    cycle = check_int("cycle", cycle, 1)
    check_axis_name("axis_name", axis_name)

    def reduce(payload: Encoded):
        if not isinstance(payload, Encoded) or not isinstance(payload.form, GossipForm):
            raise ValueError(
                "gossip_mean reduces a co2jax.comm.gossip_payload(values, round), got "
                f"{type(payload).__name__}"
            )
        tree, round_index = payload.data
        r = axis_size(axis_name)
        if r % group_size:
            raise ValueError(f"group_size={group_size} must divide the number of replicas, R={r}")
        if group_size == 1:
            return tree
        table, distinct = matchings(r, group_size, sync_every, cycle)
        branches = [
            functools.partial(group_mean, matching=m, axis_name=axis_name) for m in distinct
        ]
        if len(branches) == 1:
            return branches[0](tree)
        index = jnp.asarray(table)[round_index % cycle]
        return jax.lax.switch(index, branches, tree)

    def wire(shapes, replicas: int) -> float:
        return float(min(group_size, replicas) - 1) * tree_bytes(shapes)

    # no gather form: a replica exchanges with its group, not with every replica
    return Reducer(f"gossip(n={group_size})", reduce, wire, reach="group")
