"""The inner optimizer of a run: its learning-rate schedule, AdamW or GPA-AdamW, and the
parameters a run is evaluated at (GPA's average x)."""

from __future__ import annotations

from typing import Any

import jax
import optax

import co2jax
from experiments.config import InnerConfig


def schedule(i: InnerConfig, total_steps: int) -> optax.Schedule:
    """The inner learning rate by step: a linear warm-up from 0 over ``warmup_steps``, then
    a cosine decay to 0.1x by ``total_steps`` (``"cosine"``) or constant."""
    if i.schedule == "cosine":
        return optax.warmup_cosine_decay_schedule(
            0.0,
            i.learning_rate,
            min(i.warmup_steps, total_steps - 1),
            max(total_steps, 2),
            0.1 * i.learning_rate,
        )
    return optax.linear_schedule(0.0, i.learning_rate, max(i.warmup_steps, 1))


def optimizer(i: InnerConfig, learning_rate: optax.Schedule) -> optax.GradientTransformation:
    """AdamW, or GPA-AdamW (:func:`co2jax.gpa`, weight decay on z: the release's later
    default) with the same learning rate, betas and weight decay."""
    if i.optimizer == "gpa":
        return co2jax.gpa(
            learning_rate,
            mu_y=i.gpa_mu_y,
            mu_x=i.gpa_mu_x,
            b1=i.b1,
            b2=i.b2,
            weight_decay=i.weight_decay,
        )
    return optax.adamw(learning_rate, b1=i.b1, b2=i.b2, weight_decay=i.weight_decay)


def evaluated_params(i: InnerConfig, state) -> Any:
    """The parameters a run is evaluated at: the replicas' own, or GPA's average x
    (:func:`co2jax.gpa_eval_params`, from its z in the inner state).

    Example:
      >>> from experiments.config import InnerConfig
      >>> from co2jax import TrainState
      >>> state = TrainState({"w": 1.0}, (), (), 0, ())
      >>> evaluated_params(InnerConfig(), state)  # AdamW: the parameters themselves
      {'w': 1.0}
    """
    if i.optimizer != "gpa":
        return state.params
    is_gpa = lambda n: isinstance(n, co2jax.GPAState)
    (gpa_state,) = [n for n in jax.tree.leaves(state.inner_state, is_leaf=is_gpa) if is_gpa(n)]
    at_x = lambda p, s: co2jax.gpa_eval_params(p, s, i.gpa_mu_y)
    return jax.jit(jax.vmap(at_x))(state.params, gpa_state)
