"""Pytree helpers shared by every layer: arithmetic, flattening, varying-axis groups.

Nothing here communicates. :func:`varying_groups` matters inside ``jax.shard_map``: there a
data shard of one leaf may sit beside a whole leaf (the round engine's sharded outer state),
and anything that packs leaves into one buffer must pack each group on its own, or the whole
leaf comes back typed (and valued) as a function of the shard.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp


def tree_sub(a: Any, b: Any) -> Any:
    return jax.tree.map(lambda x, y: x - y, a, b)


def tree_all_finite(tree: Any) -> jax.Array:
    """A 0-d bool: True when every element of every leaf is finite."""
    leaves = jax.tree.leaves(tree)
    if not leaves:
        return jnp.array(True)
    return jnp.stack([jnp.all(jnp.isfinite(x)) for x in leaves]).all()


def tree_select(pred: jax.Array, on_true: Any, on_false: Any) -> Any:
    return jax.tree.map(lambda t, f: jnp.where(pred, t, f), on_true, on_false)


def tree_size(tree: Any) -> int:
    """Elements in every leaf of ``tree`` (arrays or ShapeDtypeStructs)."""
    return sum(math.prod(x.shape) for x in jax.tree.leaves(tree))


def tree_bytes(tree: Any) -> int:
    return sum(math.prod(x.shape) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


def common_dtype(leaves: list) -> Any:
    """The dtype every leaf converts to without loss (float32 for mixed float widths)."""
    return jnp.result_type(*(x.dtype for x in leaves)) if leaves else jnp.float32


def flatten(leaves: list, dtype: Any = jnp.float32) -> tuple[jax.Array, Callable]:
    """One ``dtype`` vector of ``leaves`` (a list of arrays), and the function that splits a
    vector of that length back into arrays shaped (and typed) like the leaves."""
    if not leaves:
        return jnp.zeros((0,), dtype), lambda v: []
    flat = jnp.concatenate([x.astype(dtype).ravel() for x in leaves])
    shapes = [(x.shape, x.dtype) for x in leaves]

    def unflatten(vector: jax.Array) -> list:
        pieces, offset = [], 0
        for shape, dt in shapes:
            n = math.prod(shape)
            pieces.append(vector[offset : offset + n].reshape(shape).astype(dt))
            offset += n
        return pieces

    return flat, unflatten


def varying_axes(x: Any) -> frozenset | None:
    """The mesh axes ``x`` varies over inside ``shard_map`` (``None`` outside it)."""
    typed = x if isinstance(x, jax.ShapeDtypeStruct) else jax.typeof(x)
    kind = getattr(typed, "manual_axis_type", None)
    return None if kind is None else frozenset(kind.varying)


def varying_like(zeros: Any, ref: Any) -> Any:
    """``zeros`` typed as varying over the mesh axes ``ref`` varies over, leaf by leaf (a
    loop's carry and a ``lax.cond``'s branches keep their types; a no-op outside
    ``shard_map``)."""

    def leaf(z, r):
        missing = (varying_axes(r) or frozenset()) - (varying_axes(z) or frozenset())
        return jax.lax.pcast(z, tuple(sorted(missing)), to="varying") if missing else z

    return jax.tree.map(leaf, zeros, ref)


def all_over_shards(ok: jax.Array, keep: frozenset = frozenset()) -> jax.Array:
    """A boolean flag and-ed over every mesh axis it varies over inside ``shard_map``,
    except those in ``keep``: a decision computed from shards (one shard's NaN, say) that
    every device holding a piece of the value must take alike. Outside ``shard_map``, and
    under ``shard_map(check_vma=False)`` (no varying-axis types), ``ok`` itself."""
    axes = tuple(sorted((varying_axes(ok) or frozenset()) - keep))
    return jax.lax.pmin(ok.astype(jnp.int32), axes) > 0 if axes else ok


def varying_groups(leaves: list) -> tuple[tuple[int, ...], ...]:
    """Indices of ``leaves`` grouped by the mesh axes they vary over, in order of first
    appearance (one group outside ``shard_map``)."""
    groups: dict[Any, list[int]] = {}
    for i, x in enumerate(leaves):
        groups.setdefault(varying_axes(x), []).append(i)
    return tuple(tuple(g) for g in groups.values())


def by_varying_axes(tree: Any, fn: Callable[[list], list]) -> Any:
    """Applies ``fn`` to each :func:`varying_groups` group of ``tree``'s leaves."""
    leaves, treedef = jax.tree.flatten(tree)
    out: list[Any] = [None] * len(leaves)
    for group in varying_groups(leaves):
        for i, y in zip(group, fn([leaves[i] for i in group]), strict=True):
            out[i] = y
    return jax.tree.unflatten(treedef, out)


def consensus_distance(stacked: Any) -> jax.Array:
    """How far replicas' parameters are apart: ``sqrt(mean_r |x_r - mean x|^2) / |mean x|``
    over every leaf of ``stacked`` (leading axis: replica), in float32 (0: all equal).

    Example:
      >>> import jax.numpy as jnp
      >>> consensus_distance({"w": jnp.array([[1.0], [3.0]])})  # deviations of 1 around 2
      Array(0.5, dtype=float32)
    """
    leaves = [x.astype(jnp.float32) for x in jax.tree.leaves(stacked)]
    spread = sum(jnp.sum(jnp.mean((x - x.mean(0)) ** 2, axis=0)) for x in leaves)
    size = sum(jnp.sum(x.mean(0) ** 2) for x in leaves)
    return jnp.sqrt(spread) / jnp.maximum(jnp.sqrt(size), jnp.finfo(jnp.float32).tiny)


_GOLDEN = 0x9E3779B1  # spreads consecutive positions over uint32


def _bits(x: jax.Array) -> jax.Array:
    """A leaf's elements as uint32 bit patterns (floats bit for bit, bools and ints as
    values; 64-bit leaves split into two words)."""
    x = jnp.asarray(x)
    if x.dtype == jnp.bool_:
        return x.astype(jnp.uint32).reshape(-1)
    size = jnp.dtype(x.dtype).itemsize
    if size == 8:
        return jax.lax.bitcast_convert_type(x, jnp.uint32).reshape(-1)
    unsigned = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}[size]
    return jax.lax.bitcast_convert_type(x, unsigned).astype(jnp.uint32).reshape(-1)


def _mix(h: jax.Array) -> jax.Array:
    """A bijection of uint32 (a 32-bit avalanche finalizer): every input bit moves about
    half of the output bits."""
    h = h ^ (h >> 16)
    h = h * jnp.uint32(0x85EBCA6B)
    h = h ^ (h >> 13)
    h = h * jnp.uint32(0xC2B2AE35)
    return h ^ (h >> 16)


def fingerprint(tree: Any) -> jax.Array:
    """A uint32 digest of every bit of ``tree``'s leaves, in leaf order: equal trees give
    equal digests, and a change of any one element (one bit) always changes it.

    ``sum_i mix(b_i ^ s_i) mod 2^32`` over the leaves' bit patterns ``b_i``, with a salt
    ``s_i`` per position and leaf and ``mix`` a bijection of uint32: a change of one element
    changes its term and nothing else, so the sum moves. Folded with each leaf's size. Not a
    cryptographic hash: it detects drift, not tampering.

    Example:
      >>> import jax.numpy as jnp
      >>> a = {"w": jnp.ones(3)}
      >>> bool(fingerprint(a) == fingerprint({"w": jnp.ones(3)}))
      True
      >>> bool(fingerprint(a) == fingerprint({"w": jnp.ones(3).at[1].set(1 + 2**-23)}))
      False
    """
    total = jnp.uint32(0)
    for j, leaf in enumerate(jax.tree.leaves(tree)):
        bits = _bits(leaf)
        salt = jnp.arange(bits.size, dtype=jnp.uint32) * jnp.uint32(_GOLDEN) + jnp.uint32(j)
        total = _mix(total ^ jnp.uint32(bits.size)) + jnp.sum(_mix(bits ^ salt), dtype=jnp.uint32)
    return total
