"""Checks of a run config, before anything is built, compiled or written.

:func:`validate` checks every field of an :class:`experiments.config.Config`: types, ranges,
finite numbers, settings the run would ignore (a field of another algorithm or data kind),
cross-field rules (delays, fragments, the mesh) and the host memory the data buffers need. A
refused setting raises :class:`experiments.config.ConfigError`, naming the field as it is
overridden (``outer.topk=0: must be >= 1``). :func:`load` is a preset, its overrides and
validation in one call; :func:`check_paths` checks what a config names on disk.

Example:
  >>> load("cpu-tiny", ["outer.algorithm=co2", "train.rounds=3"]).train.rounds
  3
  >>> load("cpu-tiny", ["outer.algorithm=co2", "outer.delay=2"])
  Traceback (most recent call last):
  ...
  experiments.config.ConfigError: outer.delay=2: ignored unless outer.algorithm is ...
"""

from __future__ import annotations

import dataclasses
import glob
import math
import os
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from co2jax.algorithms import registry
from co2jax.algorithms.registry import OuterConfig
from experiments import model as model_lib
from experiments.config import (
    CHOICES,
    DATA_KINDS,
    MODEL_DTYPES,
    SCHEDULES,
    TOKEN_DTYPES,
    Config,
    ConfigError,
    DataConfig,
    InnerConfig,
    MeshConfig,
    ModelConfig,
    TrainConfig,
    _hint,
    _leaves,
    override,
    preset,
)


def load(name: str, overrides: Sequence[str] = ()) -> Config:
    """The preset ``name`` with ``overrides`` applied, validated (:func:`validate`, without a
    device count): what the command line runs."""
    return validate(override(preset(name), list(overrides)))


def _fail(key: str, value: Any, why: str) -> typing.NoReturn:
    raise ConfigError(key, why, value)


def _from_library(error: ValueError) -> ConfigError:
    """The registry's ``outer.name=value: why`` ValueError as a ConfigError, message kept."""
    message = str(error).replace("\n", " ")
    head, _, why = message.partition(": ")
    out = ConfigError(head.split("=", 1)[0], why or message)
    out.args = (message,)
    return out


# ---------------------------------------------------------------------------------------------
# validation

_STEPS = 2**31  # optax's and the engine's step counters are int32
_SEEDS = 2**63  # jax.random.key takes an int64
_DELAYED = ("delayed_diloco", "eager_diloco", "diloco_x")


def _at_least(key: str, value: int, lo: int, note: str = "") -> None:
    if value < lo:
        _fail(key, value, f"must be >= {lo}{note}")


def _within(key: str, value: float, lo: float, hi: float, *, closed: bool = False) -> None:
    """``lo <= value < hi``, or ``<= hi`` if ``closed``."""
    if not (lo <= value <= hi if closed else lo <= value < hi):
        _fail(key, value, f"must be in [{lo}, {hi}{']' if closed else ')'}")


def _seed(key: str, value: int) -> None:
    if not 0 <= value < _SEEDS:
        _fail(key, value, "must be in [0, 2**63)")


def _check_types(config: Config) -> None:
    """Every field holds its annotated type (a float field takes an int) and floats are
    finite."""
    for key, f, value in _leaves(config):
        hint, optional = _hint(f.type)
        if value is None and optional:
            continue
        ok = isinstance(value, int | float if hint is float else hint)
        if not ok or (hint is not bool and isinstance(value, bool)):
            _fail(key, value, f"expected {hint.__name__}" + (" or none" if optional else ""))
        if hint is float and not math.isfinite(value):
            _fail(key, value, "must be a finite number")


def _check_train(t: TrainConfig) -> None:
    _at_least("train.sync_every", t.sync_every, 1, " (H, the inner steps of a round)")
    _at_least("train.max_skipped", t.max_skipped, 1, " (skipped rounds in a row that stop a run)")
    _at_least("train.rounds", t.rounds, 1)
    _seed("train.seed", t.seed)
    if t.rounds * t.sync_every >= _STEPS:
        big = "train.rounds" if t.rounds >= t.sync_every else "train.sync_every"
        _fail(
            big,
            getattr(t, big.split(".")[1]),
            f"train.rounds x train.sync_every = {t.rounds * t.sync_every} inner steps must be "
            "< 2**31 (the step counters are int32)",
        )


def reads(o: OuterConfig) -> dict[str, tuple[bool, str, str]]:
    """The outer fields only some settings read: ``(read here, when, what is set here)``."""

    def only(*names: str) -> tuple[bool, str, str]:
        when = "outer.algorithm is " + " or ".join(map(repr, names))
        return o.algorithm in names, when, repr(o.algorithm)

    co2, here = o.algorithm == "co2", f"{o.algorithm!r}, {o.penalty!r}"
    with_penalty = "outer.algorithm is 'co2' and outer.penalty is "
    return {
        "delay": only(*_DELAYED),
        "penalty": only("co2"),
        "mode": only("co2"),
        "penalty_lambda": (co2 and o.penalty == "constant", with_penalty + "'constant'", here),
        "gap_decay": (co2 and o.penalty == "gap_aware", with_penalty + "'gap_aware'", here),
        "clip_threshold": (
            co2 and o.mode == "paper",
            "outer.algorithm is 'co2' and outer.mode is 'paper'",
            f"{o.algorithm!r}, {o.mode!r}",
        ),
        "fragments": only("streaming_diloco", "cocodc"),
        "tau": only("streaming_diloco", "cocodc"),
        "alpha": only("streaming_diloco", "cocodc"),
        "correction": only("cocodc"),
        "hessian_scale": only("cocodc"),
        "decay": only("sparseloco", "dct_diloco"),
        "topk": only("sparseloco", "dct_diloco", "demo"),
        "chunk": only("sparseloco"),
        "quantizer": only("sparseloco"),
        "average": only("sparseloco"),
        "dct_chunk": only("dct_diloco", "demo"),
        "group_size": only("noloco"),
        "rank": only("diloco_x"),
        "factors": only("diloco_x"),
        "beta2": (o.optimizer == "adam", "outer.optimizer is 'adam'", repr(o.optimizer)),
        "collective": (o.compression != "none", "outer.compression is set", repr(o.compression)),
    }


def _check_outer(config: Config, layers: int) -> None:
    """The registry's checks (named ``outer.*``), then what only this module knows: settings the
    algorithm would ignore, the library factories' ranges, the rounds and the model."""
    o, t = config.outer, config.train
    try:
        registry.validate(o, t.sync_every)
    except ValueError as e:
        raise _from_library(e) from None
    default = OuterConfig()
    for name, (read, when, here) in reads(o).items():
        value = getattr(o, name)
        if not read and value != getattr(default, name):
            _fail(f"outer.{name}", value, f"ignored unless {when} (here {here})")
    if o.algorithm == "co2":
        if not o.penalty_lambda > 0:
            _fail("outer.penalty_lambda", o.penalty_lambda, "must be > 0")
        _within("outer.gap_decay", o.gap_decay, 0, 1)
        if o.mode == "reference_code" and o.penalty == "gap_aware":
            _fail(
                "outer.penalty", o.penalty, "outer.mode='reference_code' takes 'none' or 'constant'"
            )
    if o.algorithm == "sparseloco" and o.quantizer == "ternary":
        _within("outer.chunk", o.chunk, 1, 65536, closed=True)  # uint16 indices
        _within("outer.topk", o.topk, 1, o.chunk, closed=True)
        if o.topk % 4:
            _fail("outer.topk", o.topk, "must be a multiple of 4 (2-bit values, 4 a byte)")
    if o.algorithm == "sparseloco" and o.quantizer == "production":
        _within("outer.chunk", o.chunk, 1, 4096, closed=True)  # 12-bit indices
        _within("outer.topk", o.topk, 2, min(o.chunk, 4096), closed=True)
        if o.topk % 2:
            _fail("outer.topk", o.topk, "must be even in the production quantizer")
    if o.lr_schedule != "constant" and o.lr_warmup >= t.rounds:
        _fail(
            "outer.lr_warmup",
            o.lr_warmup,
            f"must be < train.rounds={t.rounds} (the outer learning rate decays until then)",
        )
    if o.algorithm == "noloco" and config.mesh.replica % o.group_size:
        _fail(
            "outer.group_size",
            o.group_size,
            f"must divide mesh.replica={config.mesh.replica} (replicas are dealt into groups)",
        )
    if o.algorithm in _DELAYED and o.delay >= t.rounds:
        _fail(
            "outer.delay",
            o.delay,
            f"must be < train.rounds={t.rounds} (a round's average is applied outer.delay "
            "rounds later: none would arrive)",
        )
    if o.algorithm in ("streaming_diloco", "cocodc") and o.fragments > layers:
        _fail(
            "outer.fragments",
            o.fragments,
            f"must be <= model.n_layers={layers} (a fragment is whole transformer blocks)",
        )


def _check_inner(i: InnerConfig) -> None:
    if not i.learning_rate > 0:
        _fail("inner.learning_rate", i.learning_rate, "must be > 0")
    if i.weight_decay < 0:
        _fail("inner.weight_decay", i.weight_decay, "must be >= 0")
    _within("inner.b1", i.b1, 0, 1)
    _within("inner.b2", i.b2, 0, 1)
    _at_least("inner.warmup_steps", i.warmup_steps, 0)
    if i.schedule not in SCHEDULES:
        _fail("inner.schedule", i.schedule, f"must be one of {SCHEDULES}")


def _check_model(m: ModelConfig) -> int:
    """The model's fields against its preset; returns its resolved ``n_layers``."""
    if m.preset not in model_lib.PRESETS:
        _fail("model.preset", m.preset, f"must be one of {CHOICES['model.preset']}")
    if m.dtype not in MODEL_DTYPES:
        _fail("model.dtype", m.dtype, f"must be one of {MODEL_DTYPES}")
    base, dims = model_lib.PRESETS[m.preset], {}
    for name in ("d_model", "n_layers", "n_heads", "d_ff"):
        value = getattr(m, name)
        if value is not None and value < 1:
            _fail(f"model.{name}", value, "must be >= 1, or none for the preset's")
        dims[name] = getattr(base, name) if value is None else value
    d, h = dims["d_model"], dims["n_heads"]
    key, value = ("model.d_model", d) if m.n_heads is None else ("model.n_heads", h)
    if d % h:
        _fail(key, value, f"model.d_model={d} must be a multiple of model.n_heads={h}")
    if d // h % 2:
        _fail(key, value, f"model.d_model / model.n_heads = {d // h} must be even (rotary)")
    return dims["n_layers"]


def _check_data(d: DataConfig) -> None:
    if d.kind not in DATA_KINDS:
        _fail("data.kind", d.kind, f"must be one of {DATA_KINDS}")
    if d.kind in ("text", "tokens") and not d.path:
        _fail("data.path", d.path, f"is required for data.kind={d.kind!r}")
    if d.kind in ("markov", "stdlib") and d.path is not None:
        _fail(
            "data.path", d.path, f"ignored unless data.kind is 'text' or 'tokens' (here {d.kind!r})"
        )
    if d.token_dtype not in TOKEN_DTYPES:
        _fail("data.token_dtype", d.token_dtype, f"must be one of {TOKEN_DTYPES}")
    if d.kind != "tokens" and d.token_dtype != DataConfig.token_dtype:
        _fail(
            "data.token_dtype",
            d.token_dtype,
            f"ignored unless data.kind is 'tokens' (here {d.kind!r})",
        )
    text = d.kind in ("text", "stdlib")
    _at_least("data.vocab_size", d.vocab_size, 256 if text else 2, " (bytes)" if text else "")
    if d.kind == "markov":
        _at_least("data.branching", d.branching, 2)
        if d.branching > d.vocab_size:
            _fail("data.branching", d.branching, f"must be <= data.vocab_size={d.vocab_size}")
    _at_least("data.max_bytes", d.max_bytes, 1)
    _at_least("data.batch", d.batch, 1)
    _at_least("data.seq_len", d.seq_len, 1)
    _seed("data.seed", d.seed)


def _check_run(config: Config) -> None:
    """Evaluation, checkpoints, the log directory and the run's name."""
    e, c, name = config.eval, config.checkpoint, config.name
    _at_least("eval.every", e.every, 0, " (rounds; 0: after the last round only)")
    _at_least("eval.batch", e.batch, 1)
    _at_least("checkpoint.every", c.every, 1, " (rounds)")
    _at_least("checkpoint.keep", c.keep, 1)
    if c.dir is not None and not c.dir.strip():
        _fail("checkpoint.dir", c.dir, "must be a directory, or none for no checkpoints")
    if not config.log.dir.strip():
        _fail("log.dir", config.log.dir, "must be a directory")
    if name in ("", ".", "..") or any(s in name for s in ("/", "\\", "\0")):
        _fail("name", name, "must be a plain directory name (the run writes to log.dir/<name>)")


def _check_mesh(config: Config, device_count: int | None) -> None:
    m, batch = config.mesh, config.data.batch
    if m.replica < 1:
        _fail("mesh.replica", m.replica, "must be >= 1 (-1 fills only mesh.data or mesh.model)")
    for key, size in (("mesh.data", m.data), ("mesh.model", m.model)):
        if size != -1 and size < 1:
            _fail(key, size, "must be >= 1 or -1 (fill)")
    if m.data == -1 and m.model == -1:
        _fail("mesh.model", m.model, "at most one mesh size may be -1 (mesh.data is -1 too)")
    data = m.data
    if device_count is not None:
        fixed = math.prod(s for s in (m.replica, m.data, m.model) if s != -1)
        fill = -1 in (m.data, m.model)
        if device_count % fixed or (not fill and fixed != device_count):
            sizes = {"mesh.replica": m.replica, "mesh.data": m.data, "mesh.model": m.model}
            default = dataclasses.asdict(MeshConfig())
            key = next((k for k, v in sizes.items() if v != default[k[5:]]), "mesh.replica")
            shown = " x ".join(f"{k}={v}" for k, v in sizes.items())
            _fail(key, sizes[key], f"{shown} does not fit {device_count} devices")
        if data == -1:
            data = device_count // fixed
    if data > 0 and batch % data:
        _fail("data.batch", batch, f"must be a multiple of mesh.data={data}")


def data_bytes(config: Config) -> int:
    """Host bytes the data pipeline holds at once (an estimate, :mod:`experiments.data`): a
    round's int32 windows ``[R, H, B, L + 1]``, one replica's draw in progress (its int32
    windows, float64 uniforms and int32 samples: 16 bytes a token) and the eval batch with its
    draw (20 bytes a token)."""
    d = config.data
    window = d.seq_len + 1
    replica = config.train.sync_every * d.batch * window
    return 4 * config.mesh.replica * replica + 16 * replica + 20 * config.eval.batch * window


def host_memory() -> int:
    """Bytes of memory on this host: physical memory, or the cgroup's limit when lower
    (64 GiB when neither can be read)."""
    sizes = []
    try:
        sizes.append(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (AttributeError, OSError, ValueError):
        pass
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            sizes.append(int(Path(path).read_text().split()[0]))
        except (OSError, ValueError, IndexError):  # absent, or "max"
            pass
    sizes = [s for s in sizes if s > 0]
    return min(sizes) if sizes else 64 << 30


def _check_memory(config: Config) -> None:
    need, have = data_bytes(config), host_memory()
    if need <= have:
        return
    d, t, m, e = config.data, config.train, config.mesh, config.eval
    sizes = {
        "mesh.replica": m.replica,
        "train.sync_every": t.sync_every,
        "data.batch": d.batch,
        "data.seq_len": d.seq_len,
        "eval.batch": e.batch,
    }
    key = max(sizes, key=sizes.__getitem__)
    _fail(
        key,
        sizes[key],
        f"the data buffers need {need / 2**30:,.1f} GiB, more than the host's "
        f"{have / 2**30:,.1f} GiB (mesh.replica={m.replica} x train.sync_every={t.sync_every} "
        f"x data.batch={d.batch} x (data.seq_len={d.seq_len} + 1) int32 tokens a round, "
        f"eval.batch={e.batch} windows)",
    )


def validate(config: Config, device_count: int | None = None) -> Config:
    """Checks every setting before anything is built, compiled or written; returns ``config``.

    Raises :class:`ConfigError` naming the first bad field as it is overridden: a wrong type,
    a non-finite float, a value out of range, a setting the run would ignore (another
    algorithm's or data kind's field), a cross-field rule (``outer.tau`` against ``H // P``,
    ``outer.delay`` against ``train.rounds``, ``outer.fragments`` against the model's layers,
    ``data.batch`` against ``mesh.data``), or data buffers larger than the host's memory
    (:func:`data_bytes`, :func:`host_memory`). ``device_count``, when given, also checks that
    the mesh fits the devices. A sweep calls it for every run before the first one starts.
    """
    _check_types(config)
    _check_train(config.train)
    layers = _check_model(config.model)
    _check_outer(config, layers)
    _check_inner(config.inner)
    _check_data(config.data)
    _check_run(config)
    _check_mesh(config, device_count)
    _check_memory(config)
    return config


def _creatable(key: str, value: str, path: str) -> None:
    """``path`` is a directory, or can be made one: its nearest existing ancestor is a
    writable directory (a URL such as ``gs://...`` is left to orbax)."""
    if "://" in path:
        return
    p = Path(path).absolute()
    if p.exists():
        if not p.is_dir():
            _fail(key, value, f"{p} is a file, not a directory")
        return
    parent = next(a for a in p.parents if a.exists())
    if not parent.is_dir():
        _fail(key, value, f"{parent} is a file, not a directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        _fail(key, value, f"{parent} is not writable")


def check_paths(config: Config) -> Config:
    """Checks what ``config`` names on disk, before anything is written; returns ``config``.

    ``data.path`` exists (text: a file, directory or glob; tokens: a file), and ``log.dir``,
    the run directory ``log.dir/<name>`` and ``checkpoint.dir`` are directories or can be
    made. Raises :class:`ConfigError`.
    """
    d = config.data
    if d.kind == "text" and not (os.path.exists(d.path) or glob.glob(d.path)):
        _fail("data.path", d.path, "matches no file")
    if d.kind == "tokens" and not os.path.isfile(d.path):
        _fail("data.path", d.path, "is not a file")
    _creatable("log.dir", config.log.dir, config.log.dir)
    _creatable("name", config.name, os.path.join(config.log.dir, config.name))
    if config.checkpoint.dir is not None:
        _creatable("checkpoint.dir", config.checkpoint.dir, config.checkpoint.dir)
    return config


def tensor_parallel(model_axis: int, model) -> None:
    """Raises :class:`~experiments.config.ConfigError` on ``mesh.model`` unless it divides
    what tensor parallelism splits (the resolved model config's heads, MLP width and
    vocabulary: ``experiments.model.LOGICAL_RULES``)."""
    split = {"n_heads": model.n_heads, "d_ff": model.d_ff, "vocab_size": model.vocab_size}
    uneven = {k: v for k, v in split.items() if model_axis > 1 and v % model_axis}
    if uneven:
        listed = ", ".join(f"{k}={v}" for k, v in uneven.items())
        _fail("mesh.model", model_axis, f"must divide what tensor parallelism splits: {listed}")
