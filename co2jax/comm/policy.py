"""Where a reducer is chosen: the one policy, per backend, replica count and payload size.

An algorithm carries the reduction it needs (:class:`~co2jax.comm.Reducer`). Two choices are
made on top of it, both here:

- :func:`select` (by the round engine): an *exact* mean may be swapped for another exact mean
  that the target compiler overlaps with the inner loop (:func:`auto_kind`), and for an outer
  update that averages gathered payloads itself, for the all-gather in its layout. A
  compressed or otherwise specific reduction is never swapped.
- :func:`for_fused_update` (by the pseudo-gradient method, at trace time): an int8 (block
  128) compressed all-gather is sent in the fused kernel's layout where that kernel runs, so
  that it dequantizes, averages and steps in one pass.
"""

from __future__ import annotations

from typing import Any

from co2jax._checks import check_choice
from co2jax.axes import bound_axis_size
from co2jax.comm.means import EXACT, exact_mean
from co2jax.comm.reducer import Encoded, Payload, Reducer, all_gather_stacked
from co2jax.kernels.api import resolve

CHOICES = ("auto", "outer", *EXACT)
MIN_CHUNK_BYTES = 2**20
"""The smallest chunk the auto policy cuts a payload into: below it a collective's fixed cost
is not worth spreading."""
ALL_GATHER_LIMIT = 256 * 2**20
"""Largest ``R * payload`` (float32 bytes) the auto policy all-gathers on TPU."""


def auto_kind(platform: str, replicas: int, overlapped: bool, payload_elements: int = 0) -> str:
    """The exact mean a round uses: one the target compiler overlaps with the inner loop.

    A reduction that cannot overlap anything (sent and applied at the same step) uses the
    all-reduce. An overlapped one uses, on TPU, the all-gather (one asynchronous collective
    around the loop) while R <= 4 and the R gathered float32 copies of the payload stay under
    :data:`ALL_GATHER_LIMIT`, else the ppermute ring (two chunk buffers; its last step
    overlaps). The limit is measured: for a 1B-parameter model on a v5e slice the all-gather
    round needed 26 GiB of temporaries (unsharded; HBM is 16 GiB) and 400 s to compile
    (sharded), the all-reduce round 3 GiB and 11 s (``benchmarks/README.md``). Elsewhere the
    all-reduce (asynchronous by default on GPU; XLA:CPU runs every collective synchronously).
    See ``docs/overlap.md``.
    """
    if not overlapped or platform != "tpu":
        return "pmean"
    gathered = replicas * payload_elements * 4  # the all-gather reducer sums in float32
    if replicas <= 4 and gathered <= ALL_GATHER_LIMIT:
        return "all_gather"
    return "ring"


def spreads(platform: str) -> bool:
    """Whether ``auto`` spreads a round's overlapped transfers over its inner steps.

    On TPU: an all-gather issued before the inner loop runs asynchronously around it only
    while the loop body holds no nested loop (a scan over layers), so on real models the
    whole payload's reduction is synchronous after the loop; an all-gather of one chunk issued
    inside a step is asynchronous under that step's compute, nested loops included
    (``docs/overlap.md``). Elsewhere the payload goes whole (XLA:CPU runs every collective
    synchronously; GPU is not measured yet).
    """
    return platform == "tpu"


def chunk_count(span: int, payload_bytes: int, minimum: int = MIN_CHUNK_BYTES) -> int:
    """Chunks for a transfer spanning ``span`` steps: one per step, as long as each stays at
    least ``minimum`` bytes (a chunk's collective has a fixed cost)."""
    return max(1, min(span, payload_bytes // max(1, minimum)))


def chunk_shards(devices_per_replica: int) -> int:
    """The devices of one replica that split each chunk of a spread transfer: all of them.

    A replica's payload is replicated over its own devices (its ``data`` and ``model``
    axes). Left whole, every one of them sends the whole chunk over the replica axis: D
    copies of the payload on the slow link (compiled for two v5e 2x4 slices, each of the 8
    chips of a slice sent the whole chunk over DCN). Split, each sends 1/D and the replica
    sends the payload once; the reduced slices are gathered inside the replica over its fast
    links when the payload is applied (``docs/overlap.md``). A payload sent in one piece is
    split only where the outer state it comes from is split over ``data`` already
    (:func:`co2jax.engines.program.splits_whole`); from a whole outer state, compiled for
    TPU, the split spread into the inner loop (the parameters came to be split over ``data``
    and gathered at every step).
    """
    return max(1, int(devices_per_replica))


def chunk_kind(
    platform: str, replicas: int = 2, steps: int = 0, shared_slices: bool = False
) -> str:
    """The exact mean for a transfer spread over ``steps`` inner steps (a chunk per step):
    elsewhere than TPU the all-reduce; on TPU the one of fewer bytes, each in flight under
    its step's compute.

    The staged mean (:mod:`co2jax.comm.staged`: a reduce-scatter by R - 1 permutes, then an
    all-gather at the next step) sends ``steps / (steps - 1)`` of a ring all-reduce's bytes,
    the all-gather ``R / 2`` of them: the all-gather at R = 2 (the ring's bytes exactly) and
    wherever the staged mean would send more. Measured ahead of time (delayed DiLoCo, 32
    steps, v5e 4x4 and 8 slices of v5e 2x4, ``benchmarks/overlap_at_scale.py``): both 100%
    in flight at R = 2-16; staged 1.04x the ring at every R, the all-gather 2x, 4x, 8x at
    R = 4, 8, 16; the same temporaries; compile 1.0-3.5x the plain round's against 1.0-2.4x.

    ``shared_slices``: several replicas share each of several TPU slices. XLA:TPU compiles
    the part of a replica-axis all-gather inside a slice synchronous (62% of the staged
    mean's bytes in flight, 25M, R = 8 on 4 v5e 2x4 slices); the staged mean then gathers
    by permutes too (``staged_permutes``: 100%, the same bytes).

    Example:
      >>> chunk_kind("tpu", 2, 32), chunk_kind("tpu", 8, 32), chunk_kind("tpu", 3, 3)
      ('all_gather', 'staged', 'all_gather')
      >>> chunk_kind("tpu", 8, 32, shared_slices=True), chunk_kind("cpu", 8, 32)
      ('staged_permutes', 'pmean')
    """
    if platform != "tpu":
        return "pmean"
    staged_is_fewer = steps >= 2 and 2 * steps < replicas * (steps - 1)
    if not staged_is_fewer:
        return "all_gather"
    return "staged_permutes" if shared_slices else "staged"


def compiler_options(platform: str, reducers: tuple[Reducer, ...], replicas: int) -> dict:
    """XLA options a round's compile needs for its reducers to stay in flight: on TPU, a
    staged mean's R - 1 permutes of one step in flight together (XLA:TPU kept 5 asynchronous
    collective-permutes across the step's compute by default: at R = 8, of each step's
    seven, one waited and one hid behind small fusions only, 93% of the bytes in flight;
    all seven across it with the limit raised; 25M, v5e 4x4 ahead of time).
    Other platforms and reducers need none (an unknown option is an error on CPU).

    Example:
      >>> from co2jax.comm import exact_mean
      >>> compiler_options("tpu", (exact_mean("staged"),), 16)
      {'xla_max_concurrent_async_collective_permutes': 16}
      >>> compiler_options("tpu", (exact_mean("staged_permutes"),), 16)  # gathers by permutes too
      {'xla_max_concurrent_async_collective_permutes': 32}
      >>> compiler_options("cpu", (exact_mean("staged"),), 16)
      {}
    """
    if platform != "tpu" or not any(r.stages is not None for r in reducers):
        return {}
    per_step = max(r.stages.permutes * replicas for r in reducers if r.stages)
    return {"xla_max_concurrent_async_collective_permutes": max(PERMUTES_IN_FLIGHT, per_step)}


PERMUTES_IN_FLIGHT = 8
"""The fewest asynchronous collective-permutes a round with a staged reducer lets XLA:TPU keep
in flight (:func:`compiler_options`): R - 1 of its own, and room for one more."""


def check_choice_for(choice: str, reducer: Reducer) -> str:
    """``choice`` (one of ``CHOICES``) if it may replace ``reducer``: only an exact mean may
    be replaced by another one."""
    check_choice("reducer", choice, CHOICES)
    if choice in EXACT and not reducer.exact:
        raise ValueError(
            f"reducer={choice!r} would replace the algorithm's {reducer.name} reduction by an "
            "exact mean; use reducer='auto' or 'outer' to keep it"
        )
    return choice


def select(
    reducer: Reducer,
    choice: str,
    *,
    platform: str,
    replicas: int,
    payload_elements: int,
    overlapped: bool,
    whole: bool,
    accepts_gathered: bool,
    axis_name: str,
    steps: int = 1,
    shared_slices: bool = False,
) -> tuple[str, Reducer]:
    """The reducer a round uses for one transfer, and its label (``"outer"`` when the
    algorithm's own is kept).

    Args:
      reducer: the algorithm's.
      choice: ``"auto"``, ``"outer"`` or an exact kind (``EXACT``).
      platform: the mesh's platform.
      replicas: R.
      payload_elements: elements of the transfer's payload.
      overlapped: the transfer is sent before the step it is applied at.
      whole: the transfer goes in one piece (not chunked): a gathered payload can only be
        handed over whole.
      accepts_gathered: the algorithm's ``apply`` takes gathered payloads.
      axis_name: the replica axis.
      steps: the steps a transfer in chunks is spread over (its chunk count).
      shared_slices: several replicas share each of several TPU slices (:func:`chunk_kind`).
    """
    check_choice_for(choice, reducer)
    if choice == "outer" or not reducer.exact:
        return "outer", reducer
    kind = choice
    if choice == "auto":
        kind = (
            auto_kind(platform, replicas, overlapped, payload_elements)
            if whole
            else chunk_kind(platform, replicas, steps, shared_slices)
        )
    if kind == "all_gather" and accepts_gathered and whole:
        # the R payloads go to the outer update un-reduced: a fused update averages them in
        # its own pass (co2jax.kernels)
        return kind, all_gather_stacked(axis_name)
    return kind, exact_mean(kind, axis_name)


def for_fused_update(reducer: Reducer, implementation: str, axis_name: str) -> Reducer:
    """``reducer``, or where the fused outer update runs as a kernel and ``reducer`` is an
    int8 (block 128) compressed all-gather, the same format in the kernel's layout
    (:func:`~co2jax.comm.all_gather_stacked` with ``quantize="int8"``) for a whole plain
    payload.

    The choice is made when traced, from the bound replica axis and the target backend (an
    unbound axis, as in a separate job, keeps ``reducer``). What is encoded before the
    reduction (error feedback's payload) is in ``reducer``'s own form, which a chunked round
    can cut, and is reduced by ``reducer``; so is a payload cut into chunks or split over a
    replica's devices (the result's ``unfused``): the kernel's layout is of a whole payload.
    """
    codec = reducer.codec
    if codec is None or codec.name != "int8" or codec.block != 128 or reducer.encode is None:
        return reducer
    stacked = all_gather_stacked(axis_name, quantize="int8", implementation=implementation)

    def pick(replicas: int | None) -> Reducer:
        if replicas is None or resolve(implementation, replicas) == "xla":
            return reducer
        return stacked

    def reduce(payload: Payload) -> Any:
        if isinstance(payload, Encoded):
            return reducer.reduce(payload)
        return pick(bound_axis_size(axis_name)).reduce(payload)

    def wire(shapes, replicas: int) -> float:
        return pick(replicas).wire_bytes(shapes, replicas)

    return reducer._replace(
        splittable=False,
        name=reducer.name + "/fused",
        reduce=reduce,
        wire_bytes=wire,
        unfused=reducer,
    )
