"""A ``flax.nnx`` module as the round engine trains it: parameters, the rest, a loss.

``nnx.split(module, nnx.Param, ...)`` cuts a module into its graph, its parameters (what the
inner and outer optimizers update and the replicas average) and the rest, its *model state*:
``nnx.BatchStat`` running statistics, the ``nnx.Rngs`` streams' keys and counts (dropout),
any ``nnx.Variable`` counters. :class:`NnxModel` hands the engine

    loss_fn(params, batch, model_state) -> (loss, (aux, model_state'))

which merges the module, calls the user's ``loss(module, batch)`` as written (a scalar, or
``(loss, aux)`` with ``has_aux``), and splits it again: a BatchNorm's updated statistics and
each stream's advanced count come back as ``model_state'``. The engine carries the model
state per replica (:attr:`co2jax.TrainState.model_state`) from step to step and round to
round and never averages it; at :meth:`co2jax.RoundTrainer.init` each replica's RNG keys get
the replica's index folded in (:func:`co2jax.engines.round.replica_keys`), and each draw
folds in the stream's count, so replica r's dropout mask at step k is its own.

Example:
  >>> import jax, jax.numpy as jnp, optax, co2jax
  >>> from flax import nnx
  >>> class Net(nnx.Module):
  ...     def __init__(self, rngs):
  ...         self.lin = nnx.Linear(3, 1, rngs=rngs)
  ...         self.drop = nnx.Dropout(0.5, rngs=rngs)
  ...     def __call__(self, x):
  ...         return self.lin(self.drop(x))
  >>> def loss(net, batch):
  ...     err = net(batch["x"])[:, 0] - batch["y"]
  ...     return jnp.mean(err**2), {"abs": jnp.mean(jnp.abs(err))}
  >>> model = co2jax.NnxModel(Net(nnx.Rngs(params=0, dropout=1)), loss, has_aux=True)
  >>> mesh = co2jax.make_mesh(replica=1, data=1, devices=jax.devices()[:1])
  >>> trainer = model.trainer(optax.sgd(0.1), co2jax.local_sgd(), mesh, sync_every=2)
  >>> state = model.init(trainer)
  >>> batch = {"x": jnp.ones((1, 2, 4, 3)), "y": jnp.ones((1, 2, 4))}  # [R, H, B, ...]
  >>> state, metrics = trainer.round(state, batch)
  >>> metrics.aux["abs"].shape, int(model.module(state).drop.rngs.count.get_value())
  ((1, 2), 2)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from co2jax.engines.round import RoundTrainer, TrainState, replica_keys


def _whole(x: Any) -> Any:
    """``x`` replicated on its mesh (a replica's slice of an explicitly sharded array can only
    be indexed out of a whole copy)."""
    sharding = getattr(x, "sharding", None)
    if not isinstance(sharding, jax.sharding.NamedSharding):
        return x
    return jax.sharding.reshard(x, jax.sharding.NamedSharding(sharding.mesh, P()))


def _nnx():
    from flax import nnx  # imported where used: flax is a dependency, nnx a large import

    return nnx


class NnxModel:
    """``module`` split for the engine, and ``loss(module, batch)`` as the engine calls it.

    Args:
      module: an ``nnx.Module`` (its initial parameters and state).
      loss: ``loss(module, batch) -> scalar`` (the mean over the batch's examples), or
        ``(scalar, aux)`` with ``has_aux`` (``aux``: means over the examples too, e.g. an
        accuracy). It may update the module's state (a BatchNorm in training mode) and draw
        from its RNG streams (dropout).
      has_aux: ``loss`` returns ``(loss, aux)``.

    Attributes:
      graphdef, params, model_state: ``nnx.split(module, nnx.Param, ...)``.
    """

    def __init__(self, module: Any, loss: Callable, *, has_aux: bool = False):
        nnx = _nnx()
        if not isinstance(module, nnx.Module):
            raise ValueError(f"module must be an nnx.Module, got module={module!r}")
        if not callable(loss):
            raise ValueError(f"loss must be callable, got loss={loss!r}")
        self.graphdef, self.params, self.model_state = nnx.split(module, nnx.Param, ...)
        self._loss, self.has_aux = loss, bool(has_aux)
        self.stateful = bool(jax.tree.leaves(self.model_state))

    def _merge(self, params: Any, model_state: Any) -> Any:
        # copies: the variables are new in the trace that calls the loss, so it may update
        # them (a BatchNorm's statistics, a stream's count)
        nnx = _nnx()
        rest = model_state if self.stateful else self.model_state
        return nnx.merge(self.graphdef, params, rest, copy=True)

    def loss_fn(self, params: Any, batch: Any, model_state: Any = ()):
        """The engine's form: ``(loss, (aux, model_state'))`` for a module with state, else
        ``(loss, aux)`` (``aux`` ``{}`` without ``has_aux``); use it with ``has_aux=True``."""
        nnx = _nnx()
        if self.stateful and not jax.tree.leaves(model_state):
            raise ValueError(
                "model_state=(): this module has state that is not parameters (batch "
                "statistics, RNG streams); build the trainer with NnxModel.trainer and start "
                "it with NnxModel.init, which carry it"
            )
        module = self._merge(params, model_state)
        out = self._loss(module, batch)
        loss, aux = out if self.has_aux else (out, {})
        if not self.stateful:
            return loss, aux
        return loss, (aux, nnx.split(module, nnx.Param, ...)[2])

    def trainer(self, inner, outer, mesh, sync_every: int, **options: Any) -> RoundTrainer:
        """A :class:`co2jax.RoundTrainer` of this model (``options`` as it takes them)."""
        return RoundTrainer(self.loss_fn, inner, outer, mesh, sync_every, has_aux=True, **options)

    def init(self, trainer: RoundTrainer) -> TrainState:
        """``trainer.init`` of this model's parameters and model state."""
        return trainer.init(self.params, self.model_state if self.stateful else ())

    def stacked(self, replicas: int) -> tuple[Any, Any]:
        """``(params, model_state)`` with a leading axis of ``replicas`` copies, replica r's
        RNG keys folded with r: what a loop of your own over
        ``jax.vmap(..., axis_name="replica")`` with :func:`co2jax.local_updates` starts from
        (equal to what :meth:`init` gives the round engine)."""
        stack = lambda t: jax.tree.map(lambda x: jnp.broadcast_to(x, (replicas, *x.shape)), t)
        state = replica_keys(stack(self.model_state)) if self.stateful else ()
        return stack(self.params), state

    def module(self, state: TrainState, replica: int = 0) -> Any:
        """Replica ``replica``'s module: its parameters and model state merged back."""
        take = lambda t: jax.tree.map(lambda x: _whole(x)[replica], t)
        model_state = take(state.model_state) if self.stateful else ()
        return self._merge(take(state.params), model_state)

    @staticmethod
    def averaged_statistics(state: TrainState) -> TrainState:
        """``state`` with every floating-point leaf of its model state (running statistics)
        replaced by its mean over the replicas (keys and integer counters kept): the
        engine never averages them on its own; do this where you want one set, e.g. before
        evaluating a BatchNorm model."""

        def mean(x):
            if not jnp.issubdtype(x.dtype, jnp.floating):
                return x
            return jnp.broadcast_to(jnp.mean(x, axis=0, keepdims=True), x.shape).astype(x.dtype)

        return state._replace(model_state=jax.tree.map(mean, state.model_state))
