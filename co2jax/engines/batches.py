"""The round engine's check of a round's batch against the mesh, H and the loss.

A batch is a pytree of ``[replica, H, B, ...]`` leaves, B a multiple of the ``data`` axis
size; the loss must return a scalar on what each data device hands it (a slice of B/D
examples; under FSDP the replica's whole batch of the step). The shape checks run on every
round; the loss is traced once per parameter and batch shapes (a trace costs more than a
small model's round).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp


def shapes_key(tree: Any) -> tuple:
    """``tree``'s structure with each leaf's shape and dtype: what a traced program of it
    depends on (the engine keys its compiled inits and rounds and its batch checks on it)."""
    leaves, structure = jax.tree.flatten(tree)
    return structure, tuple((jnp.shape(x), jnp.result_type(x)) for x in leaves)


def check_batch(
    params: Any,
    batch: Any,
    replicas: int,
    H: int,
    data: int,
    loss_fn,
    checked,
    slices: int = 1,
    model_state: Any = (),
):
    """Raises ``ValueError`` naming the leaf and its shape where ``batch`` does not fit;
    ``params`` are the replica-stacked parameters, ``checked`` a set of shapes already
    traced (a refused batch is not added); ``loss_fn`` is traced on 1/``slices`` of a
    step's batch (what each ``data`` device hands it), as ``loss_fn(params, batch,
    *model_state)`` when a ``model_state`` (replica-stacked) is given."""
    leaves = jax.tree_util.tree_leaves_with_path(batch)
    if not leaves:
        raise ValueError("batch must have at least one array leaf")
    for path, leaf in leaves:
        shape = tuple(jnp.shape(leaf))
        name = jax.tree_util.keystr(path) or "batch"
        if len(shape) < 3:
            raise ValueError(
                f"batch leaf {name} must be [replica, H, batch, ...], got shape {shape}"
            )
        if shape[0] != replicas or shape[1] != H:
            raise ValueError(
                f"batch leaf {name} has shape {shape}: its leading dims must be "
                f"(replica={replicas}, H={H}, ...)"
            )
        if shape[2] % data:
            raise ValueError(
                f"batch leaf {name} has shape {shape}: its batch dim {shape[2]} must be a "
                f"multiple of the data axis size {data}"
            )
    key = shapes_key(params), shapes_key(batch), shapes_key(model_state)
    if key in checked:
        return
    one_params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), params)
    one = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct((x.shape[2] // slices, *x.shape[3:]), x.dtype), batch
    )
    extra = [jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), model_state)]
    out = jax.eval_shape(loss_fn, one_params, one, *(extra if model_state != () else []))
    if not (hasattr(out, "shape") and out.shape == ()):
        raise ValueError(
            f"loss_fn must return a scalar, got {getattr(out, 'shape', type(out).__name__)}"
        )
    checked.add(key)
