"""What the fused outer update computes (static) and how it is tiled (per backend).

:class:`OuterUpdateSpec` is the math, one frozen (hashable, so usable as a static argument)
record per algorithm; :class:`BlockSizes` is the tiling of the Pallas kernel, with
:func:`default_block_sizes` per backend.
"""

from __future__ import annotations

import dataclasses
import math

LANES = 128  # every bucket is (rows, 128): the TPU lane width, a multiple of any GPU warp
PENALTIES = ("none", "constant", "gap_aware")


@dataclasses.dataclass(frozen=True)
class OuterUpdateSpec:
    """One outer step on (possibly gathered) pseudo-gradients, element-wise.

    Per element, in float32, with payloads ``p_1..p_R`` (gathered) or ``p_1`` (reduced)::

        g      = (1/R) sum_r p_r                               # the replicas' mean
        delta  = anchor - params                               # delayed: the new pending
        g      = g + (delta - old_pending) / eager_replicas    # eager only
        lam    = 1 | penalty_scale | 1 / (1 + gap / C_hat)     # none | constant | gap_aware
        g      = lam * g
        m'     = clip(momentum * m + g, -clip, clip)           # heavy-ball trace
        u      = g + momentum * m'  if nesterov  else  m'
        anchor = anchor - learning_rate * u

    with ``gap = |anchor - (anchor + learning_rate * m)|`` (the last update, CO2's derived
    previous anchor), ``C_hat = C / gap_correction`` and ``C' = gap_decay * C + (1 - gap_decay) *
    gap``. When the dynamic ``apply`` flag is 0 (a delayed method before its first average)
    the anchor, momentum and gap average keep their values and only ``delta`` is written.

    Attributes:
      learning_rate: the outer learning rate (alpha, eta).
      momentum: the trace decay (beta, mu); ``None`` for plain SGD (no momentum buffer).
      nesterov: use the Nesterov update ``g + momentum * m'`` (optax's ``nesterov=True``).
      clip: element-wise clamp of the momentum after the update, or ``None``.
      penalty: ``"none"``, ``"constant"`` (multiply by ``penalty_scale``) or ``"gap_aware"``.
      penalty_scale: the constant multiplier (``1 / lam`` of the released CO2 code).
      gap_decay, gap_eps: the gap-aware average's decay and its "no history" threshold.
      delayed: compute and return ``delta = anchor - params`` (the next pending payload).
      eager_replicas: R of the eager correction, or 0 for none (needs ``delayed``).
    """

    learning_rate: float
    momentum: float | None = None
    nesterov: bool = False
    clip: float | None = None
    penalty: str = "none"
    penalty_scale: float = 1.0
    gap_decay: float = 0.9
    gap_eps: float = 1e-12
    delayed: bool = False
    eager_replicas: int = 0

    def __post_init__(self):
        for name in ("learning_rate", "penalty_scale", "gap_eps"):
            value = getattr(self, name)
            if not math.isfinite(value) or value <= 0:
                raise ValueError(f"{name} must be a finite number > 0, got {name}={value!r}")
        if self.momentum is not None and not 0 <= self.momentum < 1:
            raise ValueError(f"momentum must be in [0, 1) or None, got momentum={self.momentum!r}")
        if self.nesterov and self.momentum is None:
            raise ValueError("nesterov=True needs a momentum, got momentum=None")
        if self.clip is not None and not self.clip > 0:
            raise ValueError(f"clip must be > 0 or None, got clip={self.clip!r}")
        if self.clip is not None and self.momentum is None:
            raise ValueError("clip clamps the momentum buffer: it needs momentum, got None")
        if self.penalty not in PENALTIES:
            raise ValueError(f"penalty must be one of {PENALTIES}, got penalty={self.penalty!r}")
        if self.penalty == "gap_aware" and self.momentum is None:
            raise ValueError("penalty='gap_aware' measures the last update from the momentum")
        if not 0 <= self.gap_decay < 1:
            raise ValueError(f"gap_decay must be in [0, 1), got gap_decay={self.gap_decay!r}")
        if self.eager_replicas < 0 or (self.eager_replicas and not self.delayed):
            raise ValueError(
                "eager_replicas must be 0, or >= 1 together with delayed=True, got "
                f"eager_replicas={self.eager_replicas!r}, delayed={self.delayed!r}"
            )


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Tiling of the fused kernel.

    Attributes:
      block_rows: rows of 128 lanes per grid step. A multiple of 32 keeps every dtype's TPU
        tile whole ((8, 128) float32, (16, 128) bfloat16, (32, 128) 8-bit); a power of two is
        required by the Triton lowering.
      num_warps: Triton warps per program (GPU only).
    """

    block_rows: int = 512
    num_warps: int = 4

    def __post_init__(self):
        rows = self.block_rows
        if not isinstance(rows, int) or rows < 8 or rows & (rows - 1):
            raise ValueError(f"block_rows must be a power of two >= 8, got block_rows={rows!r}")
        if not isinstance(self.num_warps, int) or self.num_warps < 1:
            raise ValueError(f"num_warps must be an integer >= 1, got {self.num_warps!r}")

    @property
    def block_elements(self) -> int:
        return self.block_rows * LANES


def default_block_sizes(backend: str) -> BlockSizes:
    """Per-backend defaults.

    - ``tpu``: 512 rows (256 KiB per float32 buffer): with R = 8 payloads and four state
      buffers, double-buffered, about 12 MiB of VMEM, inside the scoped default of v5e/v6e.
    - ``gpu``: 16 rows (2048 elements per program, 16 per thread at 4 warps): an element-wise
      kernel is bound by memory and wants many programs in flight.
    - anything else (CPU, interpret mode): 512 rows, few grid steps (interpret mode pays per
      step).
    """
    if backend == "gpu" or backend in ("cuda", "rocm"):
        return BlockSizes(block_rows=16, num_warps=4)
    return BlockSizes(block_rows=512)
