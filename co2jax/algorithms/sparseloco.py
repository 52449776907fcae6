"""SparseLoCo (Sarfi et al. 2025, arXiv 2508.15706): error feedback instead of outer momentum."""

from __future__ import annotations

import dataclasses
from typing import Any

from co2jax._checks import check_choice, check_int, check_positive, check_unit_interval
from co2jax.algorithms.diloco import diloco
from co2jax.algorithms.error_feedback import error_feedback
from co2jax.algorithms.fused import outer_sgd
from co2jax.algorithms.registry import register
from co2jax.algorithms.settings import Guard, LearningRate, Settings, fail, setting
from co2jax.axes import REPLICA
from co2jax.comm import all_gather_topk, two_bit
from co2jax.comm.sparse_quant import AVERAGES, all_gather_topk_quantized
from co2jax.protocol import OuterOptimizer

MODES = ("ternary", "production")
_DEFAULT_K = {"ternary": 32, "production": 64}


def sparseloco(
    learning_rate: float = 1.0,
    decay: float = 0.95,
    k: int | None = None,
    chunk: int = 4096,
    *,
    quantize: bool = True,
    mode: str = "ternary",
    average: str = "contributors",
    tile: tuple[int, int] | None = None,
    clip: bool = True,
    axis_name: str = REPLICA,
) -> OuterOptimizer:
    """SparseLoCo: top-k of an error-feedback accumulator, 2-bit values, sparse all-gather.

    Per replica r and round t, with the pseudo-gradient ``Delta_r`` of DiLoCo:

    .. math::

        e_r &\\leftarrow \\beta e_r + \\Delta_r \\\\
        \\hat\\Delta_r &= Q_{2bit}(\\mathrm{TopK}_{chunk}(e_r)), \\qquad
        e_r \\leftarrow e_r - \\hat\\Delta_r \\\\
        \\theta^{(t+1)} &= \\theta^{(t)} - \\alpha \\operatorname{mean}_{r \\ni i}
            \\hat\\Delta_{r,i}

    where the mean at index i is over the replicas that selected i (an all-gather of the k
    (index, value) pairs per chunk; no all-reduce, no outer momentum), or over all R with
    ``average="replicas"``. Each replica sends its encoding as error feedback made it, so the
    selected indices travel with the values: a selected value that 2-bit quantization rounds
    to zero still counts as selected.

    ``mode="ternary"`` (the default): chunks of ``chunk`` consecutive elements of the
    flattened payload, values by :func:`co2jax.comm.two_bit` (ternary, one scale per chunk's
    k values), top 32 per 4096 (0.8% density); whether this is the paper's exact quantizer is
    unverified.

    ``mode="production"``: the quantizer of the authors' released code,
    :func:`co2jax.comm.all_gather_topk_quantized`: per tensor, the top ``k`` (64) of every
    ``tile`` (64x64; ``chunk`` elements for a leaf of one axis), 2-bit codes over four
    asymmetric bins fitted to all of the tensor's kept values, 12-bit indices (0.219 bits per
    parameter of a large matrix), and each replica's tensor clipped to the median of the
    replicas' norms before the mean (``clip``). The defaults of both modes (alpha 1.0, beta
    0.95) are the released code's; H (30 there, 15 in the predecessor) belongs to the
    training loop. The released code also scales the accumulator's input by the outer
    learning rate (``e <- beta e + alpha Delta``): the same at alpha = 1.

    Args:
      learning_rate: alpha (> 0).
      decay: beta, the accumulator's decay, in [0, 1].
      k: values kept per chunk (default 32 ternary, 64 production).
      chunk: elements per chunk (ternary: <= 65536; production: the largest chunk of a leaf
        of one axis, <= 4096).
      quantize: 2-bit values (else float32 values; ternary only).
      mode: ``"ternary"`` or ``"production"``.
      average: ``"contributors"`` or ``"replicas"``.
      tile: production: the largest ``(h, w)`` tile of a leaf of two or more axes (default
        ``(64, 64)``).
      clip: production: the median-norm clip.
      axis_name: the replica axis.

    Example:
      >>> import jax, jax.numpy as jnp, co2jax
      >>> outer = co2jax.sparseloco(k=1, chunk=2, quantize=False)
      >>> state = jax.vmap(outer.init)(jnp.zeros((2, 2)))
      >>> params, state = jax.jit(jax.vmap(outer.sync, axis_name="replica"))(
      ...     jnp.array([[1.0, 0.1], [0.2, -3.0]]), state)
      >>> params  # each index averaged over the one replica that sent it
      Array([[ 1., -3.],
             [ 1., -3.]], dtype=float32)
      >>> outer = co2jax.sparseloco(mode="production", k=2, chunk=4)
      >>> state = jax.vmap(outer.init)({"w": jnp.zeros((1, 4))})  # one replica
      >>> params, state = jax.jit(jax.vmap(outer.sync, axis_name="replica"))(
      ...     {"w": jnp.array([[-4.0, 0.5, 1.0, 2.0]])}, state)
      >>> params["w"][0], state.residuals[0]["w"][0]  # Delta's 4 and -2 share a bin
      (Array([-1.,  0.,  0., -1.], dtype=float32), Array([ 3. , -0.5, -1. , -3. ], dtype=float32))

    References:
      Sarfi et al., "SparseLoCo: Communication-Efficient LLM Training", arXiv 2508.15706;
      Covenant-72B, arXiv 2603.08163 (the production quantizer).
    """
    check_choice("mode", mode, MODES)
    check_positive("learning_rate", learning_rate)
    decay = check_unit_interval("decay", decay, closed_right=True)
    check_choice("average", average, AVERAGES)
    k = _DEFAULT_K[mode] if k is None else k
    if mode == "production":
        reduce = _production(k, chunk, quantize, tile, clip, average, axis_name)
    else:
        for name, value, default in (("tile", tile, None), ("clip", clip, True)):
            if value is not default:
                raise ValueError(
                    f"{name} applies to mode='production', got {name}={value!r} with mode='ternary'"
                )
        values = two_bit(block=k) if quantize and check_int("k", k, 1) % 4 == 0 else None
        if quantize and values is None:
            raise ValueError(
                f"2-bit values pack 4 per byte: k must be a multiple of 4, got k={k!r}"
            )
        reduce = all_gather_topk(k, chunk, values, average, axis_name)
    inner = diloco(outer_sgd(learning_rate), axis_name=axis_name, reduce=reduce)
    return error_feedback(inner, decay)


def _production(k, chunk, quantize, tile: Any, clip, average, axis_name):
    if quantize is not True:
        raise ValueError(
            f"mode='production' always quantizes its values, got quantize={quantize!r}"
        )
    tile = (64, 64) if tile is None else tile
    return all_gather_topk_quantized(
        k, tile, chunk, average=average, clip=clip, axis_name=axis_name
    )


@register("top-k error feedback, 2-bit values, sparse all-gather")
@dataclasses.dataclass(frozen=True)
class SparseLoCoSettings(Settings, LearningRate, Guard):
    """SparseLoCo's settings (arXiv 2508.15706; the released quantizer, 2603.08163)."""

    algorithm: str = setting("sparseloco", "the algorithm")
    decay: float = setting(0.95, "the error-feedback decay, in [0, 1]")
    topk: int = setting(32, "values kept per chunk (ternary: a multiple of 4)")
    chunk: int = setting(4096, "the chunk size (production: of a 1-D tensor)")
    quantizer: str = setting("ternary", "ternary, or the released 4-bin quantizer", MODES)
    average: str = setting("contributors", "the production mean over contributors or 1/R", AVERAGES)

    def check(self, bounds) -> None:
        if not 0 <= self.decay <= 1:
            fail("decay", self.decay, "must be in [0, 1]")
        if self.quantizer == "ternary":
            _within("chunk", self.chunk, 1, 65536)  # uint16 indices
            _within("topk", self.topk, 1, self.chunk)
            if self.topk % 4:
                fail("topk", self.topk, "must be a multiple of 4 (2-bit values, 4 a byte)")
        else:
            _within("chunk", self.chunk, 1, 4096)  # 12-bit indices
            _within("topk", self.topk, 2, min(self.chunk, 4096))
            if self.topk % 2:
                fail("topk", self.topk, "must be even in the production quantizer")

    def build(self, context, reduce) -> OuterOptimizer:
        return sparseloco(
            self.learning_rate, self.decay, self.topk, self.chunk, mode=self.quantizer,
            average=self.average,
        )  # fmt: skip


def _within(name: str, value: int, lo: int, hi: int) -> None:
    if not lo <= value <= hi:
        fail(name, value, f"must be in [{lo}, {hi}]")
