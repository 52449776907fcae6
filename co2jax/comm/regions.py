"""Two-level reductions: a mean inside each region of the replica axis, and a periodic mean
over the regions.

The R replicas are dealt into G *regions* of m = R / G contiguous replicas: region g holds
replicas ``g*m .. g*m + m - 1``. On a mesh whose replica axis runs slice by slice (or
datacenter by datacenter), a region is one slice and its links are fast; a transfer between
regions crosses the slow links.

One :class:`~co2jax.comm.Reducer` serves both levels; the payload says which:

- :func:`region_payload` ``(values)``: the mean over the sender's region, by ``m - 1``
  collective-permutes inside the regions (static source/target pairs: nothing crosses a region's
  border). A replica sends ``(m - 1)`` payloads on the fast links.
- :func:`global_payload` ``(values, round)``: the mean over every replica (``lax.pmean``),
  only in the rounds ``round = every - 1, 2 every - 1, ...``; the collective runs inside one
  branch of a ``lax.cond`` on the round (replica-invariant), so the other rounds send nothing and
  return the values as they are. Its bytes, ``2 (R - 1) / R`` payloads per global round, are
  counted per round as that over ``every``.

``lax.psum(..., axis_index_groups=...)`` would be the one-line region mean, but it is not
available under ``shard_map`` on the jax this project runs on; the collective-permutes are
the form that runs in every driver (``vmap`` and ``shard_map``).
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from co2jax._checks import check_axis_name, check_int
from co2jax.axes import REPLICA, axis_size
from co2jax.comm.gossip import group_mean
from co2jax.comm.reducer import Encoded, Payload, Reducer, ring_bytes
from co2jax.tree import tree_bytes, varying_like


def region_blocks(replicas: int, regions: int) -> tuple[tuple[int, ...], ...]:
    """The regions as blocks of contiguous replica indices.

    Example:
      >>> region_blocks(6, 2)
      ((0, 1, 2), (3, 4, 5))
    """
    if replicas % regions:
        raise ValueError(
            f"regions={regions} must divide the number of replicas, R={replicas} (each region "
            "holds R / regions replicas)"
        )
    m = replicas // regions
    return tuple(tuple(range(g * m, (g + 1) * m)) for g in range(regions))


def _one(stacked, what: str):
    """One payload's values (``Encoded.decode``): there is no all-gather form to combine R."""
    if any(x.shape[0] != 1 for x in jax.tree.leaves(stacked)):
        raise ValueError(
            f"{what}: there is no all-gather form to combine R of them (run it in an SPMD driver)"
        )
    return jax.tree.map(lambda x: x[0], stacked)


@dataclasses.dataclass(frozen=True)
class RegionForm:
    """The static form of a region payload (``data``: the values); decoding one payload
    gives its values."""

    def combine(self, data):
        return _one(data, "a region payload is averaged inside its region only")


@dataclasses.dataclass(frozen=True)
class GlobalForm:
    """The static form of a periodic global payload: ``data = (values, round)``; the round
    (replica-invariant) is never sent; decoding one payload gives its values."""

    def combine(self, data):
        return GlobalValues(
            _one(data[0], "a periodic global payload is reduced in its rounds only")
        )


class GlobalValues(NamedTuple):
    """A global payload's values, decoded: a pytree node that tells :func:`two_level_mean`'s
    ``wire_bytes`` (which a driver may call with the decoded shapes) the level."""

    values: Any


def region_payload(values: Payload) -> Encoded:
    """``values`` to average over the sender's region."""
    return Encoded(values, RegionForm())


def global_payload(values: Payload, round_index: jax.Array) -> Encoded:
    """``values`` to average over every replica if ``round_index`` (0-d int32,
    replica-invariant) is a global round."""
    return Encoded((values, round_index), GlobalForm())


def slow_link_bytes(payload_bytes: float, replicas: int, every: int) -> float:
    """Bytes one replica sends between regions per round: a ring all-reduce of
    ``payload_bytes`` over ``replicas`` every ``every`` rounds.

    Example:
      >>> slow_link_bytes(100.0, replicas=4, every=2)
      75.0
    """
    return ring_bytes(payload_bytes, replicas) / every


def two_level_mean(regions: int, every: int, axis_name: str = REPLICA) -> Reducer:
    """The reducer of a two-level (hierarchical) outer step: region means and a mean over all
    replicas every ``every`` rounds (see the module's docstring).

    Both means sum in float32 and return the values in their dtypes. A global round returns
    the mean over all R replicas, which is the mean over the regions' means (equal regions).
    Its ``wire_bytes`` is per round: ``(m - 1)`` payloads for a region payload (fast links),
    ``2 (R - 1) / (R every)`` payloads for a global one (slow links).

    Args:
      regions: G, the number of regions (divides R).
      every: K, the rounds per global round (>= 1).
      axis_name: the replica axis.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> reduce = two_level_mean(regions=2, every=2)
      >>> x = jnp.arange(4.0)  # replica r holds r; regions {0, 1} and {2, 3}
      >>> jax.vmap(lambda v: reduce(region_payload(v)), axis_name="replica")(x)
      Array([0.5, 0.5, 2.5, 2.5], dtype=float32)
      >>> glob = lambda t: jax.vmap(lambda v: reduce(global_payload(v, jnp.int32(t))),
      ...                           axis_name="replica")(x)
      >>> glob(0), glob(1)  # round 0 is not a global round; round 1 is
      (Array([0., 1., 2., 3.], dtype=float32), Array([1.5, 1.5, 1.5, 1.5], dtype=float32))
    """
    regions = check_int("regions", regions, 1)
    every = check_int("every", every, 1)
    check_axis_name("axis_name", axis_name)

    def region_mean(tree):
        blocks = region_blocks(axis_size(axis_name), regions)
        return tree if len(blocks[0]) == 1 else group_mean(tree, blocks, axis_name)

    def global_mean(tree, round_index):
        def reduce_all(t):
            mean = jax.tree.map(
                lambda x: jax.lax.pmean(x.astype(jnp.float32), axis_name).astype(x.dtype), t
            )
            return varying_like(mean, t)  # the cond's branches keep one type

        return jax.lax.cond(round_index % every == every - 1, reduce_all, lambda t: t, tree)

    def reduce(payload: Encoded):
        if isinstance(payload, Encoded) and isinstance(payload.form, RegionForm):
            return region_mean(payload.data)
        if isinstance(payload, Encoded) and isinstance(payload.form, GlobalForm):
            return global_mean(*payload.data)
        raise ValueError(
            "two_level_mean reduces a co2jax.comm.region_payload(values) or a "
            f"co2jax.comm.global_payload(values, round), got {type(payload).__name__}"
        )

    def wire(shapes, replicas: int) -> float:  # the payload, encoded or decoded
        if isinstance(shapes, Encoded):
            global_ = isinstance(shapes.form, GlobalForm)
            shapes = GlobalValues(shapes.data[0]) if global_ else shapes.data
        if isinstance(shapes, GlobalValues):
            return slow_link_bytes(tree_bytes(shapes.values), replicas, every)
        return float(replicas // regions - 1) * tree_bytes(shapes)

    # no gather form: a region payload reaches its region only
    return Reducer(f"two_level(regions={regions}, every={every})", reduce, wire, reach="group")
