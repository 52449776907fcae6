"""The outer-optimizer algorithms, the wrappers beside them and the registry."""

from co2jax.algorithms import registry
from co2jax.algorithms.co2 import CO2MomentumState, co2, scale_by_co2_momentum
from co2jax.algorithms.cocodc import CoCoDCState, cocodc
from co2jax.algorithms.data_parallel import NoSyncState, data_parallel, no_sync
from co2jax.algorithms.dct_diloco import DCTDiLoCoState, dct_diloco
from co2jax.algorithms.demo import DeMoState, demo
from co2jax.algorithms.desloc import DESLocState, desloc
from co2jax.algorithms.diloco import delayed_diloco, diloco, eager_diloco, snoo
from co2jax.algorithms.diloco_x import adapt, diloco_x, exchange_seconds
from co2jax.algorithms.error_feedback import ErrorFeedbackState, error_feedback
from co2jax.algorithms.fused import FusableTransformation, outer_sgd
from co2jax.algorithms.gpa import GPAState, gpa, gpa_eval_params
from co2jax.algorithms.guards import SkipNonfiniteState, skip_nonfinite
from co2jax.algorithms.hierarchical import HierarchicalState, hierarchical_diloco
from co2jax.algorithms.local_sgd import local_sgd
from co2jax.algorithms.low_rank import LowRankState, carry_over, low_rank
from co2jax.algorithms.muloco import muloco_inner, muon
from co2jax.algorithms.noloco import NoLoCoState, noloco
from co2jax.algorithms.outer_schedules import outer_transform
from co2jax.algorithms.pseudo_gradient import PseudoGradientState, pseudo_gradient_method
from co2jax.algorithms.slowmo import SlowMomentumState, scale_by_slow_momentum, slowmo
from co2jax.algorithms.sparseloco import sparseloco
from co2jax.algorithms.sparta import SpartaState, sparta
from co2jax.algorithms.streaming_diloco import StreamingState, streaming_diloco

__all__ = [
    "CO2MomentumState",
    "DCTDiLoCoState",
    "DeMoState",
    "CoCoDCState",
    "ErrorFeedbackState",
    "FusableTransformation",
    "NoSyncState",
    "PseudoGradientState",
    "SkipNonfiniteState",
    "SlowMomentumState",
    "StreamingState",
    "co2",
    "cocodc",
    "data_parallel",
    "dct_diloco",
    "demo",
    "desloc",
    "DESLocState",
    "delayed_diloco",
    "diloco",
    "diloco_x",
    "adapt",
    "exchange_seconds",
    "LowRankState",
    "carry_over",
    "low_rank",
    "eager_diloco",
    "error_feedback",
    "local_sgd",
    "muloco_inner",
    "muon",
    "no_sync",
    "noloco",
    "hierarchical_diloco",
    "HierarchicalState",
    "NoLoCoState",
    "outer_sgd",
    "outer_transform",
    "pseudo_gradient_method",
    "registry",
    "scale_by_co2_momentum",
    "scale_by_slow_momentum",
    "skip_nonfinite",
    "slowmo",
    "snoo",
    "gpa",
    "gpa_eval_params",
    "GPAState",
    "sparseloco",
    "sparta",
    "SpartaState",
    "streaming_diloco",
]
