"""The compiled-program reader (co2jax.hlo) on hand-written HLO: device numbering on several
slices, cross-slice (megascale) transfers, and the bytes each collective sends."""

from __future__ import annotations

import types

import numpy as np
import pytest

from co2jax import hlo


def _mesh(shape, slice_of):
    """A stand-in mesh: ``shape`` over (replica, data, model), device i in ``slice_of(i)``."""
    ids = np.arange(int(np.prod(shape))).reshape(shape)
    devices = np.vectorize(
        lambda i: types.SimpleNamespace(id=int(i), slice_index=slice_of(int(i))), otypes=[object]
    )(ids)
    return types.SimpleNamespace(devices=devices, axis_names=("replica", "data", "model"))


# 2 slices of 4 chips; replica=2 (one per slice) or replica=4 (two per slice), data fills
ONE_PER_SLICE = _mesh((2, 4, 1), lambda i: i // 4)
TWO_PER_SLICE = _mesh((4, 2, 1), lambda i: i // 4)
ONE_SLICE = _mesh((2, 4, 1), lambda i: 0)


def test_groups_are_numbered_inside_each_slice():
    assert hlo.axis_groups(ONE_SLICE, "replica") == {(0, 4), (1, 5), (2, 6), (3, 7)}
    assert hlo.axis_groups(ONE_PER_SLICE, "data") == {(0, 1, 2, 3)}  # each slice's own ids
    assert hlo.axis_groups(ONE_PER_SLICE, "replica") == frozenset()  # all of it crosses DCN
    assert hlo.axis_groups(TWO_PER_SLICE, "replica") == {(0, 2), (1, 3)}
    assert hlo.crosses_slices(TWO_PER_SLICE, "replica")
    assert not hlo.crosses_slices(TWO_PER_SLICE, "data")
    assert not hlo.crosses_slices(ONE_SLICE, "replica")


def _program(body_between: str, in_slice: str = "", dtype: str = "bf16") -> str:
    """A loop body that sends a [1, 768, 1024] piece (of ``dtype``) to the other slice around
    ``body_between``; the ENTRY runs the body's loop 4 times."""
    attrs = (
        'frontend_attributes={_xla_host_transfer_handler_name="xla_megascale_runtime",'
        '_xla_host_transfer_rendezvous="all-gather.6_0",_xla_megascale_target="{1,2}x{0:3}",'
        '_xla_megascale_transfer_type="ALL_GATHER"}'
    )
    return "\n".join(
        [
            "%fused_dot (p0: bf16[8,8], p1: bf16[8,8]) -> bf16[8,8] {",
            "  %dot.1 = bf16[8,8]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}",
            "}",
            "",
            "%body (param: (s32[], bf16[1,768,1024])) -> (s32[], bf16[1,768,1024]) {",
            "  %after-all.2 = token[] after-all()",
            f"  %send.2 = ({dtype}[1,768,1024]{{2,1,0}}, u32[], token[])"
            f" send(%piece, %after-all.2), channel_id=2, is_host_transfer=true, {attrs}",
            f"  %recv.2 = ({dtype}[2,768,1024]{{2,1,0}}, u32[], token[]) recv(%after-all.2),"
            f" channel_id=1, is_host_transfer=true, {attrs}",
            body_between,
            in_slice,
            "  %send-done.2 = token[] send-done(%send.2), channel_id=2, is_host_transfer=true",
            "  %recv-done.2 = (bf16[2,768,1024]{2,1,0}, token[]) recv-done(%recv.2), channel_id=1",
            "}",
            "",
            "%cond (param.1: (s32[], bf16[1,768,1024])) -> pred[] {",
            "  %constant.4 = s32[] constant(4)",
            "  %compare.1 = pred[] compare(%gte, %constant.4), direction=LT",
            "}",
            "",
            "ENTRY %main (p: bf16[1,768,1024]) -> bf16[1,768,1024] {",
            "  %while.1 = (s32[], bf16[1,768,1024]) while(%t), condition=%cond, body=%body",
            "}",
        ]
    )


COMPUTE = "  %fusion.3 = bf16[8,8]{1,0} fusion(%a, %b), kind=kOutput, calls=%fused_dot"


def test_a_cross_slice_send_is_a_dcn_transfer_in_flight_under_compute():
    [f] = hlo.flights(_program(COMPUTE), ONE_PER_SLICE, "replica")
    piece = 768 * 1024 * 2
    assert (f.op, f.link, f.count, f.hidden) == ("all-gather", "dcn", 4, True)
    assert f.bytes == 2 * piece and f.sent == piece  # 2 slices: the piece goes to the other
    assert hlo.hidden_fraction(_program(COMPUTE), ONE_PER_SLICE, "replica") == 1.0


def test_a_packed_payload_of_32_bit_words_is_read_by_its_data_not_its_u32_counter():
    """An encoding packed as uint32 words (co2jax.comm.all_gather_tree): the send's first
    element is the data, its u32[] beside it a counter."""
    [f] = hlo.flights(_program(COMPUTE, dtype="u32"), ONE_PER_SLICE, "replica")
    assert f.sent == 768 * 1024 * 4 and f.bytes == 2 * f.sent


def test_a_cross_slice_send_without_compute_before_its_done_is_synchronous():
    assert not hlo.flights(_program(""), ONE_PER_SLICE, "replica")[0].hidden
    assert hlo.hidden_fraction(_program(""), ONE_PER_SLICE, "replica") == 0.0


def test_no_dcn_transfer_is_read_on_an_axis_inside_the_slices():
    assert hlo.flights(_program(COMPUTE), ONE_PER_SLICE, "data") == []


def test_hybrid_replicas_in_slice_part_is_counted_beside_the_cross_slice_part():
    """Two replicas per slice: the in-slice all-gather (groups in the slice's numbering)
    is read next to the send; synchronous here, it holds 2/3 of the bytes."""
    gather = (
        "  %all-gather.15 = bf16[2,1536,1024]{2,1,0} all-gather(%c), channel_id=3,"
        " replica_groups={{0,2},{1,3}}, dimensions={1}, use_global_device_ids=true"
    )
    found = hlo.flights(_program(COMPUTE, gather), TWO_PER_SLICE, "replica")
    # the in-slice gather sits after the compute, before the send's done: nothing between
    # its own (synchronous) issue and completion
    by_link = {f.link: f for f in found}
    assert by_link["dcn"].hidden and not by_link["ici"].hidden
    assert by_link["ici"].sent == by_link["ici"].bytes // 2
    assert hlo.hidden_fraction(_program(COMPUTE, gather), TWO_PER_SLICE, "replica") == (
        pytest.approx(1 / 3)
    )


@pytest.mark.parametrize(
    "line, sent",
    [
        ("%a = f32[100]{0} all-reduce(%x), replica_groups={{0,1,2,3}}, to_apply=%add", 600),
        ("%a = f32[100]{0} all-gather(%x), replica_groups={{0,1,2,3}}, dimensions={0}", 300),
        ("%a = f32[25]{0} reduce-scatter(%x), replica_groups={{0,1,2,3}}, dimensions={0}", 300),
        ("%a = f32[100]{0} collective-permute(%x), source_target_pairs={{0,1},{1,0}}", 400),
        # XLA:TPU's asynchronous permute: (operand, result, two u32 contexts), as compiled
        (
            "%p = (bf16[1572864]{0:T(1024)(128)(2,1)}, bf16[1572864]{0:T(1024)(128)(2,1)}, "
            "u32[]{:S(2)}, u32[]{:S(2)}) collective-permute-start(%f), channel_id=1, "
            "source_target_pairs={{0,6},{2,0},{4,2},{6,4},{1,7},{3,1},{5,3},{7,5}}",
            2 * 1572864,
        ),
        (
            "%g = (f32[8]{0}, f32[32]{0}) all-gather-start(%y), replica_groups={{0,1,2,3}}, "
            "dimensions={0}",
            96,
        ),
    ],
)
def test_bytes_one_device_sends(line, sent):
    [c] = hlo.collectives("  " + line)
    assert hlo.sent_bytes(c) == sent


def test_a_permute_between_slices_counts_only_its_pairs_sources():
    """A collective-permute that XLA splits between slices (a ONE_TO_ONE megascale send,
    its pairs listed; here 8 of 16 chips send, as compiled for R = 4 on 2 v5e 2x4 slices):
    each of the 16 chips is counted for 8/16 of the piece, not the whole of it."""
    # chips 4-7 of each slice send to chips 0-3 of the other
    pairs = ",".join(f"{{10000{j}->20000{7 - j}}},{{20000{j}->10000{7 - j}}}" for j in (7, 6, 5, 4))
    line = (
        "%send.12 = (bf16[74,1024]{1,0:T(8,128)(2,1)}, u32[], token[]) send(%f, %a),"
        " channel_id=2, is_host_transfer=true, frontend_attributes={_xla_host_transfer_"
        'handler_name="xla_megascale_runtime",_xla_host_transfer_rendezvous="ppermute.36_0",'
        f'_xla_megascale_target={{{pairs}}},_xla_megascale_transfer_type="ONE_TO_ONE"}}'
    )
    piece = 74 * 1024 * 2
    received = {"ppermute.36_0": piece}  # the recv's buffer, by rendezvous
    assert hlo._megascale(line, received, slices=2, devices=16) == (piece, piece // 2)
