"""Typed, frozen run configs: presets and dotted command-line overrides.

A run is one :class:`Config`: model, data, mesh, inner optimizer, outer algorithm (the
library's :class:`co2jax.algorithms.registry.OuterConfig`, whose names and checks come from the
algorithm registry), schedule, evaluation, checkpointing and logging. Presets are functions
returning a Config; overrides such as ``outer.learning_rate=0.7 mesh.replica=4`` are applied
by :func:`override`. A refused setting raises :class:`ConfigError`, naming the field as it is
overridden (``outer.topk=0: must be >= 1``). The checks of every field, before anything is
built, compiled or written, are in :mod:`experiments.checks` (``validate``, ``load``,
``check_paths``).

Example:
  >>> cfg = override(preset("cpu-tiny"), ["outer.algorithm=co2", "train.rounds=3"])
  >>> cfg.outer.algorithm, cfg.train.rounds, cfg.mesh.replica
  ('co2', 3, 4)
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import types
import typing
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from co2jax.algorithms import registry
from co2jax.algorithms.registry import OuterConfig
from co2jax.kernels.api import IMPLEMENTATIONS
from experiments import model as model_lib

ALGORITHMS = registry.NAMES  # the library's algorithm registry
DATA_KINDS = ("markov", "text", "stdlib", "tokens")
SCHEDULES = ("constant", "cosine")
TOKEN_DTYPES = ("uint16", "uint32")
MODEL_DTYPES = ("float32", "bfloat16", "float16")  # experiments.model's compute dtypes
CHOICES = {
    "model.preset": tuple(model_lib.PRESETS),
    "model.dtype": MODEL_DTYPES,
    "data.kind": DATA_KINDS,
    "data.token_dtype": TOKEN_DTYPES,
    "inner.schedule": SCHEDULES,
    "outer.algorithm": ALGORITHMS,
    "outer.penalty": registry.PENALTIES,
    "outer.mode": registry.MODES,
    "outer.implementation": IMPLEMENTATIONS,
    "outer.compression": registry.COMPRESSIONS,
    "outer.collective": registry.COLLECTIVES,
}
"""The string fields with a fixed set of values."""


@dataclass(frozen=True)
class ModelConfig:
    preset: str = "tiny"
    d_model: int | None = None
    n_layers: int | None = None
    n_heads: int | None = None
    d_ff: int | None = None
    dtype: str = "float32"


@dataclass(frozen=True)
class DataConfig:
    kind: str = "markov"
    path: str | None = None  # text: file, directory or glob; tokens: a .bin file
    vocab_size: int = 64  # markov: alphabet size; tokens: the tokenizer's vocabulary
    branching: int = 4  # markov: next-token choices per state
    token_dtype: str = "uint16"
    max_bytes: int = 20_000_000  # stdlib / text: cap on the corpus size
    iid: bool = True  # False: replica r draws from its own source / partition
    batch: int = 8  # sequences per replica per inner step (split over the data axis)
    seq_len: int = 64
    seed: int = 0


@dataclass(frozen=True)
class MeshConfig:
    replica: int = 4
    data: int = 2
    model: int = 1

    @property
    def devices(self) -> int | None:
        """The devices the mesh spans (None where a size is -1: it fills those there are)."""
        sizes = (self.replica, self.data, self.model)
        return None if -1 in sizes else math.prod(sizes)


@dataclass(frozen=True)
class InnerConfig:
    learning_rate: float = 3e-3
    weight_decay: float = 0.1
    b1: float = 0.9
    b2: float = 0.95
    warmup_steps: int = 20
    schedule: str = "cosine"


@dataclass(frozen=True)
class TrainConfig:
    rounds: int = 20
    sync_every: int = 16
    seed: int = 0
    max_skipped: int = 3  # rounds in a row skipped by outer.skip_nonfinite before the run stops
    # inside a replica: split the outer state over data (1/D), and with fsdp the parameters
    # and inner state too (tensor parallelism comes from mesh.model and the model's axes)
    shard_outer_state: bool = False
    fsdp: bool = False


@dataclass(frozen=True)
class EvalConfig:
    every: int = 5  # rounds
    batch: int = 64


@dataclass(frozen=True)
class CheckpointConfig:
    dir: str | None = None
    every: int = 10  # rounds
    keep: int = 2


@dataclass(frozen=True)
class LogConfig:
    dir: str = "runs"
    tensorboard: bool = True
    progress: bool = True


@dataclass(frozen=True)
class Config:
    name: str = "run"
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    mesh: MeshConfig = field(default_factory=MeshConfig)
    inner: InnerConfig = field(default_factory=InnerConfig)
    outer: OuterConfig = field(default_factory=OuterConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    log: LogConfig = field(default_factory=LogConfig)


# ---------------------------------------------------------------------------------------------
# presets


def _cpu_tiny() -> Config:
    """The embedded default: a small transformer on a synthetic Markov language, CPU mesh."""
    return Config(
        name="cpu-tiny",
        model=ModelConfig(d_model=64, n_layers=2, n_heads=4, d_ff=256),
        data=DataConfig(vocab_size=128, branching=8, batch=8, seq_len=32),
        train=TrainConfig(rounds=30, sync_every=16),
        eval=EvalConfig(every=5, batch=64),
    )


def _micro() -> Config:
    """Two rounds of a very small model: for tests of the whole pipeline."""
    return Config(
        name="micro",
        model=ModelConfig(d_model=32, n_layers=2, n_heads=2, d_ff=64),
        data=DataConfig(batch=4, seq_len=16, vocab_size=32),
        train=TrainConfig(rounds=2, sync_every=2),
        eval=EvalConfig(every=1, batch=8),
        log=LogConfig(progress=False),
    )


def _cpu_stdlib() -> Config:
    return Config(
        name="cpu-stdlib",
        data=DataConfig(kind="stdlib", vocab_size=256, seq_len=128, max_bytes=5_000_000),
    )


def _pod_150m() -> Config:
    return Config(
        name="pod-150m",
        model=ModelConfig(preset="150m", dtype="bfloat16"),
        data=DataConfig(kind="tokens", vocab_size=50304, batch=64, seq_len=1024),
        mesh=MeshConfig(replica=2, data=-1),
        inner=InnerConfig(learning_rate=4e-4, warmup_steps=1000),
        train=TrainConfig(rounds=200, sync_every=500),
        eval=EvalConfig(every=10, batch=256),
        checkpoint=CheckpointConfig(dir="checkpoints/pod-150m", every=10),
    )


def _pod_1b() -> Config:
    return Config(
        name="pod-1b",
        model=ModelConfig(preset="1b", dtype="bfloat16"),
        data=DataConfig(kind="tokens", vocab_size=32000, batch=64, seq_len=2048),
        mesh=MeshConfig(replica=4, data=-1),
        inner=InnerConfig(learning_rate=3e-4, warmup_steps=1000),
        train=TrainConfig(rounds=400, sync_every=500),
        eval=EvalConfig(every=10, batch=256),
        checkpoint=CheckpointConfig(dir="checkpoints/pod-1b", every=5),
    )


PRESETS = {
    "cpu-tiny": _cpu_tiny,
    "micro": _micro,
    "cpu-stdlib": _cpu_stdlib,
    "pod-150m": _pod_150m,
    "pod-1b": _pod_1b,
}


def preset(name: str) -> Config:
    if name not in PRESETS:
        raise ConfigError("preset", f"must be one of {sorted(PRESETS)}", name)
    return PRESETS[name]()


# ---------------------------------------------------------------------------------------------
# errors


class ConfigError(ValueError):
    """A setting refused before anything is built or written, named as it is overridden.

    ``key`` is the dotted field (``outer.topk``), or the text typed for a malformed override;
    ``why`` is the reason, one line. ``str(error)`` reads ``key=value: why``.

    Example:
      >>> e = ConfigError("outer.topk", "must be >= 1", 0)
      >>> str(e), e.typed(["train.rounds=3", "outer.topk = 0"])
      ('outer.topk=0: must be >= 1', 'outer.topk = 0: must be >= 1')
    """

    def __init__(self, key: str, why: str, *value: Any):
        self.key, self.why = key, why.replace("\n", " ")
        head = f"{key}={value[0]!r}" if value else key
        super().__init__(f"{head}: {self.why}")

    def typed(self, overrides: Sequence[str]) -> str:
        """The message with the override as the user typed it, when one of them set ``key``."""
        for item in reversed(list(overrides)):
            if item.split("=", 1)[0].strip() == self.key:
                return f"{item.strip()}: {self.why}"
        return str(self)


# ---------------------------------------------------------------------------------------------
# overrides


def _hint(annotation: Any) -> tuple[Any, bool]:
    """``(type, accepts None)`` of a field annotation (int, float, bool, str, or X | None)."""
    hint = annotation
    if isinstance(hint, str):
        hint = eval(hint, {"int": int, "float": float, "bool": bool, "str": str})
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        return next(a for a in typing.get_args(hint) if a is not type(None)), True
    return hint, False


def _convert(text: str, annotation: Any, key: str) -> Any:
    """Parses ``text`` as the annotated type (int, float, bool, str, or X | None)."""
    hint, optional = _hint(annotation)
    if optional and text.lower() in ("none", "null"):
        return None
    try:
        if hint is bool:
            if text.lower() not in ("true", "false", "1", "0"):
                raise ValueError(text)
            return text.lower() in ("true", "1")
        return hint(text)
    except ValueError:
        kind = hint.__name__ + (" or none" if optional else "")
        raise ConfigError(key, f"expected {kind}", text) from None


def override(config: Config, items: list[str]) -> Config:
    """Applies dotted overrides like ``["outer.learning_rate=0.7", "mesh.replica=2"]``."""
    for item in items:
        if "=" not in item:
            raise ConfigError(item.strip(), "an override must look like section.field=value")
        key, text = item.split("=", 1)
        key = key.strip()
        config = _set(config, key.split("."), text.strip(), key)
    return config


def _set(node: Any, parts: list[str], text: str, key: str, where: str = "") -> Any:
    names = {f.name: f for f in dataclasses.fields(node)}
    if parts[0] not in names:
        near = difflib.get_close_matches(parts[0], names, n=1)
        hint = f"; did you mean {where}{near[0]}?" if near else ""
        known = ", ".join(sorted(names))
        section = where[:-1] or "the config"
        raise ConfigError(key, f"unknown config field {key!r} ({section} has {known}){hint}")
    f = names[parts[0]]
    current = getattr(node, parts[0])
    if len(parts) == 1:
        if dataclasses.is_dataclass(current):
            first = dataclasses.fields(current)[0].name
            raise ConfigError(
                key, f"{key!r} is a section; set one of its fields ({key}.{first}=...)"
            )
        return dataclasses.replace(node, **{f.name: _convert(text, f.type, key)})
    if not dataclasses.is_dataclass(current):
        raise ConfigError(key, f"unknown config field {key!r} ({where}{f.name} has no fields)")
    value = _set(current, parts[1:], text, key, f"{where}{f.name}.")
    return dataclasses.replace(node, **{f.name: value})


def _leaves(node: Any, prefix: str = "") -> Iterator[tuple[str, dataclasses.Field, Any]]:
    """``(dotted name, field, value)`` of every setting, in declaration order."""
    for f in dataclasses.fields(node):
        value = getattr(node, f.name)
        if dataclasses.is_dataclass(value):
            yield from _leaves(value, f"{prefix}{f.name}.")
        else:
            yield f"{prefix}{f.name}", f, value


def describe() -> str:
    """Every config field with its type and default, for ``--help`` (a preset changes some)."""
    lines = [
        "config fields, set as section.field=value (the config classes' defaults: a preset",
        "changes some, --print-config shows the resolved config):",
    ]
    for key, f, default in _leaves(Config()):
        kind = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
        choices = f"  one of: {', '.join(CHOICES[key])}" if key in CHOICES else ""
        lines.append(f"  {key:<26} {kind:<13} {default!r}{choices}")
    return "\n".join(lines)


def to_dict(config: Config) -> dict:
    return dataclasses.asdict(config)


def to_json(config: Config) -> str:
    return json.dumps(to_dict(config), indent=2, sort_keys=True)


SECTIONS = {
    "model": ModelConfig,
    "data": DataConfig,
    "mesh": MeshConfig,
    "inner": InnerConfig,
    "outer": OuterConfig,
    "train": TrainConfig,
    "eval": EvalConfig,
    "checkpoint": CheckpointConfig,
    "log": LogConfig,
}


def from_dict(d: dict) -> Config:
    """The inverse of :func:`to_dict` (e.g. for a saved ``config.json``)."""
    kwargs: dict[str, Any] = {}
    for key, value in d.items():
        if key == "name":
            kwargs[key] = value
        elif key in SECTIONS:
            known = {f.name for f in dataclasses.fields(SECTIONS[key])}
            for name in value:
                if name not in known:
                    raise ConfigError(f"{key}.{name}", "unknown config field")
            kwargs[key] = SECTIONS[key](**value)
        else:
            raise ConfigError(key, f"unknown config field {key!r}")
    return Config(**kwargs)
