"""The sweep's rows: what each one runs (:data:`SWEEP`, the presets' fixes) and the numbers
a finished run gives its row (the link's cost model, the modelled wall clock, tokens/s, the
curves, the divergence flag).

The cost model, :class:`Link` and :func:`simulated_round_s`, is documented and imported as
``experiments.compare.Link`` / ``experiments.compare.simulated_round_s`` (``compare``
re-exports both): a ring all-reduce of N bytes over R replicas costs
``2 (R-1)/R * N * 8 / bandwidth + 2 (R-1) * latency``, and each algorithm's own schedule is
priced (:func:`co2jax.engines.walk.round_seconds`): a transfer applied when it is sent waits
for it; one sent earlier hides it behind the compute in between, up to that compute, and
slows that compute by ``overlap_slowdown``.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from co2jax.algorithms import registry
from co2jax.engines.walk import round_seconds, walk
from co2jax.protocol import Transfer, resolve

# (label, overrides): every run sees the same tokens (same rounds, H, batch, seq_len, seed)
SWEEP = [
    ("DDP", ["outer.algorithm=ddp"]),
    ("Local SGD", ["outer.algorithm=local_sgd"]),
    ("DiLoCo", ["outer.algorithm=diloco"]),
    ("Delayed DiLoCo (naive)", ["outer.algorithm=delayed_diloco"]),
    ("Eager DiLoCo", ["outer.algorithm=eager_diloco"]),
    # the paper's ablation: a naive delay with a lower outer learning rate (and eager alike)
    (
        "Delayed DiLoCo (outer lr 0.35)",
        ["outer.algorithm=delayed_diloco", "outer.learning_rate=0.35"],
    ),
    ("Eager DiLoCo (outer lr 0.35)", ["outer.algorithm=eager_diloco", "outer.learning_rate=0.35"]),
    ("CO2", ["outer.algorithm=co2", "outer.learning_rate=1.0", "outer.momentum=0.0"]),
    (
        "CO2 + penalty + clip",
        [
            "outer.algorithm=co2",
            "outer.learning_rate=1.0",
            "outer.momentum=0.2",
            "outer.penalty=gap_aware",
            "outer.clip_threshold=0.02",
        ],
    ),
    # fragments, compressed pseudo-gradients, sparse error feedback. Streaming DiLoCo uses
    # DiLoCo's outer optimizer and alpha = 0 (the paper's alpha 0.5 with outer lr 0.4 was
    # 0.02 worse here); FP4 goes through the two-step collective (2 (R-1)/R encoded
    # payloads per replica). SparseLoCo: lr 1, top 32 of 4096, 2-bit values
    # (docs/algorithms/sparseloco.md).
    ("DiLoCo int8", ["outer.algorithm=diloco", "outer.compression=int8"]),
    ("Streaming DiLoCo", ["outer.algorithm=streaming_diloco", "outer.alpha=0.0"]),
    (
        "Streaming DiLoCo FP4",
        [
            "outer.algorithm=streaming_diloco",
            "outer.alpha=0.0",
            "outer.compression=fp4",
            "outer.collective=two_step",
        ],
    ),
    ("SparseLoCo", ["outer.algorithm=sparseloco", "outer.learning_rate=1.0"]),
    (
        "SparseLoCo production",
        ["outer.algorithm=sparseloco", "outer.quantizer=production", "outer.topk=64"],
    ),
    # gossip in pairs, the released code's outer momentum (docs/algorithms/noloco.md)
    ("NoLoCo", ["outer.algorithm=noloco", "outer.momentum=0.5"]),
    # replica-local anchors sharing the top 32 DCT coefficients of their momentum; DeMo's
    # momentum 0.999 at the inner learning rate (docs/algorithms/dct_diloco.md, demo.md)
    ("DCT-momentum DiLoCo", ["outer.algorithm=dct_diloco"]),
    ("DeMo", ["outer.algorithm=demo", "outer.momentum=0.999"]),
    ("CoCoDC (reconstruction)", ["outer.algorithm=cocodc", "outer.alpha=0.0"]),
    # one round of delay, rank-32 int4 factors of each matrix (docs/algorithms/diloco_x.md);
    # a one-round delay at DiLoCo's 0.7 / 0.9 diverges on cpu-tiny at R = 8 (naive delayed
    # DiLoCo too: 4.20), so the delayed rows' lower outer learning rate and momentum
    (
        "DiLoCoX (reconstruction)",
        ["outer.algorithm=diloco_x", "outer.learning_rate=0.35", "outer.momentum=0.5"],
    ),
]
# --sweep ablations: one setting changed against a row above (not valid on micro: tau 4 needs
# H >= 10 with 2 fragments, a warm-up needs more rounds than micro's 2)
ABLATIONS = [
    # four overlapped steps per fragment: more drift for the compensation to correct
    (
        "Streaming DiLoCo tau 4",
        ["outer.algorithm=streaming_diloco", "outer.alpha=0.0", "outer.tau=4"],
    ),
    ("CoCoDC tau 4", ["outer.algorithm=cocodc", "outer.alpha=0.0", "outer.tau=4"]),
    (
        "DiLoCo outer Adam",
        ["outer.algorithm=diloco", "outer.optimizer=adam", "outer.learning_rate=0.01"],
    ),
    (
        "DiLoCo outer warm-up + cosine",
        ["outer.algorithm=diloco", "outer.lr_schedule=cosine", "outer.lr_warmup=3"],
    ),
]
# --sweep compression: the rows that compare bandwidth (run it with a larger H, see docs)
COMPRESSION = [
    "DDP",
    "DiLoCo",
    "DiLoCo int8",
    "Streaming DiLoCo",
    "Streaming DiLoCo FP4",
    "SparseLoCo",
]
# Per preset, per algorithm: overrides that make the preset's rows of that algorithm valid,
# applied before the row's own (a setting on the command line drops the fix). micro's H = 2
# with Streaming DiLoCo's 2 fragments leaves only tau = 0 (tau must be in [0, H // fragments));
# the other algorithms refuse a tau at all (they would ignore it).
PRESET_FIXES = {"micro": {"streaming_diloco": ["outer.tau=0"], "cocodc": ["outer.tau=0"]}}


@dataclasses.dataclass(frozen=True)
class Link:
    bandwidth_gbps: float = 1.0
    latency_ms: float = 10.0
    overlap_slowdown: float = 0.189

    def allreduce_s(self, nbytes: float, replicas: int) -> float:
        if replicas <= 1 or nbytes <= 0:
            return 0.0
        ring = 2 * (replicas - 1) / replicas * nbytes * 8 / (self.bandwidth_gbps * 1e9)
        return ring + 2 * (replicas - 1) * self.latency_ms / 1e3

    def permute_s(self, sent_bytes: float, peers: int) -> float:
        """A replica sends ``sent_bytes`` in all to ``peers`` group mates, one after the
        other over its own link (gossip: one latency per peer)."""
        if peers <= 0 or sent_bytes <= 0:
            return 0.0
        return sent_bytes * 8 / (self.bandwidth_gbps * 1e9) + peers * self.latency_ms / 1e3

    def exchange_s(self, nbytes: float, replicas: int) -> float:
        """Every replica sends its whole payload to each of the R-1 others over its own link
        (the multi-job exchange, ``co2jax.multijob``): ``(R-1) N`` bytes up each link, and
        one latency per peer pulled in turn."""
        if replicas <= 1 or nbytes <= 0:
            return 0.0
        up = (replicas - 1) * nbytes * 8 / (self.bandwidth_gbps * 1e9)
        return up + (replicas - 1) * self.latency_ms / 1e3


@functools.cache
def _plan(algorithm: str, H: int, fragments: int, tau: int, group_size: int, R: int):
    """``(transfers, reach, every_step)`` of the registered ``algorithm``: its own resolved
    schedule at these settings (built on stand-in parameters, one leaf per fragment), its
    reducer's reach, and whether its inner transform communicates every step (the
    registry's derived capability)."""
    leaves = {f"layer{i}": jax.ShapeDtypeStruct((8,), jnp.float32) for i in range(fragments)}
    given = {"fragments": fragments, "tau": tau, "group_size": group_size}
    names = {f.name for f in dataclasses.fields(registry.REGISTRY[algorithm])}
    settings = registry.settings(algorithm, **{k: v for k, v in given.items() if k in names})
    context = registry.Context(H, leaves, 0.1, num_replicas=R)
    outer = settings.outer(context)
    every_step = registry.capabilities(algorithm).every_step
    return resolve(outer, H), outer.reducer.reach, every_step


def simulated_round_s(
    algorithm: str,
    step_s: float,
    H: int,
    payload_bytes: float,
    R: int,
    link: Link,
    fragments: int = 1,
    tau: int = 0,
    exchange: str = "ring",
    group_size: int = 2,
    step_payload_bytes: float | None = None,
) -> float:
    """Simulated seconds of one round (H inner steps and its transfers): the project's cost
    model, pricing ``algorithm``'s own schedule (:func:`co2jax.engines.walk.round_seconds`).

    ``payload_bytes`` is what one replica's transfers of a round carry in all, split equally
    between them (Streaming DiLoCo's fragments). ``exchange`` is how a payload crosses the
    link: ``"ring"`` (an in-program ring all-reduce, :meth:`Link.allreduce_s`) or
    ``"all_to_all"`` (the multi-job exchange, :meth:`Link.exchange_s`). A transfer applied
    when it is sent (DiLoCo) is waited for; one sent earlier (CO2, delayed DiLoCo: the whole
    round; a fragment: ``tau`` steps) hides behind the compute in between, which it slows by
    ``link.overlap_slowdown``. A reducer that reaches only a group (NoLoCo's gossip) sends
    the payload to its ``group_size - 1`` group mates (:meth:`Link.permute_s`), whatever R
    is. An inner transform that communicates every step (DDP, DeMo, SPARTA) exchanges
    ``step_payload_bytes`` (default ``payload_bytes``) before every step's update, waited
    for; SPARTA-DiLoCo has both kinds.
    """
    if exchange not in ("ring", "all_to_all"):
        raise ValueError(f"exchange must be 'ring' or 'all_to_all', got exchange={exchange!r}")
    cost = link.allreduce_s if exchange == "ring" else link.exchange_s
    transfers, reach, every_step = _plan(algorithm, H, fragments, tau, group_size, R)
    if reach == "group":
        each = [link.permute_s(payload_bytes, min(group_size, R) - 1)] * len(transfers)
    else:
        each = [cost(payload_bytes / max(len(transfers), 1), R)] * len(transfers)
    if every_step:  # the inner transform's exchange at every step boundary
        transfers = (*transfers, *(Transfer(k, k) for k in range(1, H + 1)))
        step_bytes = payload_bytes if step_payload_bytes is None else step_payload_bytes
        each = [*each, *([cost(step_bytes, R)] * H)]
    return round_seconds(walk(transfers, H), step_s, each, link.overlap_slowdown)


def summarise(label, cfg, history, entropy, link, run_s) -> dict:
    """The row's numbers from the first seed's history: eval loss, excess over the entropy
    floor, bytes, tokens/s, modelled wall clock and the curves the report plots."""
    R, H = cfg.mesh.replica, cfg.train.sync_every
    steady = [r["seconds"] for r in history[1:]] or [history[0]["seconds"]]
    step_s = float(np.median(steady)) / H  # round 1 includes compilation
    per_round = history[-1]["bytes_total"] / len(history)
    # payload bytes per reduction, from the ring traffic 2(R-1)/R * N per replica
    o = cfg.outer
    fragments, tau = getattr(o, "fragments", 1), getattr(o, "tau", 0)
    group_size = getattr(o, "group_size", 2)
    _, reach, every_step = _plan(o.algorithm, H, fragments, tau, group_size, R)
    ring = 2 * (R - 1) / R if R > 1 else 0.0
    per = lambda total: total / ring if ring else 0.0
    step_payload = None
    if every_step and "bytes_inner" in history[-1]:  # the inner steps' and the transfers'
        inner = float(np.mean([r["bytes_inner"] for r in history]))
        payload, step_payload = per(per_round - inner), per(inner / H)
    else:  # a record without the split: all in the every-step exchange, or all in transfers
        payload = per(per_round / (H if every_step else 1))
    if reach == "group":
        payload = per_round  # sent to the group mates, not a ring's traffic
    sim = simulated_round_s(
        cfg.outer.algorithm,
        step_s,
        H,
        payload,
        R,
        link,
        fragments,
        tau,
        group_size=group_size,
        step_payload_bytes=step_payload,
    )
    evals = [(r["tokens"], r["eval_loss"]) for r in history if "eval_loss" in r]
    return {
        "label": label,
        "algorithm": cfg.outer.algorithm,
        "eval_loss": history[-1]["eval_loss"],
        "excess": None if entropy is None else history[-1]["eval_loss"] - entropy,
        "entropy": entropy,
        "bytes_total": history[-1]["bytes_total"],
        "tokens": history[-1]["tokens"],
        "tokens_per_s": history[-1]["tokens"] / (step_s * H * len(history)),
        "sim_s": sim * len(history),
        "run_s": run_s,
        "curve_tokens": [t for t, _ in evals],
        "curve_loss": [v for _, v in evals],
        "curve_bytes": [r["bytes_total"] for r in history if "eval_loss" in r],
        "curve_sim_s": [sim * r["round"] for r in history if "eval_loss" in r],
    }


def row_flag(row: dict) -> str | None:
    """``"non-finite"`` (a NaN/inf eval loss), ``"diverged"`` (the eval loss ended above where
    it started, or above uniform guessing, ln V, by 0.5 nats), or None."""
    curve = [float(v) for v in row.get("curve_loss", [])]
    if not curve or not all(math.isfinite(v) for v in [*curve, row["eval_loss"]]):
        return "non-finite"
    vocab = row.get("vocab_size")
    if len(curve) > 1 and curve[-1] > curve[0]:
        return "diverged"
    if vocab and vocab > 1 and curve[-1] > math.log(vocab) + 0.5:
        return "diverged"
    return None
