"""SparseLoCo (Sarfi et al. 2025, arXiv 2508.15706): error feedback instead of outer momentum."""

from __future__ import annotations

from co2jax._checks import check_positive, check_unit_interval
from co2jax.algorithms.diloco import diloco
from co2jax.algorithms.error_feedback import error_feedback
from co2jax.algorithms.fused import outer_sgd
from co2jax.axes import REPLICA
from co2jax.comm import all_gather_topk, two_bit
from co2jax.protocol import OuterOptimizer


def sparseloco(
    learning_rate: float = 1.0,
    decay: float = 0.95,
    k: int = 32,
    chunk: int = 4096,
    *,
    quantize: bool = True,
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
    (index, value) pairs per chunk; no all-reduce, no outer momentum). Each replica sends its
    encoding as error feedback made it, so the selected indices travel with the values: a
    selected value that 2-bit quantization rounds to zero still counts as selected. Defaults of
    the predecessor code (docs/algorithms/sparseloco.md): alpha 1.0, beta 0.95, chunks of
    64x64 = 4096 with the top 32 (0.8% density); H (15 there) belongs to the training loop.
    The 2-bit format is :func:`co2jax.comm.two_bit` (ternary, one scale per chunk's k
    values); whether it is the paper's exact 2-bit quantizer is unverified.

    Args:
      learning_rate: alpha (> 0).
      decay: beta, the accumulator's decay, in [0, 1].
      k: values kept per chunk.
      chunk: elements per chunk (<= 65536, indices are uint16).
      quantize: 2-bit values (else float32 values).
      axis_name: the replica axis.

    Example:
      >>> import jax, jax.numpy as jnp, co2jax
      >>> outer = co2jax.sparseloco(k=1, chunk=2, quantize=False)
      >>> state = jax.vmap(outer.init)(jnp.zeros((2, 2)))
      >>> params, state = jax.vmap(outer.sync, axis_name="replica")(
      ...     jnp.array([[1.0, 0.1], [0.2, -3.0]]), state)
      >>> params  # each index averaged over the one replica that sent it
      Array([[ 1., -3.],
             [ 1., -3.]], dtype=float32)
    """
    check_positive("learning_rate", learning_rate)
    decay = check_unit_interval("decay", decay, closed_right=True)
    values = two_bit(block=k) if quantize and k % 4 == 0 else None
    if quantize and values is None:
        raise ValueError(f"2-bit values pack 4 per byte: k must be a multiple of 4, got k={k!r}")
    reduce = all_gather_topk(k, chunk, values, "contributors", axis_name)
    inner = diloco(outer_sgd(learning_rate), axis_name=axis_name, reduce=reduce)
    return error_feedback(inner, decay)
