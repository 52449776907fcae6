"""The drivers that run an outer optimizer's schedule: the round engine (one program per
round on a mesh), the per-step adapter (any optax loop) and the multi-job trainer (replicas
as separate jobs); and a flax.nnx module as the round engine trains it."""

from co2jax.engines.adapter import LocalUpdatesState, local_updates
from co2jax.engines.drift import DriftError, check_drift, replica_fingerprints
from co2jax.engines.exchange import Exchange, PeerError, Peers
from co2jax.engines.multijob import JobMetrics, JobState, JobTrainer
from co2jax.engines.nnx_model import NnxModel
from co2jax.engines.round import RoundMetrics, RoundTrainer, TrainState

__all__ = [
    "DriftError",
    "check_drift",
    "replica_fingerprints",
    "Exchange",
    "JobMetrics",
    "JobState",
    "JobTrainer",
    "LocalUpdatesState",
    "NnxModel",
    "PeerError",
    "Peers",
    "RoundMetrics",
    "RoundTrainer",
    "TrainState",
    "local_updates",
]
