"""The algorithm registry: name -> builder from a typed config, and what each algorithm can do.

Adding an algorithm is its file, its textbook loop (``tests/textbook.py``), its docs page
(``docs/algorithms/<name>.md``) and one line in :data:`REGISTRY`; the experiment configs, the
comparison report and the shared test lists read it from here.

Example:
  >>> cfg = OuterConfig(algorithm="co2", learning_rate=1.0, momentum=0.5)
  >>> outer = build(validate(cfg), Context(sync_every=8))
  >>> REGISTRY["co2"].capabilities.delayed, outer.overlapped
  (True, True)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

import optax

from co2jax import penalties
from co2jax.algorithms.co2 import MODES, co2
from co2jax.algorithms.cocodc import CORRECTIONS, cocodc
from co2jax.algorithms.data_parallel import data_parallel, no_sync
from co2jax.algorithms.dct_diloco import dct_diloco
from co2jax.algorithms.demo import demo
from co2jax.algorithms.diloco import delayed_diloco, diloco, eager_diloco
from co2jax.algorithms.diloco_x import diloco_x
from co2jax.algorithms.error_feedback import error_feedback
from co2jax.algorithms.guards import skip_nonfinite
from co2jax.algorithms.local_sgd import local_sgd
from co2jax.algorithms.noloco import noloco
from co2jax.algorithms.outer_schedules import (
    LR_SCHEDULES,
    OPTIMIZERS,
    learning_rate_schedule,
    momentum_schedule,
    outer_transform,
)
from co2jax.algorithms.slowmo import slowmo
from co2jax.algorithms.sparseloco import MODES as SPARSE_MODES
from co2jax.algorithms.sparseloco import sparseloco
from co2jax.algorithms.streaming_diloco import streaming_diloco
from co2jax.comm import FORMATS, all_gather_compressed, all_reduce_compressed, make
from co2jax.comm.dct import all_gather_dct_topk
from co2jax.comm.lowrank import FACTORS
from co2jax.comm.reducer import ring_bytes
from co2jax.comm.sparse_quant import AVERAGES
from co2jax.fragments import Fragments, make_fragments
from co2jax.kernels.api import IMPLEMENTATIONS
from co2jax.protocol import OuterOptimizer
from co2jax.tree import tree_bytes

COMPRESSIONS = tuple(f for f in FORMATS if f != "topk")  # topk needs k and a chunk: SparseLoCo
COLLECTIVES = ("all_gather", "two_step")  # how compressed payloads are reduced
PENALTIES = ("none", "constant", "gap_aware")


@dataclasses.dataclass(frozen=True)
class OuterConfig:
    """Every algorithm's hyper-parameters, by name (an algorithm reads the ones it has)."""

    algorithm: str = "diloco"
    learning_rate: float = 0.7
    momentum: float = 0.9
    nesterov: bool = True
    optimizer: str = "sgd"  # the outer optax transform (outer_transform algorithms): sgd | adam
    lr_schedule: str = "constant"  # by outer step: constant | cosine | linear
    lr_warmup: int = 0  # outer steps of linear learning-rate warm-up from 0
    lr_final: float = 0.0  # decayed learning rate at the last round, a fraction of the peak
    momentum_warmup: int = 0  # outer steps of linear momentum ramp from 0
    beta2: float = 0.99  # outer Adam's second-moment decay
    # the outer lr and momentum as optimizer state, not constants of the compiled round:
    # runs that differ only in them share one program (a sweep compiles once); not fused
    lr_in_state: bool = False
    delay: int = 1
    clip_threshold: float | None = None
    penalty: str = "none"
    penalty_lambda: float = 1.0
    gap_decay: float = 0.9
    mode: str = "paper"
    skip_nonfinite: bool = True
    implementation: str = "auto"  # the fused outer update's: auto | pallas | interpret | xla
    compression: str = "none"  # pseudo-gradients on the wire (compressible algorithms)
    error_feedback: bool = False  # keep the compression residual per replica
    collective: str = "all_gather"  # compressed: all_gather (exact mean) | two_step (RS + AG)
    fragments: int = 2  # streaming_diloco: P
    tau: int = 1  # streaming_diloco: inner steps between sending and applying a fragment
    alpha: float = 0.5  # streaming_diloco: merge weight of the local values
    decay: float = 0.95  # sparseloco: error-feedback decay
    topk: int = 32  # sparseloco, dct_diloco, demo: values kept per chunk (production: 64)
    chunk: int = 4096  # sparseloco: chunk size (production: of a 1-D tensor)
    quantizer: str = "ternary"  # sparseloco: ternary | production (4 bins, 64x64 tiles)
    average: str = "contributors"  # sparseloco production: contributors | replicas (1/R)
    group_size: int = 2  # noloco: replicas per gossip group
    dct_chunk: int = 64  # dct_diloco, demo: DCT chunk side (each axis: its largest divisor <=)
    rank: int = 32  # diloco_x: rank of each matrix's pseudo-gradient on the wire
    factors: str = "int4"  # diloco_x: the factors' format: float32 | bf16 | int4
    correction: str = "zeroth"  # cocodc: none | zeroth | first (delay compensation)
    hessian_scale: float = 0.5  # cocodc: lambda of the first-order correction


class Context(NamedTuple):
    """What a builder may need beyond the config.

    Attributes:
      sync_every: H.
      params: the parameters or their shapes (Streaming DiLoCo's fragments).
      inner_learning_rate: the inner schedule (a function of the inner step; SlowMo).
      num_replicas: R, for a driver with no replica axis (separate jobs; eager updates).
      fragmenter: ``fragmenter(params, count) -> Fragments`` (default: every leaf a layer).
      rounds: the run's outer steps, for a decaying outer learning rate.
    """

    sync_every: int
    params: Any = None
    inner_learning_rate: Callable[[Any], Any] | None = None
    num_replicas: int | None = None
    fragmenter: Callable[[Any, int], Fragments] | None = None
    rounds: int | None = None


class Capabilities(NamedTuple):
    """What an algorithm does, in its default mode.

    Attributes:
      delayed: sends its payload before the round's inner steps (they hide its reduction).
      fusable: its outer step can run as the fused Pallas kernel (``implementation``).
      compressible: takes ``compression`` (its payload is a pseudo-gradient to encode).
      fragments: syncs parameter fragments (needs ``Context.params``).
      every_step: communicates every inner step (DDP's gradients), not per round.
      guardable: ``skip_nonfinite`` can wrap it (one transfer, replica-invariant anchor).
      outer_transform: its outer step is an optax transform of the averaged pseudo-gradient,
        so ``optimizer`` and the outer schedules apply.
      gossip: exchanges with a group of replicas only, never all of them (no gather form:
        it runs in the SPMD drivers, not as separate jobs).
    """

    delayed: bool = False
    fusable: bool = False
    compressible: bool = False
    fragments: bool = False
    every_step: bool = False
    guardable: bool = True
    outer_transform: bool = False
    gossip: bool = False


class Entry(NamedTuple):
    """``build(config, context, reduce) -> OuterOptimizer`` (``reduce``: the compressed
    reducer, or None), its capabilities, a one-line summary and, for an algorithm that
    communicates every step (DDP, DeMo), ``inner(transform, config, learning_rate)``: the
    inner transform it runs in place of ``transform`` and ``step_bytes(config, params,
    replicas)``, the bytes one replica sends per inner step."""

    build: Callable[[OuterConfig, Context, Any], OuterOptimizer]
    capabilities: Capabilities
    summary: str
    inner: Callable[[optax.GradientTransformation, OuterConfig, Any], Any] | None = None
    step_bytes: Callable[[OuterConfig, Any, int], float] | None = None


def _sgd(o: OuterConfig, c: Context):
    """The outer transform ``o`` names (optax.sgd by default, runnable by the fused outer
    update while nothing is scheduled), its hyper-parameters by outer step."""
    lr = learning_rate_schedule(
        o.learning_rate, o.lr_schedule, warmup=o.lr_warmup, rounds=c.rounds, final=o.lr_final
    )
    momentum = momentum_schedule(o.momentum, o.momentum_warmup)
    return outer_transform(
        o.optimizer, lr, momentum, nesterov=o.nesterov, b2=o.beta2, in_state=o.lr_in_state
    )


def _slowmo(o: OuterConfig, c: Context, reduce) -> OuterOptimizer:
    if c.inner_learning_rate is None:
        raise ValueError("slowmo needs Context.inner_learning_rate (the inner schedule)")
    lr = c.inner_learning_rate
    gamma = (lambda t: lr(t * c.sync_every)) if callable(lr) else lr
    return slowmo(gamma, o.learning_rate, o.momentum, reduce=reduce)


def _co2(o: OuterConfig, c: Context, reduce) -> OuterOptimizer:
    penalty = {
        "none": None,
        "constant": penalties.constant(o.penalty_lambda),
        "gap_aware": penalties.gap_aware(o.gap_decay),
    }[o.penalty]
    clip = o.clip_threshold if o.mode == "paper" else None
    return co2(
        o.learning_rate, o.momentum, clip, penalty, o.mode, reduce=reduce,
        implementation=o.implementation,
    )  # fmt: skip


def _fragments(o: OuterConfig, c: Context) -> Fragments:
    if c.params is None:
        raise ValueError(f"{o.algorithm} needs Context.params to cut into fragments")
    fragmenter = c.fragmenter or (lambda params, count: make_fragments(params, count))
    return fragmenter(c.params, o.fragments)


def _streaming(o: OuterConfig, c: Context, reduce) -> OuterOptimizer:
    frags = _fragments(o, c)
    return streaming_diloco(_sgd(o, c), frags, c.sync_every, o.tau, o.alpha, reduce=reduce)


def _cocodc(o: OuterConfig, c: Context, reduce) -> OuterOptimizer:
    frags = _fragments(o, c)
    return cocodc(
        _sgd(o, c), frags, c.sync_every, o.tau, o.alpha, o.correction, o.hessian_scale,
        reduce=reduce,
    )  # fmt: skip


def _demo(transform, o: OuterConfig, learning_rate):
    del transform  # DeMo is the whole inner optimizer: sign steps at the inner learning rate
    if learning_rate is None:
        raise ValueError("demo needs the inner learning rate (registry.inner(..., learning_rate))")
    return demo(learning_rate, o.momentum, o.topk, o.dct_chunk)


_impl = lambda o: {"implementation": o.implementation}
REGISTRY: dict[str, Entry] = {
    "ddp": Entry(
        lambda o, c, r: no_sync(), Capabilities(every_step=True, guardable=False),
        "data-parallel baseline: gradients all-reduced every step",
        inner=lambda transform, o, lr: data_parallel(transform),
        step_bytes=lambda o, params, r: ring_bytes(tree_bytes(params), r),
    ),
    "local_sgd": Entry(
        lambda o, c, r: local_sgd(reduce=r), Capabilities(), "periodic model averaging"
    ),
    "slowmo": Entry(_slowmo, Capabilities(), "slow momentum on periodic averaging"),
    "diloco": Entry(
        lambda o, c, r: diloco(_sgd(o, c), reduce=r, **_impl(o)),
        Capabilities(fusable=True, compressible=True, outer_transform=True),
        "outer Nesterov on pseudo-gradients",
    ),
    "delayed_diloco": Entry(
        lambda o, c, r: delayed_diloco(_sgd(o, c), o.delay, reduce=r, **_impl(o)),
        Capabilities(delayed=True, fusable=True, compressible=True, outer_transform=True),
        "naive one-round delay",
    ),
    "eager_diloco": Entry(
        lambda o, c, r: eager_diloco(
            _sgd(o, c), o.delay, num_replicas=c.num_replicas, reduce=r, **_impl(o)
        ),
        Capabilities(delayed=True, fusable=True, guardable=False, outer_transform=True),
        "eager updates",
    ),
    "co2": Entry(_co2, Capabilities(delayed=True, fusable=True), "CO2: stale outer momentum"),
    "streaming_diloco": Entry(
        _streaming,
        Capabilities(compressible=True, fragments=True, guardable=False, outer_transform=True),
        "DiLoCo one fragment at a time, overlapped by tau steps",
    ),
    "sparseloco": Entry(
        lambda o, c, r: sparseloco(
            o.learning_rate, o.decay, o.topk, o.chunk, mode=o.quantizer, average=o.average
        ),
        Capabilities(),
        "top-k error feedback, 2-bit values, sparse all-gather",
    ),
    "dct_diloco": Entry(
        lambda o, c, r: dct_diloco(o.learning_rate, o.decay, o.topk, o.dct_chunk),
        Capabilities(guardable=False),
        "replica-local DiLoCo sharing only the top-k DCT coefficients of its momentum",
    ),
    "demo": Entry(
        lambda o, c, r: no_sync(), Capabilities(every_step=True, guardable=False),
        "DeMo: sign steps on shared top-k DCT coefficients of a local momentum, every step",
        inner=_demo,
        step_bytes=lambda o, params, r: all_gather_dct_topk(o.topk, o.dct_chunk).wire_bytes(
            params, r
        ),
    ),
    "cocodc": Entry(
        _cocodc,
        Capabilities(compressible=True, fragments=True, guardable=False, outer_transform=True),
        "Streaming DiLoCo with delay compensation at apply (a reconstruction)",
    ),
    "diloco_x": Entry(
        lambda o, c, r: diloco_x(
            _sgd(o, c), o.rank, o.factors, o.delay, skip_nonfinite=o.skip_nonfinite,
            implementation=o.implementation,
        ),
        Capabilities(delayed=True, guardable=False, outer_transform=True),
        "one-round-delayed DiLoCo on rank-r int4 pseudo-gradients (a reconstruction)",
    ),
    "noloco": Entry(
        lambda o, c, r: noloco(o.learning_rate, o.momentum, o.group_size, sync_every=c.sync_every),
        Capabilities(guardable=False, gossip=True),
        "gossip outer steps in random groups of n: no all-reduce",
    ),
}  # fmt: skip
NAMES = tuple(REGISTRY)


def _fail(name: str, value: Any, why: str) -> None:
    raise ValueError(f"outer.{name}={value!r}: {why}")


def validate(o: OuterConfig, sync_every: int | None = None) -> OuterConfig:
    """Checks every field that can be checked before building; returns ``o``."""
    if o.algorithm not in REGISTRY:
        _fail("algorithm", o.algorithm, f"must be one of {NAMES}")
    caps = REGISTRY[o.algorithm].capabilities
    if o.implementation not in IMPLEMENTATIONS:
        _fail("implementation", o.implementation, f"must be one of {IMPLEMENTATIONS}")
    if o.compression not in COMPRESSIONS:
        _fail("compression", o.compression, f"must be one of {COMPRESSIONS}")
    if o.compression != "none" and not caps.compressible:
        compressible = tuple(n for n, e in REGISTRY.items() if e.capabilities.compressible)
        _fail("compression", o.compression, f"applies to {compressible}")
    if o.error_feedback and o.compression == "none":
        _fail("error_feedback", o.error_feedback, "needs outer.compression")
    if o.collective not in COLLECTIVES:
        _fail("collective", o.collective, f"must be one of {COLLECTIVES}")
    if o.optimizer not in OPTIMIZERS:
        _fail("optimizer", o.optimizer, f"must be one of {OPTIMIZERS}")
    if o.lr_schedule not in LR_SCHEDULES:
        _fail("lr_schedule", o.lr_schedule, f"must be one of {LR_SCHEDULES}")
    if o.lr_warmup < 0 or o.momentum_warmup < 0:
        name = "lr_warmup" if o.lr_warmup < 0 else "momentum_warmup"
        _fail(name, getattr(o, name), "must be >= 0 (outer steps)")
    if not 0 <= o.lr_final <= 1:
        _fail("lr_final", o.lr_final, "must be in [0, 1] (a fraction of learning_rate)")
    if not 0 <= o.beta2 < 1:
        _fail("beta2", o.beta2, "must be in [0, 1)")
    if o.lr_in_state and o.implementation in ("pallas", "interpret"):
        why = "outer hyper-parameters held in the state are not fused: implementation auto or xla"
        _fail("lr_in_state", o.lr_in_state, f"{why} (implementation={o.implementation!r})")
    default = OuterConfig()
    if not caps.outer_transform:
        names = ("optimizer", "lr_schedule", "lr_warmup", "lr_final", "momentum_warmup")
        for name in (*names, "lr_in_state"):
            if getattr(o, name) != getattr(default, name):
                takes = tuple(n for n, e in REGISTRY.items() if e.capabilities.outer_transform)
                _fail(name, getattr(o, name), f"applies to {takes}")
    if o.quantizer not in SPARSE_MODES:
        _fail("quantizer", o.quantizer, f"must be one of {SPARSE_MODES}")
    if o.average not in AVERAGES:
        _fail("average", o.average, f"must be one of {AVERAGES}")
    if o.rank < 1:
        _fail("rank", o.rank, "must be >= 1")
    if o.factors not in FACTORS:
        _fail("factors", o.factors, f"must be one of {FACTORS}")
    if o.dct_chunk < 1:
        _fail("dct_chunk", o.dct_chunk, "must be >= 1")
    if o.correction not in CORRECTIONS:
        _fail("correction", o.correction, f"must be one of {CORRECTIONS}")
    if o.hessian_scale < 0:
        _fail("hessian_scale", o.hessian_scale, "must be >= 0")
    if o.group_size < 1:
        _fail("group_size", o.group_size, "must be >= 1")
    if o.fragments < 1:
        _fail("fragments", o.fragments, "must be >= 1")
    if caps.fragments and sync_every is not None and not 0 <= o.tau < sync_every // o.fragments:
        _fail(
            "tau",
            o.tau,
            f"must be in [0, sync_every // fragments) = [0, {sync_every // o.fragments})",
        )
    if not 0 <= o.alpha <= 1:
        _fail("alpha", o.alpha, "must be in [0, 1]")
    if o.penalty not in PENALTIES:
        _fail("penalty", o.penalty, f"must be one of {PENALTIES}")
    if o.mode not in MODES:
        _fail("mode", o.mode, f"must be one of {MODES}")
    if not o.learning_rate > 0:
        _fail("learning_rate", o.learning_rate, "must be > 0")
    if not 0 <= o.momentum < 1:
        _fail("momentum", o.momentum, "must be in [0, 1)")
    if o.delay < 1 and o.algorithm in ("delayed_diloco", "eager_diloco", "diloco_x"):
        _fail("delay", o.delay, "must be >= 1 for delayed and eager DiLoCo")
    if o.clip_threshold is not None and o.clip_threshold <= 0:
        _fail("clip_threshold", o.clip_threshold, "must be > 0 or None")
    if not 0 <= o.decay <= 1:
        _fail("decay", o.decay, "must be in [0, 1]")
    return o


def build(o: OuterConfig, context: Context) -> OuterOptimizer:
    """The outer optimizer ``o`` names, with its compression, error feedback and guard.

    The guard (``skip_nonfinite``) goes inside error feedback: a skipped step keeps the
    residual, which holds what the compressed payload left out.
    """
    validate(o, context.sync_every)
    entry = REGISTRY[o.algorithm]
    reduce = codec = None
    if o.compression != "none":
        kernels = (
            {"implementation": o.implementation} if o.compression in ("int8", "fp4", "2bit") else {}
        )
        codec = make(o.compression, **kernels)
        collective = {"all_gather": all_gather_compressed, "two_step": all_reduce_compressed}
        reduce = collective[o.collective](codec)
    outer = entry.build(o, context, reduce)
    if o.skip_nonfinite and entry.capabilities.guardable:
        outer = skip_nonfinite(outer)
    if codec is not None and o.error_feedback:
        outer = error_feedback(outer)
    return outer


def inner(o: OuterConfig, transform: optax.GradientTransformation, learning_rate=None):
    """The inner transform as ``o``'s algorithm runs it: ``transform`` itself, averaged
    gradients first (DDP), or DeMo in its place (at ``learning_rate``, a number or a schedule
    of the inner step)."""
    wrap = REGISTRY[o.algorithm].inner
    return transform if wrap is None else wrap(transform, o, learning_rate)
