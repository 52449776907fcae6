"""How the round engine lays per-replica state over a replica's ``data`` devices.

Every per-replica leaf has a leading replica axis sharded over ``replica``. Inside a replica:

- ``shard_outer_state``: each parameter-shaped leaf of the outer step is split over ``data``
  along its largest dim that ``data`` divides (a leaf with none stays whole). The outer
  state is what ``outer.init`` makes of the parameter shards: a leaf is split along the dim
  where the state built from a shard is 1/D of the state built from the whole parameters,
  so anchors, momenta, fragments' pieces and residuals follow the parameters they come from.
- ``fsdp``: the parameters and the inner optimizer state are split the same way; each inner
  step all-gathers the parameters over ``data`` and reduce-scatters the gradients.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from co2jax.axes import DATA, REPLICA


def shard_dim(shape: tuple[int, ...], parts: int) -> int | None:
    """The dim a leaf is split on over ``data``: the largest one ``parts`` divides."""
    if parts <= 1:
        return None
    dims = [d for d in range(len(shape)) if shape[d] % parts == 0 and shape[d] >= parts]
    return max(dims, key=lambda d: (shape[d], -d)) if dims else None


def _spec(ndim: int, dim: int | None) -> P:
    # full-length specs, so that the shardings jit returns equal the ones init makes
    spec = [REPLICA] + [None] * (ndim - 1)
    if dim is not None:
        spec[1 + dim] = DATA
    return P(*spec)


class Layout:
    """The round engine's placement of params, inner and outer state over ``data``."""

    def __init__(self, data: int, shard_outer_state: bool, fsdp: bool):
        self.data = data
        self.fsdp = bool(fsdp)
        self.sharded = (bool(shard_outer_state) or self.fsdp) and data > 1

    def dim(self, shape) -> int | None:
        """The dim a parameter-shaped leaf (no replica axis) is split on, or None."""
        return shard_dim(tuple(shape), self.data) if self.sharded else None

    def local(self, shapes: Any) -> Any:
        """ShapeDtypeStructs of one device's shard of each parameter-shaped leaf."""

        def leaf(x):
            shape, dim = list(x.shape), self.dim(x.shape)
            if dim is not None:
                shape[dim] //= self.data
            return jax.ShapeDtypeStruct(tuple(shape), x.dtype)

        return jax.tree.map(leaf, shapes)

    def param_specs(self, params: Any) -> Any:
        """Specs of the parameters (and the inner state) with their leading replica axis."""
        if self.fsdp:
            return jax.tree.map(lambda x: _spec(x.ndim, self.dim(x.shape[1:])), params)
        return jax.tree.map(lambda x: _spec(x.ndim, None), params)

    def outer_specs(self, init, params: Any) -> Any:
        """Specs of ``init(params)`` (per replica; ``params`` without the replica axis)."""
        full = jax.eval_shape(init, params)
        if not self.sharded:
            return jax.tree.map(lambda x: _spec(x.ndim + 1, None), full)
        local = jax.eval_shape(init, self.local(params))
        paths = jax.tree_util.tree_leaves_with_path(full)
        specs = []
        for (path, f), s in zip(paths, jax.tree.leaves(local), strict=True):
            split = [d for d in range(len(f.shape)) if f.shape[d] != s.shape[d]]
            if not split:
                specs.append(_spec(len(f.shape) + 1, None))
            elif len(split) == 1 and f.shape[split[0]] == s.shape[split[0]] * self.data:
                specs.append(_spec(len(f.shape) + 1, split[0]))
            else:
                raise ValueError(
                    f"outer state leaf {jax.tree_util.keystr(path)} is {f.shape} from the whole "
                    f"parameters but {s.shape} from a data shard: it cannot be split over data"
                )
        return jax.tree.unflatten(jax.tree.structure(full), specs)

    # inside the round (shard_map; no replica axis)

    def shard(self, tree: Any) -> Any:
        """This device's shard of each whole parameter-shaped leaf (FSDP: already shards)."""
        if self.fsdp or not self.sharded:
            return tree

        def leaf(x):
            dim = self.dim(x.shape)
            if dim is None:
                return x
            size = x.shape[dim] // self.data
            start = jax.lax.axis_index(DATA) * size
            return jax.lax.dynamic_slice_in_dim(x, start, size, axis=dim)

        return jax.tree.map(leaf, tree)

    def unshard(self, shards: Any, full_like: Any) -> Any:
        """Whole leaves from this device's shards (FSDP: left as shards)."""
        if self.fsdp or not self.sharded:
            return shards

        # An all-gather would type its result as varying over "data"; params are
        # data-invariant, so place the shard in a zero buffer and psum it over the data axis
        # (the fast, intra-replica axis) instead.
        def leaf(x, ref):
            dim = self.dim(ref.shape)
            if dim is None:
                return x
            start = jax.lax.axis_index(DATA) * x.shape[dim]
            full = jnp.zeros(ref.shape, x.dtype)
            return jax.lax.psum(jax.lax.dynamic_update_slice_in_dim(full, x, start, dim), DATA)

        return jax.tree.map(leaf, shards, full_like)

    def gather_params(self, params: Any, full_shapes: Any) -> Any:
        """Whole parameters for the forward pass: FSDP shards all-gathered over ``data``;
        whole leaves marked data-varying so that grad gives this shard's gradient."""

        def leaf(p, full):
            if p.shape != full.shape:
                return jax.lax.all_gather(p, DATA, axis=self.dim(full.shape), tiled=True)
            return jax.lax.pcast(p, DATA, to="varying")

        return jax.tree.map(leaf, params, full_shapes)

    def reduce_grads(self, grads: Any, full_shapes: Any, params: Any) -> Any:
        """The data-mean of the gradients, reduce-scattered to this device's FSDP shards."""

        def leaf(g, full, p):
            if p.shape != full.shape:
                dim = self.dim(full.shape)
                return jax.lax.psum_scatter(g, DATA, scatter_dimension=dim, tiled=True) / self.data
            return jax.lax.pmean(g, DATA)

        return jax.tree.map(leaf, grads, full_shapes, params)

    def data_invariant(self, new: Any, old: Any) -> Any:
        """Averages over ``data`` a whole (unsplit) outer-state leaf that the update made
        data-varying: a statistic of this device's shards, such as CO2's ``penalty_scale``."""
        if not self.sharded:
            return new

        def leaf(x, ref):
            varying = jax.typeof(x).manual_axis_type.varying
            if DATA in varying and DATA not in jax.typeof(ref).manual_axis_type.varying:
                return jax.lax.pmean(x, DATA)
            return x

        return jax.tree.map(leaf, new, old)

    def sums(self, pairs: list[tuple[jax.Array, jax.Array, Any]]) -> jax.Array:
        """``[|p|^2, |r|^2, <p, r>]`` over (payload, reduced, full shape) leaf pairs: data
        shards of a leaf summed over ``data``, whole leaves counted once."""
        return split_sums([(p, r, p.shape != tuple(full.shape)) for p, r, full in pairs])


def split_sums(items: list[tuple[jax.Array, jax.Array, bool]]) -> jax.Array:
    """``[|p|^2, |r|^2, <p, r>]`` over (payload, reduced, is a data shard) arrays: the
    shards' sums added over ``data``, the whole arrays' counted once."""
    sharded, whole = [], jnp.zeros(3, jnp.float32)
    for p, r, shard in items:
        p, r = p.astype(jnp.float32), r.astype(jnp.float32)
        s = jnp.stack([jnp.sum(p * p), jnp.sum(r * r), jnp.sum(p * r)])
        if shard:
            sharded.append(s)
        else:
            whole = whole + s
    if not sharded:
        return whole
    return jax.lax.psum(sum(sharded), DATA) + whole
