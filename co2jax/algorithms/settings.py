"""The algorithm object: each algorithm is one frozen class, made of shared pieces, registered once.

An algorithm is a frozen dataclass (a :class:`Settings`) made of the shared pieces it takes
(:class:`OuterStep`: the outer optax transform and its schedules; :class:`Compression`;
:class:`Fused`; :class:`Guard`; :class:`Delay`; :class:`Fragmented`; :class:`DCTTopK`) and
its own fields, each with a type, a default and a one-line description (:func:`setting`).
Its ``check`` method holds its own rules; ``build`` makes its
:class:`~co2jax.OuterOptimizer` from its library factory (the math), ``inner`` its inner
transform, ``step_bytes`` what that inner transform sends, ``metrics`` what a run records
of its state. One decorator registers it (:func:`co2jax.algorithms.registry.register`): the
experiments' ``outer`` section is that dataclass, so a setting the algorithm does not declare
cannot be set.

:meth:`Settings.validate` runs every piece's ``check`` (base pieces first, in the class's
method resolution order) and the choices of every field, once, where a run's config is
loaded; :meth:`Settings.outer` adds the compressed reducer, the guard and error feedback and
does not validate again (the library factories keep their argument checks).

Example:
  >>> from co2jax.algorithms import registry
  >>> s = registry.settings("co2", learning_rate=1.0, clip_threshold=0.5)
  >>> s.validate(Bounds(sync_every=8)).clip_threshold
  0.5
  >>> registry.settings("co2", delay=2)
  Traceback (most recent call last):
  ...
  ValueError: outer.delay=2: co2 has no such setting (a setting of ...)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, ClassVar, NamedTuple

import numpy as np
import optax

from co2jax.algorithms.error_feedback import error_feedback
from co2jax.algorithms.guards import SkipNonfiniteState, skip_nonfinite
from co2jax.algorithms.outer_schedules import (
    LR_SCHEDULES,
    OPTIMIZERS,
    learning_rate_schedule,
    momentum_schedule,
    outer_transform,
)
from co2jax.comm import FORMATS, all_gather_compressed, all_reduce_compressed, make
from co2jax.fragments import Fragments, make_fragments
from co2jax.kernels.api import IMPLEMENTATIONS
from co2jax.protocol import OuterOptimizer, find_state

COMPRESSIONS = tuple(f for f in FORMATS if f != "topk")  # topk needs k and a chunk: SparseLoCo
COLLECTIVES = ("all_gather", "two_step")  # how compressed payloads are reduced


def setting(default: Any, help: str, choices: tuple | None = None) -> Any:
    """A settings field: its default, its one-line description (``--help`` shows it) and,
    for a string, the values it takes (checked by :meth:`Settings.validate`)."""
    return dataclasses.field(default=default, metadata={"help": help, "choices": choices})


def fail(name: str, value: Any, why: str) -> None:
    """Raises the one-line ``ValueError`` every check raises: ``outer.<name>=<value>: why``."""
    raise ValueError(f"outer.{name}={value!r}: {why}")


class Bounds(NamedTuple):
    """What the rest of a run fixes, for the checks that depend on it (``None``: unknown,
    not checked): H, the run's rounds, the replicas, the model's layers."""

    sync_every: int | None = None
    rounds: int | None = None
    replicas: int | None = None
    layers: int | None = None


class Context(NamedTuple):
    """What a builder may need beyond the settings.

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


@dataclasses.dataclass(frozen=True)
class Settings:
    """The base of every algorithm: its settings as typed fields (the registered name in
    ``algorithm``), its rules (``check``), what it builds for each side (:meth:`outer`,
    :meth:`inner`), its bytes and what a run records of it (:meth:`recorded`)."""

    summary: ClassVar[str] = ""  # one line, set by registry.register

    algorithm: str = setting("", "the algorithm these settings are for")

    def check(self, bounds: Bounds) -> None:
        """This class's own rules (each piece and each algorithm defines its own)."""

    def validate(self, bounds: Bounds | None = None) -> Settings:
        """Every field's choices, then every piece's ``check`` (base pieces first); returns
        ``self``. Raises a one-line ``ValueError`` naming ``outer.<field>``."""
        bounds = Bounds() if bounds is None else bounds
        own = type(self).__dict__.get("registered_as")  # stamped by registry.register
        if own != self.algorithm:
            why = "registered" if own is None else f"{own!r}"
            fail("algorithm", self.algorithm, f"must be {why} for {type(self).__name__}")
        for f in dataclasses.fields(self):
            choices = f.metadata.get("choices")
            if choices is not None and getattr(self, f.name) not in choices:
                fail(f.name, getattr(self, f.name), f"must be one of {choices}")
        for cls in reversed(type(self).__mro__):
            if "check" in cls.__dict__:
                cls.__dict__["check"](self, bounds)
        return self

    def build(self, context: Context, reduce: Any) -> OuterOptimizer:
        """The algorithm's own outer optimizer (``reduce``: the compressed reducer, or
        ``None``); :meth:`outer` adds what the shared pieces ask for."""
        raise NotImplementedError(f"{type(self).__name__} builds nothing")

    def outer(self, context: Context) -> OuterOptimizer:
        """The outer optimizer a driver runs: :meth:`build`'s, with the compressed reducer,
        the guard and error feedback where the settings ask for them (validated where they
        were loaded: :meth:`validate`).

        The guard (``skip_nonfinite``) goes inside error feedback: a skipped step keeps the
        residual, which holds what the compressed payload left out.
        """
        reduce = self.reducer() if isinstance(self, Compression) else None
        outer = self.build(context, reduce)
        if isinstance(self, Guard) and self.skip_nonfinite and not outer.recovers_nonfinite:
            outer = skip_nonfinite(outer)
        if reduce is not None and self.error_feedback:
            outer = self.feedback(outer)
        return outer

    def inner(
        self, transform: optax.GradientTransformation, context: Context
    ) -> optax.GradientTransformation:
        """The inner transform as the algorithm runs it: ``transform`` itself unless the
        algorithm averages gradients first (DDP), wraps it (SPARTA's sparse averaging,
        DES-LOC's moment averaging on periods in rounds of ``context.sync_every`` steps, Muon
        on the hidden matrices) or replaces it (DeMo, at ``context.inner_learning_rate``)."""
        del context
        return transform

    def step_bytes(self, params: Any, replicas: int, sync_every: int) -> float:
        """Bytes one replica sends per inner step, on average, from its inner transform
        (0 unless it communicates every step)."""
        del params, replicas, sync_every
        return 0.0

    def optimizers(
        self, context: Context, transform: optax.GradientTransformation
    ) -> tuple[optax.GradientTransformation, OuterOptimizer]:
        """``(inner, outer)``: both sides from one context, which carries H, the rounds, the
        replicas, the parameters and the inner learning rate once (:meth:`inner` of
        ``transform`` and :meth:`outer`). What a driver runs.

        Example:
          >>> import optax
          >>> from co2jax.algorithms import registry
          >>> inner, outer = registry.settings("ddp").optimizers(Context(8), optax.sgd(0.1))
          >>> outer.schedule  # DDP: its gradients are averaged in the inner transform
          ()
        """
        return self.inner(transform, context), self.outer(context)

    def kernel_implementation(self) -> str:
        """The fused kernels' implementation these settings ask for: ``"auto"`` unless the
        algorithm has the :class:`Fused` piece (which says it). One piece reads another's
        choice through this method, not by a field's name."""
        return self.implementation if isinstance(self, Fused) else "auto"

    def metrics(self, state: Any) -> dict[str, Any]:
        """What a run records of this class's part of the algorithm's state each round
        (each piece and each algorithm defines its own; :meth:`recorded` merges them)."""
        del state
        return {}

    def recorded(self, state: Any) -> dict[str, Any]:
        """What a run records each round of the algorithm's outer state (``state``: a
        leading replica axis): every piece's :meth:`metrics`, base pieces first. The
        algorithm reads its own state (:func:`co2jax.protocol.find_state`); nothing outside
        it reads a field of its state by name."""
        out: dict[str, Any] = {}
        for cls in reversed(type(self).__mro__):
            if "metrics" in cls.__dict__:
                out.update(cls.__dict__["metrics"](self, state))
        return out

    def slow_link_bytes(self, params: Any, replicas: int) -> float | None:
        """Bytes one replica sends per round over the links between regions, where the
        algorithm tells them apart from the rest (``None``: it does not; every byte it
        sends may cross them)."""
        del params, replicas
        return None

    def unless(self, name: str, read: bool, when: str) -> None:
        """Refuses ``name`` set away from its default where it is not ``read``."""
        value = getattr(self, name)
        default = next(f.default for f in dataclasses.fields(self) if f.name == name)
        if not read and value != default:
            fail(name, value, f"ignored unless {when}")


# ---------------------------------------------------------------------------------------------
# the shared pieces


@dataclasses.dataclass(frozen=True)
class LearningRate:
    """The outer step's learning rate."""

    learning_rate: float = setting(0.7, "the outer learning rate")

    def check(self, bounds: Bounds) -> None:
        if not self.learning_rate > 0:
            fail("learning_rate", self.learning_rate, "must be > 0")


@dataclasses.dataclass(frozen=True)
class StepSize(LearningRate):
    """A learning rate and a momentum of the outer step."""

    momentum: float = setting(0.9, "the outer momentum, in [0, 1)")

    def check(self, bounds: Bounds) -> None:
        if not 0 <= self.momentum < 1:
            fail("momentum", self.momentum, "must be in [0, 1)")


@dataclasses.dataclass(frozen=True)
class OuterStep(StepSize):
    """The outer step as an optax transform of the averaged pseudo-gradient, with schedules
    by outer step (:func:`co2jax.outer_transform`)."""

    nesterov: bool = setting(True, "Nesterov momentum (SGD)")
    optimizer: str = setting("sgd", "the outer optax transform", OPTIMIZERS)
    lr_schedule: str = setting("constant", "the learning rate by outer step", LR_SCHEDULES)
    lr_warmup: int = setting(0, "outer steps of linear learning-rate warm-up from 0")
    lr_final: float = setting(0.0, "the decayed learning rate at the last round (a fraction)")
    momentum_warmup: int = setting(0, "outer steps of linear momentum ramp from 0")
    momentum_decay: int = setting(0, "last outer steps of linear momentum decay to momentum_final")
    momentum_final: float = setting(0.0, "the outer momentum at the end of momentum_decay")
    momentum_restart: int = setting(0, "zero the outer momentum every this many outer steps")
    beta2: float = setting(0.99, "outer Adam's second-moment decay (optimizer adam)")
    lr_in_state: bool = setting(
        False, "learning rate and momentum as optimizer state: one program for a sweep of them"
    )

    def check(self, bounds: Bounds) -> None:
        for name in ("lr_warmup", "momentum_warmup", "momentum_decay", "momentum_restart"):
            if getattr(self, name) < 0:
                fail(name, getattr(self, name), "must be >= 0 (outer steps)")
        if not 0 <= self.momentum_final < 1:
            fail("momentum_final", self.momentum_final, "must be in [0, 1)")
        self.unless("momentum_final", self.momentum_decay > 0, "outer.momentum_decay > 0")
        if self.momentum_restart and (self.optimizer != "sgd" or self.momentum == 0):
            fail(
                "momentum_restart",
                self.momentum_restart,
                "restarts SGD's momentum: needs outer.optimizer='sgd' and outer.momentum > 0",
            )
        if bounds.rounds is not None and self.momentum_warmup + self.momentum_decay > bounds.rounds:
            fail(
                "momentum_decay",
                self.momentum_decay,
                f"with momentum_warmup={self.momentum_warmup} must fit in "
                f"train.rounds={bounds.rounds}",
            )
        if not 0 <= self.lr_final <= 1:
            fail("lr_final", self.lr_final, "must be in [0, 1] (a fraction of learning_rate)")
        if not 0 <= self.beta2 < 1:
            fail("beta2", self.beta2, "must be in [0, 1)")
        self.unless("beta2", self.optimizer == "adam", "outer.optimizer is 'adam'")
        implementation = self.kernel_implementation()
        if self.lr_in_state and implementation in ("pallas", "interpret"):
            why = "outer hyper-parameters held in the state are not fused"
            fail("lr_in_state", self.lr_in_state, f"{why} (implementation={implementation!r})")
        if (
            bounds.rounds is not None
            and self.lr_schedule != "constant"
            and self.lr_warmup >= bounds.rounds
        ):
            fail(
                "lr_warmup",
                self.lr_warmup,
                f"must be < train.rounds={bounds.rounds} (the outer learning rate decays until "
                "then)",
            )

    def transform(self, context: Context) -> optax.GradientTransformation:
        """The outer optax transform these settings name (``optax.sgd`` by default, which
        the fused outer update runs while nothing is scheduled)."""
        lr = learning_rate_schedule(
            self.learning_rate,
            self.lr_schedule,
            warmup=self.lr_warmup,
            rounds=context.rounds,
            final=self.lr_final,
        )
        momentum = momentum_schedule(
            self.momentum,
            self.momentum_warmup,
            decay=self.momentum_decay,
            final=self.momentum_final,
            rounds=context.rounds,
        )
        return outer_transform(
            self.optimizer,
            lr,
            momentum,
            nesterov=self.nesterov,
            b2=self.beta2,
            in_state=self.lr_in_state,
            restart_every=self.momentum_restart,
        )


@dataclasses.dataclass(frozen=True)
class Compression:
    """Pseudo-gradients compressed on the wire (:mod:`co2jax.comm`)."""

    compression: str = setting("none", "the payload's format on the wire", COMPRESSIONS)
    collective: str = setting(
        "all_gather", "a compressed payload's collective (two_step: RS + AG)", COLLECTIVES
    )
    error_feedback: bool = setting(False, "keep what compression left out, per replica")

    def check(self, bounds: Bounds) -> None:
        if self.error_feedback and self.compression == "none":
            fail("error_feedback", self.error_feedback, "needs outer.compression")
        self.unless("collective", self.compression != "none", "outer.compression is set")

    def feedback(self, outer: OuterOptimizer) -> OuterOptimizer:
        """``outer`` with error feedback on its compressed payloads (classic: no decay, no
        scale; an algorithm may set its own, as MuLoCo does)."""
        return error_feedback(outer)

    def reducer(self) -> Any:
        """The compressed reducer, or ``None`` (the algorithm's exact mean)."""
        if self.compression == "none":
            return None
        kernels = {}
        if self.compression in ("int8", "fp4", "2bit"):
            kernels = {"implementation": self.kernel_implementation()}
        codec = make(self.compression, **kernels)
        collective = {"all_gather": all_gather_compressed, "two_step": all_reduce_compressed}
        return collective[self.collective](codec)


@dataclasses.dataclass(frozen=True)
class Fused:
    """The fused outer update's implementation (:mod:`co2jax.kernels`)."""

    implementation: str = setting(
        "auto", "the fused outer update: auto, pallas, interpret or xla", IMPLEMENTATIONS
    )


@dataclasses.dataclass(frozen=True)
class Guard:
    """:func:`co2jax.skip_nonfinite` around the algorithm."""

    skip_nonfinite: bool = setting(True, "skip a non-finite outer step (and recover)")

    def metrics(self, state: Any) -> dict[str, Any]:
        """``skipped``: the outer steps the guard has skipped (None: no guard)."""
        guard = find_state(state, SkipNonfiniteState)
        return {"skipped": None if guard is None else int(np.asarray(guard.num_skipped).max())}


@dataclasses.dataclass(frozen=True)
class Delay:
    """Rounds between producing a pseudo-gradient and applying its average."""

    delay: int = setting(1, "rounds of delay (>= 1)")

    def check(self, bounds: Bounds) -> None:
        if self.delay < 1:
            fail("delay", self.delay, "must be >= 1")
        if bounds.rounds is not None and self.delay >= bounds.rounds:
            fail(
                "delay",
                self.delay,
                f"must be < train.rounds={bounds.rounds} (a round's average is applied "
                "outer.delay rounds later: none would arrive)",
            )


@dataclasses.dataclass(frozen=True)
class Fragmented:
    """Parameter fragments synced one at a time, each overlapped by ``tau`` steps."""

    fragments: int = setting(2, "P, the fragments (whole transformer blocks each)")
    tau: int = setting(1, "inner steps between sending and applying a fragment")
    alpha: float = setting(0.5, "the merge weight of the local values")

    def check(self, bounds: Bounds) -> None:
        if self.fragments < 1:
            fail("fragments", self.fragments, "must be >= 1")
        H = bounds.sync_every
        if H is not None and not 0 <= self.tau < H // self.fragments:
            span = f"[0, {H // self.fragments})"
            fail("tau", self.tau, f"must be in [0, sync_every // fragments) = {span}")
        if not 0 <= self.alpha <= 1:
            fail("alpha", self.alpha, "must be in [0, 1]")
        if bounds.layers is not None and self.fragments > bounds.layers:
            fail(
                "fragments",
                self.fragments,
                f"must be <= model.n_layers={bounds.layers} (a fragment is whole transformer "
                "blocks)",
            )

    def cut(self, context: Context) -> Fragments:
        """The parameters (``context.params``) cut into ``fragments``."""
        if context.params is None:
            raise ValueError(f"{self.algorithm} needs Context.params to cut into fragments")
        fragmenter = context.fragmenter or (lambda params, count: make_fragments(params, count))
        return fragmenter(context.params, self.fragments)


@dataclasses.dataclass(frozen=True)
class DCTTopK:
    """A momentum shared as its top-k DCT coefficients per chunk (:mod:`co2jax.comm.dct`)."""

    topk: int = setting(32, "DCT coefficients kept per chunk (>= 1)")
    dct_chunk: int = setting(64, "the DCT chunk side (each axis: its largest divisor <=)")

    def check(self, bounds: Bounds) -> None:
        for name in ("topk", "dct_chunk"):
            if getattr(self, name) < 1:
                fail(name, getattr(self, name), "must be >= 1")
