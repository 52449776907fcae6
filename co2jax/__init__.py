"""co2jax: outer-optimizer algorithms (CO2, DiLoCo, Streaming DiLoCo, SparseLoCo, ...) in JAX.

Each algorithm is an :class:`OuterOptimizer`: pure ``init`` / ``send`` / ``apply`` functions,
a :class:`~co2jax.comm.Reducer` and a static schedule of transfers, communicating only by
axis name, so the same code runs under ``jax.vmap(..., axis_name="replica")`` and under
``jax.shard_map`` on a device mesh. Three drivers run any schedule: :class:`RoundTrainer`
(a round as one program on a mesh), :func:`local_updates` (an optax transform for ordinary
per-step loops) and :class:`JobTrainer` (replicas as separate jobs).

Layers, each importing only the ones before it: ``co2jax.kernels`` (Pallas) <-
``co2jax.comm`` (codecs, collectives, the reducer policy) <- ``co2jax.protocol`` and
``co2jax.algorithms`` (with the registry) <- ``co2jax.engines`` (the drivers).
"""

from co2jax import (
    algorithms,
    comm,
    distributed,
    engines,
    fragments,
    hlo,
    kernels,
    overlap,
    penalties,
    protocol,
)
from co2jax.algorithms import (
    CO2MomentumState,
    CoCoDCState,
    DCTDiLoCoState,
    DeMoState,
    ErrorFeedbackState,
    LowRankState,
    NoLoCoState,
    PseudoGradientState,
    SkipNonfiniteState,
    SlowMomentumState,
    StreamingState,
    co2,
    cocodc,
    data_parallel,
    dct_diloco,
    delayed_diloco,
    demo,
    diloco,
    diloco_x,
    eager_diloco,
    error_feedback,
    local_sgd,
    low_rank,
    no_sync,
    noloco,
    outer_sgd,
    outer_transform,
    pseudo_gradient_method,
    registry,
    scale_by_co2_momentum,
    skip_nonfinite,
    slowmo,
    snoo,
    sparseloco,
    streaming_diloco,
)
from co2jax.axes import DATA, MODEL, REPLICA
from co2jax.comm import Reducer
from co2jax.engines import (
    JobMetrics,
    JobState,
    JobTrainer,
    LocalUpdatesState,
    PeerError,
    Peers,
    RoundMetrics,
    RoundTrainer,
    TrainState,
    local_updates,
)
from co2jax.mesh import make_mesh
from co2jax.protocol import OuterOptimizer, Transfer
from co2jax.tree import consensus_distance

__version__ = "0.1.0"

__all__ = [
    "DATA",
    "MODEL",
    "REPLICA",
    "CO2MomentumState",
    "DCTDiLoCoState",
    "DeMoState",
    "CoCoDCState",
    "ErrorFeedbackState",
    "JobMetrics",
    "JobState",
    "JobTrainer",
    "LocalUpdatesState",
    "OuterOptimizer",
    "PeerError",
    "Peers",
    "PseudoGradientState",
    "Reducer",
    "RoundMetrics",
    "RoundTrainer",
    "SkipNonfiniteState",
    "SlowMomentumState",
    "StreamingState",
    "TrainState",
    "Transfer",
    "algorithms",
    "co2",
    "cocodc",
    "scale_by_co2_momentum",
    "comm",
    "data_parallel",
    "dct_diloco",
    "demo",
    "delayed_diloco",
    "diloco",
    "diloco_x",
    "LowRankState",
    "low_rank",
    "distributed",
    "eager_diloco",
    "engines",
    "error_feedback",
    "fragments",
    "hlo",
    "kernels",
    "local_sgd",
    "local_updates",
    "make_mesh",
    "no_sync",
    "noloco",
    "NoLoCoState",
    "consensus_distance",
    "outer_sgd",
    "outer_transform",
    "overlap",
    "penalties",
    "protocol",
    "pseudo_gradient_method",
    "registry",
    "skip_nonfinite",
    "slowmo",
    "snoo",
    "sparseloco",
    "streaming_diloco",
]
