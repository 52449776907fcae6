"""co2jax: outer-optimizer algorithms (CO2, DiLoCo, eager/delayed DiLoCo, SlowMo, Local SGD).

Each algorithm is an :class:`OuterOptimizer`: pure ``init``/``sync`` functions that
communicate only by axis name, so the same code runs under ``jax.vmap(...,
axis_name="replica")`` and under ``jax.shard_map`` on a device mesh. :func:`local_updates`
turns one into an optax transform for ordinary per-step training loops.
"""

from co2jax import (
    compression,
    distributed,
    fragments,
    hlo,
    kernels,
    multijob,
    overlap,
    penalties,
    reducers,
)
from co2jax._base import REPLICA_AXIS, OuterOptimizer, Reducer, replica_mean
from co2jax.adapter import LocalUpdatesState, local_updates
from co2jax.algorithms import (
    CO2MomentumState,
    PseudoGradientState,
    SlowMomentumState,
    co2,
    data_parallel,
    delayed_diloco,
    diloco,
    eager_diloco,
    local_sgd,
    no_sync,
    outer_sgd,
    pseudo_gradient_method,
    slowmo,
    sparseloco,
)
from co2jax.engine import RoundMetrics, RoundTrainer, TrainState
from co2jax.guards import SkipNonfiniteState, skip_nonfinite
from co2jax.mesh import DATA, MODEL, REPLICA, make_mesh
from co2jax.streaming import StreamingOuter, StreamingState, streaming_diloco

__version__ = "0.1.0"

__all__ = [
    "DATA",
    "MODEL",
    "REPLICA",
    "REPLICA_AXIS",
    "CO2MomentumState",
    "LocalUpdatesState",
    "OuterOptimizer",
    "PseudoGradientState",
    "Reducer",
    "RoundMetrics",
    "RoundTrainer",
    "SkipNonfiniteState",
    "SlowMomentumState",
    "StreamingOuter",
    "StreamingState",
    "TrainState",
    "co2",
    "compression",
    "data_parallel",
    "delayed_diloco",
    "distributed",
    "diloco",
    "eager_diloco",
    "fragments",
    "hlo",
    "kernels",
    "multijob",
    "local_sgd",
    "local_updates",
    "make_mesh",
    "no_sync",
    "outer_sgd",
    "overlap",
    "penalties",
    "pseudo_gradient_method",
    "reducers",
    "replica_mean",
    "skip_nonfinite",
    "slowmo",
    "sparseloco",
    "streaming_diloco",
]
