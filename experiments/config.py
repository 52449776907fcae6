"""Typed, frozen run configs: presets, dotted command-line overrides and config files.

A run is one :class:`Config`: model, data, mesh, inner optimizer, outer algorithm, schedule,
evaluation, checkpointing and logging. Its ``outer`` section is the chosen algorithm's own
settings class (:mod:`co2jax.algorithms.registry`): ``outer.algorithm=co2`` makes it
:class:`co2jax.algorithms.co2.CO2Settings`, so a setting the algorithm does not declare
cannot be set. Every field has a type, a default and a one-line description (``--help``).

Presets are functions returning a Config; overrides such as ``outer.learning_rate=0.7
mesh.replica=4`` are applied by :func:`override`, a YAML or JSON file by :func:`merge`
(``--config FILE``, read by :mod:`experiments.config_files`; :func:`to_json` writes one
back). ``outer.algorithm`` is applied before the other overrides, whatever their order, and
keeps the settings of the previous algorithm that the new one also has and that differ from
their defaults. A refused setting raises :class:`ConfigError`, naming the field as it is
overridden (``outer.topk=0: must be >= 1``). Whether the values are valid is checked once,
where a run's config is loaded (:func:`experiments.checks.validate`).

Example:
  >>> cfg = override(preset("cpu-tiny"), ["train.rounds=3", "outer.algorithm=co2"])
  >>> type(cfg.outer).__name__, cfg.train.rounds, cfg.mesh.replica
  ('CO2Settings', 3, 4)
  >>> override(cfg, ["outer.delay=2"])
  Traceback (most recent call last):
  ...
  experiments.config.ConfigError: outer.delay: co2 has no such setting (a setting of ...)
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import json
import math
import re
import types
import typing
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from co2jax.algorithms import registry
from co2jax.algorithms.settings import setting
from experiments import model as model_lib

ALGORITHMS = registry.NAMES  # the library's algorithm registry
DEFAULT_ALGORITHM = "diloco"
DATA_KINDS = ("markov", "text", "stdlib", "tokens")
SCHEDULES = ("constant", "cosine")
INNER_OPTIMIZERS = ("adamw", "gpa")
TOKEN_DTYPES = ("auto", "uint16", "uint32")
MODEL_DTYPES = ("float32", "bfloat16", "float16")  # experiments.model's compute dtypes


@dataclass(frozen=True)
class ModelConfig:
    """The transformer (experiments.model)."""

    preset: str = setting(
        "tiny", "the model's size: its preset's dimensions", tuple(model_lib.PRESETS)
    )
    d_model: int | None = setting(None, "the residual width (none: the preset's)")
    n_layers: int | None = setting(None, "transformer blocks (none: the preset's)")
    n_heads: int | None = setting(None, "attention heads (none: the preset's)")
    d_ff: int | None = setting(None, "the MLP's hidden width (none: the preset's)")
    dtype: str = setting(
        "float32", "the compute dtype of matmuls and activations (parameters float32)",
        MODEL_DTYPES,
    )  # fmt: skip
    remat: bool = setting(
        False, "recompute each block's activations in the backward pass (less memory, about "
        "1/3 more compute; the same values)",
    )  # fmt: skip


@dataclass(frozen=True)
class DataConfig:
    """The token source and the batches (experiments.data)."""

    kind: str = setting(
        "markov", "markov: synthetic, built in; text/stdlib: bytes of files or of Python's "
        "standard library; tokens: a .bin token file", DATA_KINDS,
    )  # fmt: skip
    path: str | None = setting(
        None, "text: a file, directory or glob; tokens: a .bin file (python -m "
        "experiments.tokenize_corpus makes one)",
    )  # fmt: skip
    vocab_size: int = setting(64, "markov: alphabet size; tokens: the tokenizer's vocabulary")
    branching: int = setting(4, "markov: next-token choices per state")
    token_dtype: str = setting(
        "auto", "tokens: the token file's integer type (auto: its sidecar's, else uint16)",
        TOKEN_DTYPES,
    )  # fmt: skip
    max_bytes: int = setting(20_000_000, "text/stdlib: cap on the corpus size in bytes")
    iid: bool = setting(True, "false: replica r draws from its own source or partition")
    batch: int = setting(8, "sequences per replica per inner step (split over mesh.data)")
    seq_len: int = setting(64, "tokens per sequence")
    seed: int = setting(0, "the data's seed")


@dataclass(frozen=True)
class MeshConfig:
    """The device mesh: replicas x data x model (co2jax.make_mesh)."""

    replica: int = setting(4, "R, the replicas (each takes its own inner steps)")
    data: int = setting(2, "devices splitting a replica's batch (-1: the devices left)")
    model: int = setting(1, "devices splitting a replica's model, tensor parallel (-1: fill)")

    @property
    def devices(self) -> int | None:
        """The devices the mesh spans (None where a size is -1: it fills those there are)."""
        sizes = (self.replica, self.data, self.model)
        return None if -1 in sizes else math.prod(sizes)


@dataclass(frozen=True)
class InnerConfig:
    """The inner optimizer on each replica: AdamW, or GPA-AdamW (``co2jax.gpa``: AdamW's
    steps on z, the gradient taken at y, evaluated at the average x)."""

    optimizer: str = setting("adamw", "the inner optimizer", INNER_OPTIMIZERS)
    learning_rate: float = setting(3e-3, "AdamW's peak learning rate")
    weight_decay: float = setting(0.1, "AdamW's decoupled weight decay")
    b1: float = setting(0.9, "AdamW's first-moment decay, in [0, 1)")
    b2: float = setting(0.95, "AdamW's second-moment decay, in [0, 1)")
    warmup_steps: int = setting(20, "inner steps of linear learning-rate warm-up")
    schedule: str = setting(
        "cosine", "after the warm-up: cosine decays to 0.1x by the last step", SCHEDULES
    )
    gpa_mu_y: float = setting(0.7, "GPA: y = mu_y x + (1 - mu_y) z, in (0, 1]")
    gpa_mu_x: float = setting(0.9967, "GPA: x <- mu_x x + (1 - mu_x) z, in [0, 1)")


@dataclass(frozen=True)
class TrainConfig:
    """Rounds, H and the layout inside a replica."""

    rounds: int = setting(20, "outer rounds, each H inner steps")
    sync_every: int = setting(16, "H, the inner steps of a round")
    seed: int = setting(0, "the parameters' seed")
    max_skipped: int = setting(
        3, "rounds in a row skipped by outer.skip_nonfinite before the run stops"
    )
    shard_outer_state: bool = setting(
        False, "split the outer state over mesh.data inside a replica (1/D per device)"
    )
    fsdp: bool = setting(False, "split the parameters and inner state over mesh.data too")
    offload_outer_state: bool = setting(
        False, "keep the outer state in host memory, moved in for the outer step"
    )


@dataclass(frozen=True)
class EvalConfig:
    """Held-out evaluation."""

    every: int = setting(5, "rounds between evaluations (0: after the last round only)")
    batch: int = setting(64, "held-out sequences per evaluation")


@dataclass(frozen=True)
class CheckpointConfig:
    """Orbax checkpoints at round boundaries."""

    dir: str | None = setting(None, "where checkpoints go (none: no checkpoints)")
    every: int = setting(10, "rounds between checkpoints")
    keep: int = setting(2, "checkpoints kept")


@dataclass(frozen=True)
class LogConfig:
    """Metrics, TensorBoard and progress."""

    dir: str = setting("runs", "where runs go: a run writes log.dir/<name>")
    tensorboard: bool = setting(True, "write TensorBoard event files")
    progress: bool = setting(True, "show a progress bar")


def _default_outer() -> registry.Settings:
    return registry.settings(DEFAULT_ALGORITHM)


@dataclass(frozen=True)
class Config:
    """A run."""

    name: str = setting("run", "the run's name: its directory under log.dir")
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    mesh: MeshConfig = field(default_factory=MeshConfig)
    inner: InnerConfig = field(default_factory=InnerConfig)
    outer: registry.Settings = field(default_factory=_default_outer)  # the chosen algorithm's
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
        inner=InnerConfig(warmup_steps=2),  # within its 4 steps (checks.notes warns otherwise)
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
        # a Llama-style 1.2B model; FSDP and recomputed activations make its round fit a
        # v5e chip (16 GiB) at 4 slices x 16 chips: python -m experiments.aot --slices 4
        model=ModelConfig(preset="1b", dtype="bfloat16", remat=True),
        data=DataConfig(kind="tokens", vocab_size=32000, batch=64, seq_len=2048),
        mesh=MeshConfig(replica=4, data=-1),
        inner=InnerConfig(learning_rate=3e-4, warmup_steps=1000),
        train=TrainConfig(rounds=400, sync_every=500, fsdp=True),
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
        self.key, self.why, self.value = key, why.replace("\n", " "), value
        head = f"{key}={value[0]!r}" if value else key
        super().__init__(f"{head}: {self.why}")

    def typed(self, overrides: Sequence[str]) -> str:
        """The message with the override as the user typed it, when one of them set ``key``."""
        for item in reversed(list(overrides)):
            if item.split("=", 1)[0].strip() == self.key:
                return f"{item.strip()}: {self.why}"
        return str(self)

    def within(self, where: str) -> ConfigError:
        """The same error, saying where the setting came from (a config file: ``where`` its
        path, or its path, line and the line's text)."""
        out = ConfigError(self.key, f"{self.why} (in {where})", *self.value)
        out.args = (f"{self} (in {where})",)  # the message as it was (from_library's too)
        return out


def from_library(error: ValueError) -> ConfigError:
    """The library's one-line ``outer.name=value: why`` ValueError as a ConfigError, its
    message kept."""
    message = str(error).replace("\n", " ")
    head, _, why = message.partition(": ")
    out = ConfigError(head.split("=", 1)[0], why or message)
    out.args = (message,)
    return out


# ---------------------------------------------------------------------------------------------
# fields


def field_type(annotation: Any) -> tuple[Any, bool]:
    """``(type, accepts None)`` of a field annotation (int, float, bool, str, or X | None)."""
    hint = annotation
    if isinstance(hint, str):
        hint = eval(hint, {"int": int, "float": float, "bool": bool, "str": str})
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        return next(a for a in typing.get_args(hint) if a is not type(None)), True
    return hint, False


def leaves(node: Any, prefix: str = "") -> Iterator[tuple[str, dataclasses.Field, Any]]:
    """``(dotted name, field, value)`` of every setting, in declaration order."""
    for f in dataclasses.fields(node):
        value = getattr(node, f.name)
        if dataclasses.is_dataclass(value):
            yield from leaves(value, f"{prefix}{f.name}.")
        else:
            yield f"{prefix}{f.name}", f, value


def _choices() -> dict[str, tuple]:
    out = {}
    configs = [Config(), *(Config(outer=registry.settings(name)) for name in ALGORITHMS)]
    for config in configs:
        for key, f, _ in leaves(config):
            if f.metadata.get("choices") is not None:
                out[key] = f.metadata["choices"]
    out["outer.algorithm"] = ALGORITHMS
    return out


CHOICES = _choices()
"""The string fields with a fixed set of values (``outer.*``: of any algorithm)."""


# ---------------------------------------------------------------------------------------------
# overrides and config files


def _convert(text: str, annotation: Any, key: str) -> Any:
    """Parses ``text`` as the annotated type (int, float, bool, str, or X | None)."""
    hint, optional = field_type(annotation)
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


def _value(value: Any, annotation: Any, key: str) -> Any:
    """A value from the command line (text, parsed) or a file (kept: :func:`experiments.
    checks.validate` checks its type; an int where a float goes becomes that float)."""
    if isinstance(value, str):
        return _convert(value, annotation, key)
    hint, _ = field_type(annotation)
    if hint is float and type(value) is int:
        return float(value)
    return value


def with_algorithm(config: Config, algorithm: Any) -> Config:
    """``config`` with ``outer`` the settings of ``algorithm``: the previous algorithm's
    settings that this one also has and that differ from their defaults are kept."""
    if algorithm not in registry.REGISTRY:
        raise ConfigError("outer.algorithm", f"must be one of {ALGORITHMS}", algorithm)
    old = config.outer
    if old.algorithm == algorithm:
        return config
    cls = registry.REGISTRY[algorithm]
    names = {f.name for f in dataclasses.fields(cls)} - {"algorithm"}
    kept = {
        f.name: getattr(old, f.name)
        for f in dataclasses.fields(old)
        if f.name in names and getattr(old, f.name) != f.default
    }
    return dataclasses.replace(config, outer=cls(**kept))


def override(config: Config, items: Sequence[str]) -> Config:
    """Applies dotted overrides like ``["outer.learning_rate=0.7", "mesh.replica=2"]``;
    ``outer.algorithm=`` first, whatever its place (the other ``outer.*`` are its settings)."""
    parsed = []
    for item in items:
        if "=" not in item:
            raise ConfigError(item.strip(), "an override must look like section.field=value")
        key, text = item.split("=", 1)
        parsed.append((key.strip(), text.strip()))
    for key, text in parsed:
        if key == "outer.algorithm":
            config = with_algorithm(config, text)
    for key, text in parsed:
        if key != "outer.algorithm":
            config = _set(config, key.split("."), text, key)
    return config


def merge(config: Config, tree: Any, where: str = "the config") -> Config:
    """Sets the fields of a nested mapping (a config file, :func:`to_dict`'s output) on
    ``config``, ``outer.algorithm`` first; a field left out keeps ``config``'s value."""
    if not isinstance(tree, dict):
        raise ConfigError(where, "must be a mapping of sections to their fields")
    outer = tree.get("outer")
    if isinstance(outer, dict) and "algorithm" in outer:
        config = with_algorithm(config, outer["algorithm"])
    for key, value in _flatten(tree):
        if key != "outer.algorithm":
            config = _set(config, key.split("."), value, key)
    return config


def _flatten(tree: dict, prefix: str = "") -> Iterator[tuple[str, Any]]:
    for name, value in tree.items():
        if isinstance(value, dict):
            yield from _flatten(value, f"{prefix}{name}.")
        else:
            yield f"{prefix}{name}", value


def _set(node: Any, parts: list[str], value: Any, key: str, where: str = "") -> Any:
    names = {f.name: f for f in dataclasses.fields(node)}
    if parts[0] not in names:
        if isinstance(node, registry.Settings):
            raise ConfigError(key, registry.unknown(node.algorithm, parts[0]))
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
        return dataclasses.replace(node, **{f.name: _value(value, f.type, key)})
    if not dataclasses.is_dataclass(current):
        raise ConfigError(key, f"unknown config field {key!r} ({where}{f.name} has no fields)")
    value = _set(current, parts[1:], value, key, f"{where}{f.name}.")
    return dataclasses.replace(node, **{f.name: value})


def to_dict(config: Config) -> dict:
    return dataclasses.asdict(config)


def to_json(config: Config) -> str:
    return json.dumps(to_dict(config), indent=2, sort_keys=True)


def from_dict(d: dict) -> Config:
    """The inverse of :func:`to_dict` (e.g. for a saved ``config.json``)."""
    return merge(Config(), d)


# ---------------------------------------------------------------------------------------------
# --help


def _line(key: str, f: dataclasses.Field, default: Any) -> str:
    kind = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
    choices = f.metadata.get("choices")
    if key == "outer.algorithm":
        choices = ("the algorithms listed last",)
    one_of = f" (one of: {', '.join(map(str, choices))})" if choices else ""
    return f"  {key:<26} {kind:<13} {default!r:<12} {f.metadata.get('help', '')}{one_of}"


def _groups(settings: registry.Settings) -> list[tuple[str, list[dataclasses.Field]]]:
    """``settings``' fields by the piece that brings them: the algorithm's own first (its
    name leading), then each shared piece it is made of, with the piece's description."""
    cls, placed, out = type(settings), set(), []
    own = [f for f in dataclasses.fields(cls) if f.name in inspect.get_annotations(cls)]
    own.sort(key=lambda f: f.name != "algorithm")
    for piece, fields in [(cls, own), *((b, dataclasses.fields(b)) for b in cls.__bases__)]:
        fields = [f for f in fields if f.name not in placed]
        if fields:
            title = " ".join((piece.__doc__ or piece.__name__).strip().split("\n\n")[0].split())
            out.append((re.sub(r":\w+:`~?([^`]*)`|``([^`]*)``", r"\1\2", title), fields))
            placed.update(f.name for f in fields)
    return out


def describe(algorithm: str = DEFAULT_ALGORITHM) -> str:
    """Every config field with its type, default and description, by section, for
    ``--help``; under ``outer`` only ``algorithm``'s settings, grouped by the piece that
    declares them (a preset changes some defaults)."""
    config = with_algorithm(Config(), algorithm)
    lines = [
        "config fields, set as section.field=value or in a --config file (YAML or JSON); the",
        "defaults shown are the config classes' (a preset changes some; --print-config shows",
        "the resolved config):",
    ]
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if not dataclasses.is_dataclass(value):
            lines.append(_line(f.name, f, value))
            continue
        if f.name != "outer":
            lines.append(f"\n{f.name}: {type(value).__doc__}")
            lines += [
                _line(f"{f.name}.{g.name}", g, getattr(value, g.name))
                for g in dataclasses.fields(value)
            ]
            continue
        lines.append(
            f"\nouter: {algorithm}'s settings ({registry.REGISTRY[algorithm].summary}); "
            "--help outer.algorithm=NAME shows another algorithm's"
        )
        for title, fields in _groups(value):
            lines.append(f"  # {title}")
            lines += [_line(f"outer.{g.name}", g, getattr(value, g.name)) for g in fields]
    lines.append("\nalgorithms (outer.algorithm=NAME):")
    lines += [f"  {name:<18} {registry.REGISTRY[name].summary}" for name in ALGORITHMS]
    return "\n".join(lines)
