"""Device meshes with co2jax's named axes: replica (slow, outer), data and model (fast, inner).

Outer optimizers communicate over ``REPLICA`` only; the inner steps of one replica use
``DATA`` (gradient averaging, sharded outer state) and ``MODEL``. On multi-slice TPU the
replica axis spans slices, so the slow cross-slice network (DCN) carries only the outer
reduction; elsewhere the mesh is a plain device grid.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh

from co2jax.axes import AXES, DATA, MODEL, REPLICA

__all__ = [
    "AXES",
    "DATA",
    "MODEL",
    "REPLICA",
    "compiler_sharded",
    "make_mesh",
    "replica_map",
    "replicas_per_slice",
    "resolve_sizes",
    "warn_hybrid",
]


def resolve_sizes(sizes: dict[str, int], device_count: int) -> dict[str, int]:
    """Fills the one size given as -1 so that the sizes multiply to ``device_count``.

    Example:
      >>> resolve_sizes({"replica": 2, "data": -1, "model": 1}, 8)
      {'replica': 2, 'data': 4, 'model': 1}
    """
    fill = [name for name, size in sizes.items() if size == -1]
    if len(fill) > 1:
        raise ValueError(f"at most one mesh size may be -1 (fill), got {sizes}")
    for name, size in sizes.items():
        if size != -1 and (isinstance(size, bool) or not isinstance(size, int) or size < 1):
            raise ValueError(f"mesh size {name} must be an integer >= 1 or -1, got {name}={size!r}")
    known = math.prod(size for size in sizes.values() if size != -1)
    if fill:
        if device_count % known:
            raise ValueError(
                f"mesh sizes {sizes}: the fixed sizes multiply to {known}, which does not divide "
                f"the {device_count} devices"
            )
        sizes = {**sizes, fill[0]: device_count // known}
    elif known != device_count:
        raise ValueError(
            f"mesh sizes {sizes} multiply to {known}, but there are {device_count} devices; "
            "give one size as -1 to fill, or pass devices="
        )
    return sizes


def _num_slices(devices: Sequence) -> int:
    return len({getattr(d, "slice_index", 0) for d in devices})


def replicas_per_slice(mesh: Mesh) -> int:
    """Replicas that share a slice when the replica axis crosses TPU slices (0 when it does
    not: one slice, or not a TPU)."""
    grid = mesh.devices
    k = mesh.axis_names.index(REPLICA)
    slices = [
        {getattr(d, "slice_index", 0) for d in np.take(grid, r, axis=k).flat}
        for r in range(grid.shape[k])
    ]
    count = len(set().union(*slices))
    if count < 2:
        return 0
    return grid.shape[k] // count


HYBRID = (
    "{n} replicas share each TPU slice: each replica exchanges with the other slices' "
    "replicas on its own, {n}x the DCN bytes per slice of one replica per slice (150 MiB "
    "against 75 a round, 25M parameters, R = 8 on 4 v5e 2x4 slices); use replica={slices} "
    "(one per slice)"
)


_WARNED: set = set()


def warn_hybrid(mesh: Mesh, stacklevel: int = 3) -> bool:
    """Warns in one line (once per device layout) when replicas share the slices of a
    multi-slice mesh; True if they do."""
    n = replicas_per_slice(mesh)
    key = tuple(d.id for d in mesh.devices.flat), mesh.devices.shape
    if n > 1 and key not in _WARNED:
        _WARNED.add(key)
        message = HYBRID.format(n=n, slices=mesh.shape[REPLICA] // n)
        warnings.warn(message, stacklevel=stacklevel)
    return n > 1


def make_mesh(
    replica: int = 1,
    data: int = -1,
    model: int = 1,
    *,
    devices: Sequence | None = None,
    axis_type: AxisType = AxisType.Explicit,
) -> Mesh:
    """A ``(replica, data, model)`` mesh over ``devices`` (default: all devices).

    One size may be -1: it fills the devices left over. On TPU with several slices, the replica
    axis must be a multiple of the slice count and is laid across slices; more than one
    replica per slice is warned about in one line (its in-slice transfers do not overlap the
    inner steps: ``docs/overlap.md``); otherwise devices are laid out by
    ``mesh_utils.create_device_mesh`` (topology-aware on TPU and GPU).

    Args:
      replica: replicas (the slow outer axis).
      data: data-parallel devices inside one replica.
      model: model-parallel devices inside one replica.
      devices: the devices to use.
      axis_type: ``AxisType.Explicit`` (default) or ``AxisType.Auto`` for every axis.

    Example:
      >>> import jax
      >>> mesh = make_mesh(replica=1, data=-1, devices=jax.devices()[:1])
      >>> dict(mesh.shape)
      {'replica': 1, 'data': 1, 'model': 1}
    """
    devices = list(jax.devices() if devices is None else devices)
    if not devices:
        raise ValueError("make_mesh needs at least one device, got devices=[]")
    try:
        sizes = resolve_sizes({REPLICA: replica, DATA: data, MODEL: model}, len(devices))
    except ValueError as e:
        if devices[0].platform != "cpu" or "devices" not in str(e):
            raise
        n = math.prod(s for s in (replica, data, model) if isinstance(s, int) and s > 0)
        raise ValueError(
            f"{e}. On CPU, emulate devices: JAX_NUM_CPU_DEVICES={n} in the environment, or "
            f"jax.config.update('jax_num_cpu_devices', {n}) before JAX's first use"
        ) from None
    shape = tuple(sizes[a] for a in AXES)
    slices = _num_slices(devices)
    if devices[0].platform == "tpu" and slices > 1:
        if sizes[REPLICA] % slices:
            raise ValueError(
                f"on {slices} TPU slices the replica axis must be a multiple of the slice count, "
                f"got replica={sizes[REPLICA]}"
            )
        per_slice = sizes[REPLICA] // slices
        grid = mesh_utils.create_hybrid_device_mesh(
            (per_slice, sizes[DATA], sizes[MODEL]), (slices, 1, 1), devices
        )

    elif devices[0].platform in ("tpu", "gpu", "cuda", "rocm"):
        try:
            grid = mesh_utils.create_device_mesh(shape, devices)
        except NotImplementedError:  # e.g. an axis of 8 on a 4x4 slice: split a physical axis
            grid = mesh_utils.create_device_mesh(shape, devices, allow_split_physical_axes=True)
    else:
        grid = np.array(devices, dtype=object).reshape(shape)
    mesh = Mesh(grid, AXES, axis_types=(axis_type,) * len(AXES))
    warn_hybrid(mesh)
    return mesh


def compiler_sharded(mesh: Mesh) -> Mesh:
    """``mesh`` with its ``data`` and ``model`` axes ``Auto``: inside :func:`replica_map` the
    compiler partitions a user's model over them with no sharding annotations (an
    ``Explicit`` axis asks every op with a sharded contracting dimension for an
    ``out_sharding``). The replica axis keeps its type: it is mapped by hand."""
    types = tuple(
        t if name == REPLICA else AxisType.Auto
        for name, t in zip(mesh.axis_names, mesh.axis_types, strict=True)
    )
    if types == tuple(mesh.axis_types):
        return mesh
    return Mesh(mesh.devices, mesh.axis_names, axis_types=types)


def replica_map(fn, mesh: Mesh, *, check_vma: bool = True):
    """``fn`` run once per replica, mapped by hand over ``replica`` only.

    Every argument and result is a pytree of arrays with a leading replica axis (sharded over
    ``replica``); ``fn`` sees one replica's *whole logical tensors*, without that axis, and
    may use collectives over ``replica`` by name. How each tensor is split over ``data`` and
    ``model`` stays with the compiler (their shardings come with the arrays): a gradient of a
    batch split over ``data`` is averaged over it without a hand-written ``pmean``, and a
    whole-tensor computation (a norm, a top-k, a DCT) gives the same values at every layout.
    The mesh's ``data`` and ``model`` axes are used as ``Auto`` (:func:`compiler_sharded`).

    Args:
      fn: ``fn(*per_replica_args) -> per_replica_results``.
      mesh: a mesh with a ``replica`` axis.
      check_vma: ``shard_map``'s varying-axis type check (leave it on; a Pallas kernel under
        its interpreter needs it off).

    Example:
      >>> import jax, jax.numpy as jnp
      >>> mesh = make_mesh(replica=1, data=1, devices=jax.devices()[:1])
      >>> norm = replica_map(lambda x: jnp.linalg.norm(x) + jax.lax.pmean(x[0], "replica"), mesh)
      >>> norm(jnp.array([[3.0, 4.0]]))  # one replica: |x| + the replicas' mean of x[0]
      Array([8.], dtype=float32)
    """
    if REPLICA not in mesh.axis_names:
        raise ValueError(
            f"replica_map needs a mesh with a {REPLICA!r} axis, got mesh.axis_names="
            f"{mesh.axis_names!r}"
        )
    spec = jax.sharding.PartitionSpec(REPLICA)
    squeeze = lambda tree: jax.tree.map(lambda x: x[0], tree)
    stack = lambda tree: jax.tree.map(lambda x: x[None], tree)

    def per_replica(*args):
        return stack(fn(*squeeze(args)))

    return jax.shard_map(
        per_replica,
        mesh=compiler_sharded(mesh),
        in_specs=spec,
        out_specs=spec,
        axis_names={REPLICA},
        check_vma=check_vma,
    )
