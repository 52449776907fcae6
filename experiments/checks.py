"""Checks of a run config, before anything is built, compiled or written.

:func:`validate` checks every field of an :class:`experiments.config.Config`, once per run:
types, choices, ranges, finite numbers, the outer algorithm's own checks (its settings class:
a setting it does not declare cannot even be set), settings the run would ignore (a field of
another data kind), cross-field rules (the mesh, the batch) and the host memory the data
buffers need. A
refused setting raises :class:`experiments.config.ConfigError`, naming the field as it is
overridden (``outer.topk=0: must be >= 1``). :func:`load` is a preset, its overrides and
validation in one call; :func:`check_paths` checks what a config names on disk.

Example:
  >>> load("cpu-tiny", ["outer.algorithm=co2", "train.rounds=3"]).train.rounds
  3
  >>> load("cpu-tiny", ["outer.algorithm=co2", "outer.clip_threshold=0"])
  Traceback (most recent call last):
  ...
  experiments.config.ConfigError: outer.clip_threshold=0.0: must be > 0 or None
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
from experiments import files
from experiments import model as model_lib
from experiments.config import (
    Config,
    ConfigError,
    DataConfig,
    InnerConfig,
    MeshConfig,
    ModelConfig,
    TrainConfig,
    field_type,
    from_library,
    leaves,
    override,
    preset,
)
from experiments.config_files import file_lines, from_file, where_in


def load(name: str, overrides: Sequence[str] = (), config_file: str | None = None) -> Config:
    """The preset ``name``, the file ``config_file`` on top (YAML or JSON) and ``overrides``
    on top of that, validated (:func:`validate`, without a device count): what the command
    line runs. The one validation of a run. A setting given twice on the command line is
    refused; a refused setting that came from the file names its line there."""
    unique(overrides)
    config = preset(name)
    if config_file is not None:
        config = from_file(config, config_file)
    try:
        return validate(override(config, list(overrides)))
    except ConfigError as e:
        typed = {item.split("=", 1)[0].strip() for item in overrides}
        if config_file is None or e.key in typed:
            raise
        lines = file_lines(config_file)
        if e.key not in lines:
            raise
        raise e.within(where_in(config_file, lines, e.key)) from None


def unique(overrides: Sequence[str]) -> None:
    """Refuses (:class:`ConfigError`) a setting given twice among ``overrides``: which one the
    user meant is not for the driver to guess.

    Example:
      >>> unique(["train.rounds=3", "train.rounds=5"])
      Traceback (most recent call last):
      ...
      experiments.config.ConfigError: train.rounds: set twice ('train.rounds=3', then ...
    """
    seen: dict[str, str] = {}
    for item in overrides:
        key = item.split("=", 1)[0].strip()
        if key in seen:
            raise ConfigError(
                key, f"set twice ({seen[key]!r}, then {item.strip()!r}): give it once"
            )
        seen[key] = item.strip()


def notes(config: Config) -> list[str]:
    """What a valid config runs but its user most likely did not mean, one line each (the
    commands print them as warnings): an inner warm-up longer than the run.

    Example:
      >>> notes(load("micro")), notes(load("micro", ["inner.warmup_steps=5"]))[0][:60]
      ([], 'inner.warmup_steps=5: longer than the run (train.rounds=2 x ')
    """
    t, i, out = config.train, config.inner, []
    total = t.rounds * t.sync_every
    if i.warmup_steps > total:
        out.append(
            f"inner.warmup_steps={i.warmup_steps}: longer than the run (train.rounds={t.rounds}"
            f" x train.sync_every={t.sync_every} = {total} inner steps): the learning rate "
            f"warms up for the whole run and never reaches inner.learning_rate="
            f"{i.learning_rate}"
        )
    return out


def _fail(key: str, value: Any, why: str) -> typing.NoReturn:
    raise ConfigError(key, why, value)


# ---------------------------------------------------------------------------------------------
# validation

_STEPS = 2**31  # optax's and the engine's step counters are int32
_SEEDS = 2**63  # jax.random.key takes an int64


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
    """Every field holds its annotated type (a float field takes an int), floats are finite
    and a string with a fixed set of values holds one of them."""
    if not isinstance(config.outer, registry.Settings):
        why = "must be an algorithm's settings (co2jax.algorithms.registry.settings(name, ...))"
        _fail("outer", type(config.outer).__name__, why)
    for key, f, value in leaves(config):
        hint, optional = field_type(f.type)
        if value is None and optional:
            continue
        ok = isinstance(value, int | float if hint is float else hint)
        if not ok or (hint is not bool and isinstance(value, bool)):
            _fail(key, value, f"expected {hint.__name__}" + (" or none" if optional else ""))
        if hint is float and not math.isfinite(value):
            _fail(key, value, "must be a finite number")
        choices = f.metadata.get("choices")
        if choices is not None and value not in choices:
            _fail(key, value, f"must be one of {choices}")


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


def _check_outer(config: Config, layers: int) -> None:
    """The algorithm's own checks (:meth:`co2jax.algorithms.settings.Settings.validate`:
    every piece it is made of, then its own rules), with what the rest of the run fixes."""
    t, replicas = config.train, config.mesh.replica
    bounds = registry.Bounds(t.sync_every, t.rounds, replicas if replicas >= 1 else None, layers)
    try:
        config.outer.validate(bounds)
    except ValueError as e:
        raise from_library(e) from None


def _check_inner(i: InnerConfig, algorithm: str) -> None:
    if not i.learning_rate > 0:
        _fail("inner.learning_rate", i.learning_rate, "must be > 0")
    if i.weight_decay < 0:
        _fail("inner.weight_decay", i.weight_decay, "must be >= 0")
    _within("inner.b1", i.b1, 0, 1)
    _within("inner.b2", i.b2, 0, 1)
    _at_least("inner.warmup_steps", i.warmup_steps, 0)
    if i.optimizer == "gpa":
        if algorithm != "ddp":  # an outer step would move y and leave GPA's z behind
            _fail(
                "inner.optimizer",
                i.optimizer,
                f"GPA keeps its own iterate z in the inner state, which the outer step of "
                f"outer.algorithm={algorithm!r} does not move: run it with outer.algorithm=ddp",
            )
        if not 0 < i.gpa_mu_y <= 1:
            _fail("inner.gpa_mu_y", i.gpa_mu_y, "must be in (0, 1]")
        _within("inner.gpa_mu_x", i.gpa_mu_x, 0, 1)
    else:
        for f in dataclasses.fields(i):
            if f.name.startswith("gpa_") and getattr(i, f.name) != f.default:
                _fail(f"inner.{f.name}", getattr(i, f.name), "ignored unless inner.optimizer=gpa")


def _check_model(m: ModelConfig) -> int:
    """The model's fields against its preset; returns its resolved ``n_layers``."""
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
    if d.kind in ("text", "tokens") and not d.path:
        _fail("data.path", d.path, f"is required for data.kind={d.kind!r}")
    if d.kind in ("markov", "stdlib") and d.path is not None:
        _fail(
            "data.path", d.path, f"ignored unless data.kind is 'text' or 'tokens' (here {d.kind!r})"
        )
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


def _check_mesh(config: Config) -> None:
    m = config.mesh
    if m.replica < 1:
        _fail("mesh.replica", m.replica, "must be >= 1 (-1 fills only mesh.data or mesh.model)")
    for key, size in (("mesh.data", m.data), ("mesh.model", m.model)):
        if size != -1 and size < 1:
            _fail(key, size, "must be >= 1 or -1 (fill)")
    if m.data == -1 and m.model == -1:
        _fail("mesh.model", m.model, "at most one mesh size may be -1 (mesh.data is -1 too)")
    _check_batch(config, m.data)


def _check_batch(config: Config, data: int) -> None:
    if data > 0 and config.data.batch % data:
        _fail("data.batch", config.data.batch, f"must be a multiple of mesh.data={data}")


MAX_EMULATED_DEVICES = 256
"""The most CPU devices the driver emulates (:func:`emulated_devices`). Measured on the 2-core
CPU machine with the cpu-tiny round (``train.sync_every=2``): ``mesh.replica=128`` (256
devices) ran a round in 26 s; ``mesh.replica=256`` (512) aborted (SIGABRT) after 87 s, its
collectives stalled in XLA's CPU rendezvous, which waits for a thread per device;
``mesh.replica=1000`` (2,000) aborted after about 100 s. ``JAX_NUM_CPU_DEVICES`` set by the
user emulates any count (the driver then leaves it as set)."""


def _mesh_key(m: MeshConfig) -> str:
    """The mesh size a message about the mesh names: the first one set away from its
    default (``mesh.replica`` when none is)."""
    sizes = {"mesh.replica": m.replica, "mesh.data": m.data, "mesh.model": m.model}
    default = dataclasses.asdict(MeshConfig())
    return next((k for k, v in sizes.items() if v != default[k[5:]]), "mesh.replica")


def emulated_devices(config: Config) -> int:
    """The CPU devices the driver emulates for ``config``'s mesh (on a machine without an
    accelerator, where nothing else fixed the count): exactly the mesh's devices, or with a
    size of -1, at least 8 and a multiple of the other sizes. Refuses (:class:`ConfigError`)
    more than :data:`MAX_EMULATED_DEVICES`.

    Example:
      >>> emulated_devices(load("micro", ["mesh.replica=3"])), emulated_devices(load("micro"))
      (6, 8)
    """
    m = config.mesh
    fixed = math.prod(s for s in (m.replica, m.data, m.model) if s != -1)
    count = fixed * max(1, -(-8 // fixed)) if -1 in (m.data, m.model) else fixed
    if count > MAX_EMULATED_DEVICES:
        key = _mesh_key(m)
        shown = " x ".join(
            f"{k}={v}" for k, v in (("mesh.replica", m.replica), ("mesh.data", m.data),
                                    ("mesh.model", m.model))
        )  # fmt: skip
        _fail(
            key,
            getattr(m, key[5:]),
            f"{shown} needs {count} devices: more than the {MAX_EMULATED_DEVICES} CPU devices "
            "the driver emulates (XLA's CPU collectives wait for a thread per device: 512 "
            "aborted here); run fewer replicas, use accelerators, or set JAX_NUM_CPU_DEVICES",
        )
    return count


def check_devices(config: Config, device_count: int, origin: str | None = None) -> Config:
    """Checks that a validated config's mesh fits ``device_count`` devices (a size of -1
    filled with those left, and ``data.batch`` split over the filled ``mesh.data``); returns
    ``config``. Raises :class:`ConfigError` naming the mesh size the user set, and
    ``origin``: where the device count came from, and how to get another."""
    m = config.mesh
    fixed = math.prod(s for s in (m.replica, m.data, m.model) if s != -1)
    fill = -1 in (m.data, m.model)
    if device_count % fixed or (not fill and fixed != device_count):
        sizes = {"mesh.replica": m.replica, "mesh.data": m.data, "mesh.model": m.model}
        key = _mesh_key(m)
        shown = " x ".join(f"{k}={v}" for k, v in sizes.items())
        need = f"a multiple of {fixed}" if fill else str(fixed)
        _fail(
            key,
            sizes[key],
            f"{shown} needs {need} devices; {origin or f'there are {device_count}'}",
        )
    if m.data == -1:
        _check_batch(config, device_count // fixed)
    return config


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
    A run calls it once, where its config is loaded (:func:`load`; a sweep: every row's
    before the first starts); nothing after it validates again.

    Raises :class:`ConfigError` naming the first bad field as it is overridden: a wrong type,
    a non-finite float, a value out of range or not among its choices, the outer algorithm's
    own checks (:meth:`co2jax.algorithms.settings.Settings.validate`: ``outer.tau`` against
    ``H // P``, ``outer.delay`` against ``train.rounds``, ``outer.fragments`` against the
    model's layers, ...), a setting the run would ignore (another data kind's field), a
    cross-field rule (``data.batch`` against ``mesh.data``), or data buffers larger than the
    host's memory (:func:`data_bytes`, :func:`host_memory`). ``device_count``, when given,
    also checks that the mesh fits the devices (:func:`check_devices`).
    """
    _check_types(config)
    _check_train(config.train)
    layers = _check_model(config.model)
    _check_outer(config, layers)
    _check_inner(config.inner, config.outer.algorithm)
    _check_data(config.data)
    _check_run(config)
    _check_mesh(config)
    _check_memory(config)
    if device_count is not None:
        check_devices(config, device_count)
    return config


def _creatable(key: str, value: str, path: str) -> None:
    """``path`` is a directory this process can write in, or can be made one
    (:func:`experiments.files.directory_problem`)."""
    problem = files.directory_problem(path)
    if problem is not None:
        _fail(key, value, problem)


def _data_inputs(d: DataConfig) -> list[str]:
    """What a run reads of ``data.path``: the file or directory, or what its glob matches."""
    if d.kind not in ("text", "tokens"):
        return []
    return [d.path] if os.path.exists(d.path) else sorted(glob.glob(d.path))


def check_paths(config: Config, config_file: str | None = None) -> Config:
    """Checks what ``config`` names on disk, before anything is written; returns ``config``.

    ``data.path`` exists (text: a file, directory or glob; tokens: a file); ``log.dir``, the
    run directory ``log.dir/<name>`` and ``checkpoint.dir`` are directories this process can
    write in, or can be made; and no output is an input: the run's files and checkpoints
    neither are nor lie inside ``data.path`` or the ``--config`` file
    (:func:`experiments.files.check_outputs`: a later run would read them as text, or a
    write would replace the input). Raises :class:`ConfigError`.
    """
    d = config.data
    if d.kind == "text" and not (os.path.exists(d.path) or glob.glob(d.path)):
        _fail("data.path", d.path, "matches no file")
    if d.kind == "tokens" and not os.path.isfile(d.path):
        _fail("data.path", d.path, "is not a file")
    _creatable("log.dir", config.log.dir, config.log.dir)
    run_dir = Path(config.log.dir) / config.name
    _creatable("name", config.name, str(run_dir))
    if config.checkpoint.dir is not None:
        _creatable("checkpoint.dir", config.checkpoint.dir, config.checkpoint.dir)
    inputs = {"data.path": _data_inputs(d), "--config": [config_file] if config_file else []}
    outputs = [("log.dir", config.log.dir, {"its run directory": run_dir})]
    outputs[0][2].update({f"its {n}": run_dir / n for n in ("config.json", "metrics.jsonl")})
    if config.checkpoint.dir is not None and "://" not in config.checkpoint.dir:
        outputs.append(("checkpoint.dir", config.checkpoint.dir, {"": config.checkpoint.dir}))
    for key, value, paths in outputs:
        try:
            files.check_outputs(inputs, paths, key, value)
        except ValueError as e:
            raise ConfigError(key, str(e).split(": ", 1)[1], value) from None
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
