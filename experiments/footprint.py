"""A lower bound of the memory a run's round holds on each device, checked before it compiles.

A config whose round cannot fit is refused in one line (:func:`check`) instead of compiling
for a minute and then failing to allocate (``data.seq_len=100000`` on the CPU mesh asked XLA
for 2.6 TB after 30 s of compiling). The bound counts only what every implementation of the
transformer's step must hold at once on a device, so a config it refuses cannot run; what it
leaves out (activations saved for the backward pass besides the attention probabilities, the
outer state, temporaries, fragmentation) makes the real footprint larger, never smaller:

- the parameters, their gradients and AdamW's two moments, float32 (16 bytes a parameter),
  split over ``mesh.model`` and, with ``train.fsdp``, over ``mesh.data``;
- one layer's attention scores, float32, ``b x h x L^2``, ``b = data.batch / mesh.data``
  sequences, ``h = n_heads / mesh.model`` (the model takes their softmax over whole rows);
  without ``model.remat``, the other layers' probabilities too (the compute dtype), kept for
  the backward pass;
- the logits, float32, ``b x L x V / mesh.model``;
- evaluation, forward only: one layer's scores of ``eval.batch / mesh.data`` sequences (the
  larger of the step's and the evaluation's).

The memory it is held against: on CPU the host's (:func:`experiments.checks.host_memory`),
shared by every emulated device; on an accelerator the first device's ``bytes_limit``.

Example:
  >>> from experiments import checks, config as config_lib, model as model_lib
  >>> cfg = checks.load("cpu-tiny", ["data.seq_len=100000"])
  >>> mcfg = model_lib.preset("tiny", vocab_size=128, max_seq_len=100000, n_layers=2,
  ...                         d_model=64, n_heads=4, d_ff=256)
  >>> parts = lower_bound(cfg, mcfg, data=2, model=1)
  >>> round(sum(parts.values()) / 2**30)  # GiB on each device
  5366
"""

from __future__ import annotations

import math

from experiments import checks
from experiments import config as config_lib
from experiments import model as model_lib


def lower_bound(cfg: config_lib.Config, mcfg, data: int, model: int) -> dict[str, int]:
    """Bytes each device must hold at once in a round of ``cfg`` (its transformer ``mcfg``,
    the replica's ``data`` and ``model`` mesh sizes), by part (module docstring)."""
    item = 2 if mcfg.dtype in ("bfloat16", "float16") else 4
    seq, heads = cfg.data.seq_len, -(-mcfg.n_heads // model)
    shard = model * (data if cfg.train.fsdp else 1)
    params = model_lib.param_count(mcfg)
    step_rows = max(1, cfg.data.batch // data)
    eval_rows = max(1, -(-cfg.eval.batch // data))
    scores = lambda rows: rows * heads * seq * seq
    parts = {
        "parameters, gradients and AdamW moments": 16 * params // shard,
        "attention scores": scores(max(step_rows, eval_rows)) * 4,
        "logits": max(step_rows, eval_rows) * seq * -(-mcfg.vocab_size // model) * 4,
    }
    if not mcfg.remat and mcfg.n_layers > 1:
        parts["attention kept for the backward pass"] = (
            (mcfg.n_layers - 1) * scores(step_rows) * item
        )
    return parts


def available(devices) -> tuple[int, str]:
    """``(bytes, where)``: what one device's round may use, and its description."""
    first = devices[0]
    if first.platform == "cpu":
        host = checks.host_memory()
        return host // len(
            devices
        ), f"this host's {host / 2**30:,.1f} GiB over {len(devices)} CPU devices"
    stats = first.memory_stats() or {}
    limit = stats.get("bytes_limit")
    if not limit:
        return math.inf, ""
    return int(limit), f"a {first.platform.upper()} device's {limit / 2**30:,.1f} GiB"


def check(cfg: config_lib.Config, mcfg, mesh) -> None:
    """Refuses (:class:`~experiments.config.ConfigError`, one line) a config whose round's
    lower bound (:func:`lower_bound`) exceeds what each device has (:func:`available`)."""
    parts = lower_bound(cfg, mcfg, mesh.shape["data"], mesh.shape["model"])
    need = sum(parts.values())
    have, where = available(mesh.devices.flat)
    if need <= have:
        return
    largest = max(parts, key=parts.__getitem__)
    key, value = ("model.preset", cfg.model.preset)
    if largest != "parameters, gradients and AdamW moments":
        key, value = ("data.seq_len", cfg.data.seq_len)
    shown = ", ".join(f"{name} {size / 2**30:,.1f}" for name, size in parts.items())
    raise config_lib.ConfigError(
        key,
        f"a round needs at least {need / 2**30:,.1f} GiB on each device ({shown} GiB), more "
        f"than {where}",
        value,
    )
