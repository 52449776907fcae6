"""The outer-optimizer algorithms."""

from co2jax.algorithms.co2 import CO2MomentumState, co2, scale_by_co2_momentum
from co2jax.algorithms.data_parallel import NoSyncState, data_parallel, no_sync
from co2jax.algorithms.diloco import delayed_diloco, diloco, eager_diloco
from co2jax.algorithms.fused import FusableTransformation, outer_sgd
from co2jax.algorithms.local_sgd import local_sgd
from co2jax.algorithms.pseudo_gradient import PseudoGradientState, pseudo_gradient_method
from co2jax.algorithms.slowmo import SlowMomentumState, scale_by_slow_momentum, slowmo
from co2jax.algorithms.sparseloco import sparseloco

__all__ = [
    "CO2MomentumState",
    "FusableTransformation",
    "PseudoGradientState",
    "SlowMomentumState",
    "co2",
    "data_parallel",
    "delayed_diloco",
    "diloco",
    "eager_diloco",
    "local_sgd",
    "no_sync",
    "outer_sgd",
    "NoSyncState",
    "pseudo_gradient_method",
    "scale_by_co2_momentum",
    "scale_by_slow_momentum",
    "slowmo",
    "sparseloco",
]
