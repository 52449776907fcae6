"""An inner step's loss and gradient on a replica's batch, data-parallel inside the replica.

Where the parameters are whole over ``data`` (every layout but FSDP), each ``data`` device
takes the gradient of ``loss_fn`` on its slice of the replica's batch and the slices'
gradients are averaged over ``data``: one reduction per inner step, in the gradients' own
dtype, after the backward pass. The ``model`` axis stays the compiler's (tensor
parallelism inside the step). Why by hand: left to the compiler, a data-parallel gradient of
a model that scans over its layers is reduced layer by layer inside the backward loop, and
XLA:TPU then kept 2.2x the temporary memory of this round (100M parameters, v5e 2x4,
``docs/architecture.md``).

Under FSDP the parameters are split over ``data``; the step gathers them (the caller,
:func:`co2jax.engines.execute.inner_step`, constrains them whole over ``data`` and the
gradient back into their layout) and ``loss_fn`` takes the replica's whole batch, held split
over ``data`` so that the activations stay split with it.

Either way ``loss_fn(params, batch)`` is a mean over the examples it is given, so the step's
loss and gradient are those of the replica's whole batch of the step.

A model with non-parameter state (batch statistics, RNG keys: ``model_state``) takes the
replica's whole batch too, so its statistics and random draws are those of the whole batch,
the same at every layout.
"""

from __future__ import annotations

from typing import Any

import jax
from jax.sharding import PartitionSpec as P

from co2jax.axes import DATA


def value_and_grad(
    loss_fn, params: Any, batch: Any, by_slices: bool, check_vma: bool = True, model_state=()
):
    """``((loss, (aux, model_state)), grads)`` of ``loss_fn(params, batch, model_state) ->
    (loss, (aux, model_state))`` at ``params`` on ``batch`` (the replica's ``[B, ...]``
    leaves, inside its replica-manual program): with ``by_slices`` and no ``model_state``,
    each ``data`` device's slice, the loss, gradients and ``aux`` (means over the examples,
    like the loss) averaged over ``data``; otherwise the whole batch."""
    mesh = jax.sharding.get_abstract_mesh()
    whole = not by_slices or bool(jax.tree.leaves(model_state))
    if mesh.empty or mesh.shape.get(DATA, 1) == 1:
        return jax.value_and_grad(loss_fn, has_aux=True)(params, batch, model_state)
    if whole:  # the examples stay split over data: the activations with them
        batch = jax.tree.map(lambda x: jax.lax.with_sharding_constraint(x, P(DATA)), batch)
        return jax.value_and_grad(loss_fn, has_aux=True)(params, batch, model_state)

    def per_slice(p, b):
        # the parameters enter data-invariant: marked varying, grad gives this slice's
        p = jax.lax.pcast(p, DATA, to="varying")
        (loss, (aux, _)), grads = jax.value_and_grad(loss_fn, has_aux=True)(p, b, ())
        mean = lambda t: jax.lax.pmean(t, DATA)
        return (mean(loss), (mean(aux), ())), mean(grads)

    return jax.shard_map(
        per_slice,
        mesh=mesh,
        in_specs=(P(), P(DATA)),
        out_specs=P(),
        axis_names={DATA},
        check_vma=check_vma,
    )(params, batch)
