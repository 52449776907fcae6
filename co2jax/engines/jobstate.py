"""What a job's exchanges carry besides the payload, and what a job's state is on disk.

- **Framing and checks.** Every payload a job sends is framed as ``[header, weight,
  *leaves]``: ``header`` (uint32 ``[3]``) holds a digest of the leaves' shapes and dtypes, the
  sender's rank and the exchange number; ``weight`` (float32 ``[1]``) its weight in the mean
  (its tokens). A received payload is used only if its header matches what this job expects,
  its weight is finite and ``>= 0``, and every floating leaf is finite (:func:`check_frame`);
  otherwise it is dropped from the exchange like a dead peer's, and the reason is reported.
  A pull shaped differently from what the peer offered fails in the transfer service.
- **A fresh replica.** :func:`reset_varying` gives a state's replica-varying fields (marked
  ``REPLICA_VARYING`` on the state types: error-feedback residuals, a delayed algorithm's own
  in-flight pseudo-gradients, low-rank warm starts) their initial values: what a rejoining job
  takes from the state a live peer hands it (the other fields are the same on every replica).
- **Checkpoints.** :func:`save` and :func:`restore` write and read a job's whole state with
  orbax (written to a temporary name and renamed: a crash leaves no half-written one).
- **DyLU.** :func:`dylu_steps`: uneven replicas take ``H_w = max(floor(H * t_fast / t_w),
  min_steps)`` inner steps, so that they all finish a round together.
"""

from __future__ import annotations

import json
import math
import os
import zlib
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from co2jax.axes import collectives_in
from co2jax.engines.recovery import map_fields
from co2jax.mesh import replica_map

HEADER_MASK = 0xFFFFFFFF
NONFINITE = "non-finite: its payload has a NaN or an Inf"


class JobState(NamedTuple):
    """One job's state: ``params`` (its replica's parameters), ``inner_state``,
    ``outer_state`` (the algorithm's, as in the SPMD engine), ``round`` (rounds completed),
    ``exchanges`` (exchanges so far: every job numbers them alike), ``members`` (the ranks
    of the last exchange's set and those admitted after it; ``()``: every replica) and
    ``fresh`` (a rejoined job before its first round: the payloads it sends before any inner
    step, a delayed algorithm's, weigh 0, its own in-flight work having been lost)."""

    params: Any
    inner_state: Any
    outer_state: Any
    round: int
    exchanges: int = 0
    members: tuple = ()
    fresh: bool = False


def structure_digest(leaves: list) -> int:
    """crc32 of the leaves' shapes and dtypes, in order."""
    text = ";".join(f"{tuple(x.shape)}:{jnp.dtype(x.dtype).name}" for x in leaves)
    return zlib.crc32(text.encode())


def frame(leaves: list, rank: int, step: int, weight: float) -> list:
    header = np.asarray([structure_digest(leaves), rank, step & HEADER_MASK], np.uint32)
    return [header, np.asarray([weight], np.float32), *leaves]


@jax.jit
def _all_finite(leaves: list) -> jax.Array:
    ok = [jnp.all(jnp.isfinite(x)) for x in leaves if jnp.issubdtype(x.dtype, jnp.inexact)]
    return jnp.all(jnp.stack(ok)) if ok else jnp.bool_(True)


def check_frame(arrays: list, like: list, peer: int, step: int) -> str | None:
    """Why a framed payload from ``peer`` at exchange ``step`` is unusable, or ``None``."""
    header, weight = np.asarray(arrays[0]), float(np.asarray(arrays[1])[0])
    if int(header[0]) != structure_digest(like[2:]):
        return "malformed: its leaves' shapes or dtypes differ from this job's"
    if int(header[1]) != peer or int(header[2]) != step & HEADER_MASK:
        return (
            f"malformed: its header names replica {int(header[1])}, exchange "
            f"{int(header[2])} (expected {peer}, {step & HEADER_MASK})"
        )
    if math.isnan(weight):  # the sender found its own payload non-finite
        return NONFINITE
    if not (math.isfinite(weight) and weight >= 0):
        return f"malformed: its weight is {weight}"
    if not bool(_all_finite(list(arrays[2:]))):
        return NONFINITE
    return None


def reset_varying(state: Any, fresh: Any) -> Any:
    """``state`` with every field its type declares replica-varying
    (:class:`co2jax.protocol.StateRoles`) taken from ``fresh`` (an ``init`` of the same
    structure), at any depth."""
    return map_fields(state, fresh, lambda roles, name: name in roles.replica_varying, keep_fresh)


def keep_fresh(_: Any, fresh: Any) -> Any:
    return fresh


def save(directory: str, state: Any, metadata: dict) -> None:
    """Writes ``state`` (arrays) and ``metadata`` (JSON) to ``directory`` (which must not
    exist): orbax writes to a temporary name and renames it when complete."""
    import orbax.checkpoint as ocp

    directory = os.path.abspath(directory)
    if os.path.exists(directory):
        raise ValueError(f"directory={directory!r} exists: a checkpoint is never overwritten")
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(os.path.join(directory, "state"), state)
        checkpointer.wait_until_finished()
    with open(os.path.join(directory, "job.json.tmp"), "w") as f:
        json.dump(metadata, f)
    os.replace(os.path.join(directory, "job.json.tmp"), os.path.join(directory, "job.json"))


def restore(directory: str, target: Any) -> tuple[Any, dict]:
    """``(state, metadata)`` from :func:`save`'s ``directory``; ``target`` gives the
    structure, shapes, dtypes and shardings (an abstract or concrete state)."""
    import orbax.checkpoint as ocp

    directory = os.path.abspath(directory)
    meta_path = os.path.join(directory, "job.json")
    if not os.path.exists(meta_path):
        raise ValueError(f"directory={directory!r} holds no complete job checkpoint")
    with open(meta_path) as f:
        metadata = json.load(f)
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, target)
    with ocp.StandardCheckpointer() as checkpointer:
        state = checkpointer.restore(os.path.join(directory, "state"), abstract)
    return state, metadata


def check_options(outer, peers, transfers, H: int, drift_every, dylu, late) -> None:
    """A :class:`co2jax.JobTrainer`'s options checked against its algorithm and peers."""
    if peers.tolerant and outer.replica_local:
        raise ValueError(
            f"quorum={peers.quorum} < R: a job left out of an exchange must continue from "
            "the same anchor as the others, and this outer optimizer keeps replica-local "
            "anchors (outer.replica_local); use quorum=None"
        )
    if isinstance(drift_every, bool) or not isinstance(drift_every, int) or drift_every < 0:
        raise ValueError(f"drift_every must be an integer >= 0, got {drift_every!r}")
    if drift_every and outer.replica_local:
        raise ValueError("drift_every: replica-local anchors differ by design: nothing to compare")
    if dylu and any(t.send not in (0, H) or t.apply != H for t in transfers):
        raise ValueError("dylu=True needs every transfer sent at step 0 or H and applied at H")
    if late not in ("drop", "carry"):
        raise ValueError(f"late must be 'drop' or 'carry', got late={late!r}")
    if late == "carry" and not peers.tolerant:
        raise ValueError("late='carry' needs Peers(quorum=...) below R (nothing is late)")


def check_steps(transfers, H: int, n, weight) -> tuple[int, float]:
    """A job's steps this round (1..H; below H only for a schedule sent at step 0 or H and
    applied at H) and its weight (default: its steps), checked before any compute."""
    if isinstance(n, bool) or not isinstance(n, int | np.integer) or not 1 <= n <= H:
        raise ValueError(f"steps must be an integer in 1..H={H}, got steps={n!r}")
    if n != H and any(t.send not in (0, H) or t.apply != H for t in transfers):
        raise ValueError(
            f"steps={n} < H: this schedule sends or applies during the round; per-round step "
            "counts need every transfer sent at step 0 or H and applied at H"
        )
    weight = float(n) if weight is None else weight
    if not (isinstance(weight, int | float) and math.isfinite(weight) and weight >= 0):
        raise ValueError(f"weight must be a finite number >= 0, got weight={weight!r}")
    return int(n), float(weight)


def dylu_steps(steps: int, step_times, min_steps: int = 5, grid: int = 1) -> list[int]:
    """DyLU's inner steps per replica: ``max(floor(H * t_fast / t_w), min_steps)``, at most
    H, from each replica's measured time per inner step ``t_w`` (``t_fast`` the smallest).
    With ``grid > 1`` the count is rounded to the nearest multiple of ``grid`` instead of
    down (a job's programs are compiled per step count: a few counts, each compiled once,
    and two equally fast jobs are not told apart by timing noise).

    Example:
      >>> dylu_steps(32, [0.1, 0.2, 0.1])
      [32, 16, 32]
      >>> dylu_steps(64, [0.1, 0.105, 0.21], grid=8)
      [64, 64, 32]
    """
    times = np.asarray(step_times, np.float64)
    if times.ndim != 1 or not np.all(np.isfinite(times)) or np.any(times <= 0):
        raise ValueError(f"step_times must be positive seconds, got {times.tolist()}")
    fast = float(times.min())
    out = []
    for t in times:
        raw = steps * fast / t
        n = math.floor(raw + 1e-9) if grid == 1 else grid * round(raw / grid)
        out.append(int(min(steps, max(n, min_steps))))
    return out


def check_inner_is_local(inner, params, mesh, axis: str) -> None:
    """Raises ``ValueError`` when ``inner``'s update communicates over ``axis`` (DDP's
    gradient mean, DeMo's every-step exchange): separate jobs have no such axis between
    them, so each job would train alone and nothing would say so. Traced on ``mesh`` (the
    job's, its replica axis of size 1), nothing run."""
    shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct((1, *np.shape(x)), x.dtype), params)
    state = jax.eval_shape(jax.vmap(inner.init), shapes)
    step = replica_map(lambda g, s, p: inner.update(g, s, p)[0], mesh)
    if collectives_in(jax.make_jaxpr(step)(shapes, state, shapes).jaxpr, axis):
        raise ValueError(
            f"the inner transform communicates over {axis!r} every step (data-parallel "
            "gradients, DeMo): separate jobs exchange only at the outer schedule's transfers, "
            "so each job would train alone; run it with co2jax.RoundTrainer"
        )
