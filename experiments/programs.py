"""What a run builds: the emulated devices, the data streams, the model, the inner and outer
optimizers and the round engine, from a validated :class:`experiments.config.Config`; runs that
differ only in their seed share one set of compiled programs (:func:`shared_programs`).

Example:
  >>> from experiments import checks
  >>> cfg = checks.load("micro", ["outer.algorithm=co2"])
  >>> run = build_validated(cfg)
  >>> type(run.trainer).__name__, run.streams.shape
  ('RoundTrainer', (4, 2, 4, 17))
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from typing import Any, NamedTuple

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import co2jax
from co2jax import compilation_cache
from co2jax.algorithms import registry
from co2jax.axes import DATA
from co2jax.fragments import make_fragments
from experiments import checks, footprint, xla_flags
from experiments import config as config_lib
from experiments import data as data_lib
from experiments import inner as inner_lib
from experiments import model as model_lib

_EMULATED: int | None = None  # the CPU devices setup_devices asked for, if it set the count
_COUNT_FLAG = "--xla_force_host_platform_device_count"


def setup_devices(cfg: config_lib.Config) -> None:
    """On CPU, emulate the devices the mesh needs (:func:`experiments.checks.emulated_devices`:
    refuses more than it emulates), unless the count is fixed already (``JAX_NUM_CPU_DEVICES``,
    ``XLA_FLAGS=--xla_force_host_platform_device_count=N``, or this process); on GPU, ask XLA
    to overlap the outer reduction with the inner steps (:mod:`experiments.xla_flags`). Before
    JAX starts a backend: importing JAX, co2jax and the experiment modules starts none."""
    global _EMULATED
    xla_flags.apply()
    fixed = jax.config.jax_num_cpu_devices >= 1 or _COUNT_FLAG in os.environ.get("XLA_FLAGS", "")
    if (jax.config.jax_platforms or "cpu") == "cpu" and not fixed:
        _EMULATED = checks.emulated_devices(cfg)
        jax.config.update("jax_num_cpu_devices", _EMULATED)


def device_origin() -> str:
    """Where this process's device count came from, and how to get another: for the one
    line that refuses a mesh the devices do not fit."""
    devices = jax.devices()
    n, platform = len(devices), devices[0].platform
    if platform != "cpu":
        return f"this process sees {n} {platform.upper()} devices"
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if f.startswith(_COUNT_FLAG)]
    if flags:
        how = f"fixed by XLA_FLAGS={flags[-1]} (change it, or unset it to let the driver emulate"
        return f"this process has {n} CPU devices, {how} the mesh's)"
    if os.environ.get("JAX_NUM_CPU_DEVICES"):
        how = f"fixed by JAX_NUM_CPU_DEVICES={os.environ['JAX_NUM_CPU_DEVICES']}"
        return f"this process has {n} CPU devices, {how} (change it, or unset it)"
    if _EMULATED == n:
        return (
            f"the driver emulates {n} CPU devices for a mesh with a size of -1 (at least 8, a "
            "multiple of the other sizes): give mesh.data and mesh.model sizes, or set "
            "JAX_NUM_CPU_DEVICES"
        )
    return (
        f"this process has {n} CPU devices, fixed before the driver started (jax_num_cpu_"
        "devices in this process): run it as a new process, or set JAX_NUM_CPU_DEVICES"
    )


class Run(NamedTuple):
    cfg: config_lib.Config
    trainer: Any
    streams: Any
    graphdef: Any
    params: Any
    loss_fn: Any
    eval_fn: Any
    schedule: Any


def _fragmenter(params, count):
    """Streaming DiLoCo's fragments: strided over the transformer blocks, embeddings in
    fragment 0, the rest last."""
    return make_fragments(params, count, layers=r"blocks/(\d+)/", assign={r"^(?!embed)": count - 1})


def context(cfg: config_lib.Config, schedule, params=None, num_replicas=None) -> registry.Context:
    """The one context ``cfg``'s algorithm is built from: H, the rounds, the inner schedule,
    the parameters (or their shapes: the fragments) and, for a driver with no replica axis,
    the replicas."""
    t = cfg.train
    return registry.Context(t.sync_every, params, schedule, num_replicas, _fragmenter, t.rounds)


def build_outer(cfg: config_lib.Config, schedule, params=None, num_replicas=None):
    """The outer algorithm ``cfg.outer`` names (its settings, validated where the config was
    loaded: :mod:`co2jax.algorithms.registry`)."""
    return cfg.outer.outer(context(cfg, schedule, params, num_replicas))


class _Programs(NamedTuple):
    """What a run builds that its seed does not change: the compiled programs live here."""

    trainer: Any
    streams: Any
    model: Any  # the model's config (its parameters come from the seed)
    graphdef: Any
    loss_fn: Any
    eval_fn: Any
    schedule: Any


# None: every build makes its own programs; a dict (inside shared_programs()): the programs of
# the last few configs that differ only in their seed, name or output settings
_SHARED: dict | None = None
_SHARED_KEEP = 2


@contextlib.contextmanager
def shared_programs():
    """Inside it, runs whose configs differ only in ``train.seed``, ``name``, ``log`` and
    ``checkpoint`` (and, with ``outer.lr_in_state`` and a constant outer learning rate, in
    ``outer.learning_rate``: :func:`train` puts it in the state) share one trainer, data
    streams and eval program, so a sweep's seeds and outer learning rates compile and trace
    their round program once (the seed only sets the initial parameters).
    The last two such configs are kept. On the CPU mesh at 140k parameters, M = 8, the
    second seed of a row spent 2 to 3 s retracing and loading its round program
    (docs/experiments.md)."""
    global _SHARED
    outer, _SHARED = _SHARED, ({} if _SHARED is None else _SHARED)
    try:
        yield
    finally:
        _SHARED = outer


def _lr_in_state(o: registry.Settings) -> bool:
    """Whether the outer learning rate is a value in the state, not in the program (a
    constant: a schedule's values are computed in the program)."""
    if not isinstance(o, registry.OuterStep):
        return False
    return o.lr_in_state and o.lr_schedule == "constant" and o.lr_warmup == 0


def _programs_key(cfg: config_lib.Config) -> str:
    outer = cfg.outer
    if _lr_in_state(outer):
        outer = dataclasses.replace(outer, learning_rate=0.0)
    same = dataclasses.replace(
        cfg,
        name="",
        train=dataclasses.replace(cfg.train, seed=0),
        outer=outer,
        log=config_lib.Config().log,
        checkpoint=config_lib.Config().checkpoint,
    )
    return config_lib.to_json(same)


def with_outer_lr(state, cfg: config_lib.Config):
    """``state`` with ``cfg``'s outer learning rate where the state holds it (a trainer
    shared by :func:`shared_programs` was built with another run's)."""
    if not _lr_in_state(cfg.outer):
        return state
    lr = cfg.outer.learning_rate

    def put(path, x):  # optax.inject_hyperparams keeps it in a dict, one per outer transform
        if getattr(path[-1], "key", None) != "learning_rate":
            return x
        return jax.device_put(np.full(x.shape, lr, x.dtype), x.sharding)

    return state._replace(outer_state=jax.tree_util.tree_map_with_path(put, state.outer_state))


def build(cfg: config_lib.Config) -> Run:
    """Everything a run needs; validates ``cfg`` first (:func:`experiments.checks.validate`,
    a :class:`~experiments.config.ConfigError` before anything compiles)."""
    return build_validated(checks.validate(cfg))


def build_validated(cfg: config_lib.Config) -> Run:
    """:func:`build` of a validated config (the mesh is checked against the devices)."""
    setup_devices(cfg)
    checks.check_devices(cfg, jax.device_count(), device_origin())
    # the persistent cache off where it is unsafe (multi-device CPU)
    compilation_cache.guard(jax.devices()[: cfg.mesh.devices], disable=True)
    key = _programs_key(cfg) if _SHARED is not None else None
    p = _SHARED.get(key) if key is not None else None
    if p is None:
        p, params = _build_programs(cfg)
        if key is not None:
            _SHARED[key] = p
            while len(_SHARED) > _SHARED_KEEP:
                del _SHARED[next(iter(_SHARED))]
    else:
        params = model_lib.init_params(p.model, cfg.train.seed)[1]
    return Run(cfg, p.trainer, p.streams, p.graphdef, params, p.loss_fn, p.eval_fn, p.schedule)


def _build_programs(cfg: config_lib.Config) -> tuple[_Programs, Any]:
    """The programs of ``cfg`` and its initial parameters."""
    t = cfg.train
    mesh = co2jax.make_mesh(cfg.mesh.replica, cfg.mesh.data, cfg.mesh.model)
    try:  # one Grain pipeline per (replica, data shard): a data device's rows
        streams = data_lib.make_streams(
            dataclasses.asdict(cfg.data),
            replicas=cfg.mesh.replica,
            steps_per_round=t.sync_every,
            data_shards=mesh.shape[DATA],
        )
    except ValueError as e:  # the data's own checks (a file's size, its sidecar): one line
        raise config_lib.from_library(ValueError(f"data.{e}")) from None
    mcfg = model_config(cfg, streams.vocab_size)
    footprint.check(cfg, mcfg, mesh)  # a round that cannot fit is refused before it compiles
    graphdef, params = model_lib.init_params(mcfg, t.seed)
    trainer, loss_fn, schedule = build_trainer(cfg, mesh, graphdef, params)
    eval_fn = model_lib.make_eval_fn(loss_fn, trainer.mesh)
    eval_batch = jax.device_put(
        streams.eval_batch(cfg.eval.batch), NamedSharding(trainer.mesh, P())
    )
    evaluate = (eval_fn, eval_batch)
    return _Programs(trainer, streams, mcfg, graphdef, loss_fn, evaluate, schedule), params


def model_config(cfg: config_lib.Config, vocab_size: int) -> model_lib.ModelConfig:
    """The transformer of ``cfg`` over a vocabulary of ``vocab_size`` (checked against the
    tensor-parallel axis)."""
    overrides = {
        k: v
        for k, v in dataclasses.asdict(cfg.model).items()
        if k in ("d_model", "n_layers", "n_heads", "d_ff") and v is not None
    }
    mcfg = model_lib.preset(
        cfg.model.preset,
        vocab_size=vocab_size,
        max_seq_len=cfg.data.seq_len,
        dtype=cfg.model.dtype,
        remat=cfg.model.remat,
        **overrides,
    )
    checks.tensor_parallel(cfg.mesh.model, mcfg)
    return mcfg


def build_trainer(cfg: config_lib.Config, mesh, graphdef, params) -> tuple[Any, Any, Any]:
    """``(trainer, loss_fn, schedule)`` of ``cfg`` on ``mesh`` for ``params`` (arrays, or
    ``jax.ShapeDtypeStruct`` leaves: :mod:`experiments.aot` compiles for a TPU topology)."""
    t, i = cfg.train, cfg.inner
    loss_fn = model_lib.make_loss_fn(graphdef)

    schedule = inner_lib.schedule(i, t.rounds * t.sync_every)
    # both sides from one context (DDP averages the inner gradients; DeMo replaces AdamW)
    inner, outer = cfg.outer.optimizers(
        context(cfg, schedule, params), inner_lib.optimizer(i, schedule)
    )
    # Pallas' interpreter is not typed for shard_map's varying-axis check (docs/kernels.md)
    check_vma = cfg.outer.kernel_implementation() != "interpret"
    layout = dict(  # TP: mesh.model
        shard_outer_state=t.shard_outer_state,
        fsdp=t.fsdp,
        offload_outer_state=t.offload_outer_state,
    )
    specs = model_lib.partition_specs(params)
    trainer = co2jax.RoundTrainer(
        loss_fn, inner, outer, mesh, t.sync_every, check_vma=check_vma, param_specs=specs, **layout
    )
    return trainer, loss_fn, schedule
