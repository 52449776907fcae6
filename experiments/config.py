"""Typed, frozen run configs: presets, dotted command-line overrides, validation.

A run is one :class:`Config`: model, data, mesh, inner optimizer, outer algorithm (the
library's :class:`co2jax.algorithms.registry.OuterConfig`, whose names and checks come from the
algorithm registry), schedule, evaluation, checkpointing and logging. Presets are functions
returning a Config; overrides such as ``outer.learning_rate=0.7 mesh.replica=4`` are applied
by :func:`override`, and :func:`validate` rejects a bad config before anything compiles,
naming the field.

Example:
  >>> cfg = override(preset("cpu-tiny"), ["outer.algorithm=co2", "train.rounds=3"])
  >>> cfg.outer.algorithm, cfg.train.rounds, cfg.mesh.replica
  ('co2', 3, 4)
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from dataclasses import dataclass, field
from typing import Any

from co2jax.algorithms import registry
from co2jax.algorithms.registry import OuterConfig
from co2jax.kernels.api import IMPLEMENTATIONS  # noqa: F401  (the fused update's choices)

ALGORITHMS = registry.NAMES  # the library's algorithm registry
DATA_KINDS = ("markov", "text", "stdlib", "tokens")
SCHEDULES = ("constant", "cosine")


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
        raise ValueError(f"preset must be one of {sorted(PRESETS)}, got preset={name!r}")
    return PRESETS[name]()


# ---------------------------------------------------------------------------------------------
# overrides


def _convert(text: str, annotation: Any, key: str) -> Any:
    """Parses ``text`` as the annotated type (int, float, bool, str, or X | None)."""
    hint = annotation
    if isinstance(hint, str):
        hint = eval(hint, {"int": int, "float": float, "bool": bool, "str": str})
    args = typing.get_args(hint)
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        if text.lower() in ("none", "null"):
            return None
        hint = next(a for a in args if a is not type(None))
    try:
        if hint is bool:
            if text.lower() not in ("true", "false", "1", "0"):
                raise ValueError(text)
            return text.lower() in ("true", "1")
        return hint(text)
    except ValueError:
        raise ValueError(
            f"override {key}={text!r}: expected {getattr(hint, '__name__', hint)}"
        ) from None


def override(config: Config, items: list[str]) -> Config:
    """Applies dotted overrides like ``["outer.learning_rate=0.7", "mesh.replica=2"]``."""
    for item in items:
        if "=" not in item:
            raise ValueError(f"override must look like section.field=value, got {item!r}")
        key, text = item.split("=", 1)
        parts = key.strip().split(".")
        config = _set(config, parts, text.strip(), key)
    return config


def _set(node: Any, parts: list[str], text: str, key: str) -> Any:
    names = {f.name: f for f in dataclasses.fields(node)}
    if parts[0] not in names:
        raise ValueError(f"unknown config field {key!r} (known here: {sorted(names)})")
    f = names[parts[0]]
    current = getattr(node, parts[0])
    if len(parts) == 1:
        if dataclasses.is_dataclass(current):
            raise ValueError(f"{key!r} is a section; set one of its fields")
        return dataclasses.replace(node, **{f.name: _convert(text, f.type, key)})
    if not dataclasses.is_dataclass(current):
        raise ValueError(f"unknown config field {key!r}")
    return dataclasses.replace(node, **{f.name: _set(current, parts[1:], text, key)})


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
            kwargs[key] = SECTIONS[key](**value)
        else:
            raise ValueError(f"unknown config field {key!r}")
    return Config(**kwargs)


# ---------------------------------------------------------------------------------------------
# validation


def _fail(field_name: str, value: Any, why: str) -> None:
    raise ValueError(f"{field_name}={value!r}: {why}")


def validate(config: Config, device_count: int | None = None) -> Config:
    """Checks every field that can be checked before compiling; returns ``config``."""
    o, d, m, t, i = config.outer, config.data, config.mesh, config.train, config.inner
    if t.sync_every < 1:
        _fail("train.sync_every", t.sync_every, "H must be >= 1")
    registry.validate(o, t.sync_every)
    if t.rounds < 1:
        _fail("train.rounds", t.rounds, "must be >= 1")
    if i.learning_rate <= 0:
        _fail("inner.learning_rate", i.learning_rate, "must be > 0")
    if i.schedule not in SCHEDULES:
        _fail("inner.schedule", i.schedule, f"must be one of {SCHEDULES}")
    if d.kind not in DATA_KINDS:
        _fail("data.kind", d.kind, f"must be one of {DATA_KINDS}")
    if d.kind in ("text", "tokens") and not d.path:
        _fail("data.path", d.path, f"is required for data.kind={d.kind!r}")
    if d.batch < 1 or d.seq_len < 1:
        _fail("data.batch" if d.batch < 1 else "data.seq_len", min(d.batch, d.seq_len), ">= 1")
    sizes = {"mesh.replica": m.replica, "mesh.data": m.data, "mesh.model": m.model}
    for name, size in sizes.items():
        if size != -1 and size < 1:
            _fail(name, size, "must be >= 1 or -1 (fill)")
    if m.data > 0 and d.batch % m.data:
        _fail("data.batch", d.batch, f"must be a multiple of mesh.data={m.data}")
    if device_count is not None:
        fixed = [s for s in sizes.values() if s != -1]
        product = 1
        for s in fixed:
            product *= s
        if device_count % product or (len(fixed) == 3 and product != device_count):
            _fail(
                "mesh.replica",
                m.replica,
                f"mesh sizes {tuple(sizes.values())} do not fit {device_count} devices",
            )
    return config
