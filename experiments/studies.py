"""The fidelity studies: published orderings checked in miniature.

    python -m experiments.compare --sweep scaling  # DP vs DiLoCo: replicas, size, H, outer lr
    python -m experiments.compare --sweep eager    # overlap variants against H
    python -m experiments.compare --sweep bytes    # compressed pseudo-gradients, equal bytes

Each study is a list of rows (the comparison sweep's ``(label, overrides)`` pairs, run by
:func:`experiments.compare.run_sweep` with its validation up front, reuse of finished runs and
per-row failure records) and a report: tables, plots and the study's *targets*, each printed
as ``held`` or ``not held`` with the numbers it was decided on. Nothing is tuned to make a
target hold: the grids are fixed here, and a target that fails at this scale is reported so.

The scaling study follows the DiLoCo scaling-law recipe (arXiv 2503.09799) in miniature:
AdamW (0.9, 0.99) inner steps with warm-up and cosine decay, outer Nesterov momentum 0.9,
the same global batch for every run (DP's batch is split over the M replicas), and tokens
proportional to model size. The eager study compares the overlapped variants of DiLoCo
(arXiv 2502.12996) with the synchronous one at the same H. The bytes study runs the
compressed rows of the comparison on the same tokens and plots loss against the bytes each
replica sent, with the spread over seeds.

``smoke=True`` gives each study its smallest grid (one small model, a few steps, one seed):
it checks the pipeline and the report, not the science.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import numpy as np

from experiments import model as model_lib
from experiments.files import write_atomic
from experiments.sweep_rows import SWEEP

# the recipe shared by the studies' runs (on top of the cpu-tiny preset)
SEQ_LEN = 32
GLOBAL_BATCH = 16  # sequences per inner step, split over the replicas (and each one's data axis)
MIN_DEVICES = 2  # a run's fewest devices (DP and M = 1: two data shards)
COMMON = [
    f"data.seq_len={SEQ_LEN}",
    "inner.b2=0.99",
    "inner.schedule=cosine",
    "log.tensorboard=false",
    "log.progress=false",
]

# model sizes: (d_model, n_layers, d_ff, n_heads) -> parameters with the Markov data's 128 tokens
SIZES = {
    "37k": (32, 2, 128, 4),
    "80k": (48, 2, 192, 4),
    "140k": (64, 2, 256, 4),
}
# inner steps per 1000 parameters: tokens proportional to size. The first measured grid ran
# 6.5 (240 to 900 steps) with four outer lrs and took 43.7 minutes on 2 cores; this one fits
# the study's 30 minutes (docs/experiments.md)
STEPS_PER_KPARAM = 4.0


@dataclasses.dataclass(frozen=True)
class Row:
    """One row of a study: its label, overrides and the coordinates its tables read."""

    label: str
    overrides: tuple[str, ...]
    meta: dict


def _mesh(replicas: int) -> list[str]:
    """M replicas share the global batch, one device each (one replica: two data shards).
    The study's runner gives a row a process with as many emulated devices as its mesh: on
    2 cores, DP at 140k parameters ran its 900 steps in 9.6 s on 2 devices and 18.9 s on 8
    (1.2e-7 apart in loss). Two replicas of 8 sequences each and one of 16 over 2 data
    shards are the same arithmetic up to the order of float sums."""
    per = GLOBAL_BATCH // replicas
    data = max(MIN_DEVICES // replicas, 1)
    return [f"mesh.replica={replicas}", f"mesh.data={data}", f"data.batch={per}"]


def _model(size: tuple[int, int, int, int]) -> list[str]:
    d, n_layers, d_ff, heads = size
    return [
        f"model.d_model={d}",
        f"model.n_layers={n_layers}",
        f"model.d_ff={d_ff}",
        f"model.n_heads={heads}",
    ]


def _schedule(steps: int, H: int) -> list[str]:
    rounds = max(steps // H, 1)
    return [
        f"train.rounds={rounds}",
        f"train.sync_every={H}",
        f"inner.warmup_steps={max(rounds * H // 20, 1)}",
    ]


# ---------------------------------------------------------------------------------------------
# the scaling study


@dataclasses.dataclass(frozen=True)
class ScalingGrid:
    sizes: dict
    replicas: tuple[int, ...]
    outer_lrs: tuple[float, ...]
    hs: tuple[int, ...]  # the H study's values; the lr grid runs at the largest
    steps_per_kparam: float
    eval_every: int = 0

    inner_lrs: tuple[float, ...] = (3e-3, 6e-3, 1.2e-2, 2.4e-2, 4.8e-2)  # DP grid; DiLoCo: its best


SCALING = ScalingGrid(SIZES, (1, 2, 4, 8), (0.2, 0.45, 1.0), (1, 10, 30), STEPS_PER_KPARAM)
SCALING_SMOKE = ScalingGrid(
    {"smoke": (16, 1, 32, 2)}, (1, 2), (0.7,), (1, 2), 0.5, inner_lrs=(1e-2,)
)


def _steps(grid: ScalingGrid, size: str, H: int) -> int:
    d, n_layers, d_ff, _heads = grid.sizes[size]
    cfg = model_lib.preset(
        "tiny", vocab_size=128, max_seq_len=SEQ_LEN, d_model=d, n_layers=n_layers, d_ff=d_ff
    )
    steps = grid.steps_per_kparam * model_lib.param_count(cfg) / 1000
    return max(round(steps / max(grid.hs)) * max(grid.hs), max(grid.hs))


def best_inner_lr(rows: list[Row], results: dict, size: str) -> float | None:
    """DP's inner learning rate with the least mean final eval loss at ``size``."""
    means = {
        r.meta["inner_lr"]: float(np.mean(final_losses(results.get(r.label, []))))
        for r in rows
        if r.meta["kind"] == "dp" and r.meta["size"] == size and results.get(r.label)
    }
    means = {lr: v for lr, v in means.items() if math.isfinite(v)}
    return min(means, key=means.get) if means else None


def best_outer_lr(rows: list[Row], results: dict) -> float | None:
    """The outer lr with the least mean final eval loss among ``rows``, once all have run."""
    if not rows or any(not results.get(r.label) for r in rows):
        return None
    means = {r.meta["lr"]: float(np.mean(final_losses(results[r.label]))) for r in rows}
    means = {lr: v for lr, v in means.items() if math.isfinite(v)}
    return min(means, key=means.get) if means else None


def _diloco_row(cell: dict, base: list[str], m: int, H: int, lr: float) -> Row:
    """DiLoCo with ``m`` replicas, ``H`` and outer lr ``lr`` at ``cell``'s size, steps and
    inner lr."""
    return Row(
        f"scaling {cell['size']} M={m} H={H} lr={lr}",
        (
            *base,
            "outer.algorithm=diloco",
            f"outer.learning_rate={lr}",
            "outer.lr_in_state=true",  # the outer lrs at one (size, M, H) share one program
            *_mesh(m),
            *_schedule(cell["steps"], H),
        ),
        {**cell, "kind": "diloco", "M": m, "H": H, "lr": lr},
    )


def scaling_rows(smoke: bool = False, results: dict | None = None) -> list[Row]:
    """First DP over the inner-lr grid at every size. Given their ``results``: at each size's
    best inner lr, DiLoCo with each M and outer lr at the largest H; given those, the other
    H's at each M's best outer lr there. All on the same tokens per size."""
    grid = SCALING_SMOKE if smoke else SCALING
    rows = []
    H_top = max(grid.hs)
    for size, shape in grid.sizes.items():
        steps = _steps(grid, size, H_top)
        base = [*COMMON, *_model(shape), f"eval.every={grid.eval_every}"]
        for inner_lr in grid.inner_lrs:
            rows.append(
                Row(
                    f"scaling {size} DP inner lr {inner_lr}",
                    (
                        *base,
                        "outer.algorithm=ddp",
                        f"inner.learning_rate={inner_lr}",
                        *_mesh(1),
                        *_schedule(steps, H_top),
                    ),
                    {"size": size, "kind": "dp", "steps": steps, "inner_lr": inner_lr},
                )
            )
    if results is None:
        return rows
    for size, shape in grid.sizes.items():
        inner_lr = best_inner_lr(rows, results, size)
        if inner_lr is None:  # DP failed at every inner lr: nothing to compare against
            continue
        steps = _steps(grid, size, H_top)
        base = [
            *COMMON,
            *_model(shape),
            f"eval.every={grid.eval_every}",
            f"inner.learning_rate={inner_lr}",
        ]
        cell = {"size": size, "steps": steps, "inner_lr": inner_lr}

        def row(m, H, lr, cell=cell, base=base):
            return _diloco_row(cell, base, m, H, lr)

        grid_rows = [row(m, H_top, lr) for m in grid.replicas for lr in grid.outer_lrs]
        rows += grid_rows
        for m in grid.replicas:  # the other H's at the outer lr that was best at the largest
            lr = best_outer_lr([r for r in grid_rows if r.meta["M"] == m], results)
            if lr is not None:
                rows += [row(m, H, lr) for H in grid.hs if H != H_top]
    return rows


# ---------------------------------------------------------------------------------------------
# the eager-updates study

# the eager and bytes studies' inner learning rate: DP's best at 140k parameters in the
# scaling study, in its first grid and in this one (6e-3; 1.2e-2 within 0.004 of it in both)
INNER_LR = 6e-3
EAGER_HS = (10, 30, 100)
EAGER_STEPS = 1800
# one device per replica (the global batch of 16 as 8 x 2). At 4 replicas x 2 data shards,
# naive delayed DiLoCo's round program once stalled twice in a row (its replica-axis
# reduction and the data-axis ones waiting on each other in XLA:CPU's rendezvous): it was
# loaded from the persistent compilation cache, which loses the order of a CPU program's
# collectives (co2jax.compilation_cache). The studies run without that cache now.
EAGER_REPLICAS = 8
# DiLoCo's best outer lr at 140k parameters, M = 8, H = 30 in the scaling study's first grid
# (900 steps, outer lrs 0.2/0.4/0.7/1.0; docs/experiments.md)
EAGER_OUTER_LR = 0.4
EAGER_SIZE = "140k"
# (key, label, overrides): no overlap, the naive one-outer-step delay, eager updates, and the
# whole model streamed as one fragment whose average lands one inner step after it was sent
VARIANTS = [
    ("none", "no overlap (DiLoCo)", ["outer.algorithm=diloco"]),
    ("naive", "naive delayed", ["outer.algorithm=delayed_diloco"]),
    ("eager", "eager", ["outer.algorithm=eager_diloco"]),
    (
        "inner1",
        "1-inner-step overlap",
        ["outer.algorithm=streaming_diloco", "outer.fragments=1", "outer.tau=1"],
    ),
]


# the same three at H = 30 with fewer replicas: eager's fresh term is each replica's own
# pseudo-gradient over M, so its correction of the stale average shrinks as M grows
EAGER_BY_M = (2, 4)
BY_M_VARIANTS = ("none", "naive", "eager")


def eager_rows(smoke: bool = False, results: dict | None = None) -> list[Row]:
    hs, steps = ((2,), 4) if smoke else (EAGER_HS, EAGER_STEPS)
    shape = SCALING_SMOKE.sizes["smoke"] if smoke else SIZES[EAGER_SIZE]
    by_m = ((2, (2,)),) if smoke else ((30, EAGER_BY_M),)

    def row(H, m, key, label, overrides, name):
        return Row(
            name,
            (
                *COMMON,
                *_model(shape),
                *_mesh(m),
                *_schedule(steps, H),
                "eval.every=0",
                f"inner.learning_rate={INNER_LR}",
                f"outer.learning_rate={EAGER_OUTER_LR}",
                *overrides,
            ),
            {"H": H, "variant": key, "M": m, "size": "smoke" if smoke else EAGER_SIZE},
        )

    rows = [
        row(H, EAGER_REPLICAS, key, label, overrides, f"eager H={H} {label}")
        for H in hs
        for key, label, overrides in VARIANTS
    ]
    rows += [
        row(H, m, key, label, overrides, f"eager H={H} M={m} {label}")
        for H, ms in by_m
        for m in ms
        for key, label, overrides in VARIANTS
        if key in BY_M_VARIANTS
    ]
    return rows


# ---------------------------------------------------------------------------------------------
# compression at equal bytes

BYTES_LABELS = [  # the comparison's rows, by label, plus DiLoCo with FP4 pseudo-gradients
    "DiLoCo",
    "DiLoCo int8",
    "DiLoCo FP4",
    "Streaming DiLoCo FP4",
    "SparseLoCo",
    "SparseLoCo production",
    "DCT-momentum DiLoCo",
]
EXTRA = {"DiLoCo FP4": ["outer.algorithm=diloco", "outer.compression=fp4"]}
BYTES_H = 30
BYTES_STEPS = 1200
# 4 replicas x 2 data shards over 8 devices, the mesh its measured table was run on (the
# same arithmetic as 4 x 1 up to the order of float sums)
BYTES_MESH = ["mesh.replica=4", "mesh.data=2", f"data.batch={GLOBAL_BATCH // 4}"]


def bytes_rows(smoke: bool = False, results: dict | None = None) -> list[Row]:
    table = {**dict(SWEEP), **EXTRA}
    H, steps = (2, 8) if smoke else (BYTES_H, BYTES_STEPS)
    shape = SCALING_SMOKE.sizes["smoke"] if smoke else SIZES["140k"]
    labels = BYTES_LABELS[:3] if smoke else BYTES_LABELS
    return [
        Row(
            f"bytes {label}",
            (
                *COMMON,
                *_model(shape),
                *BYTES_MESH,
                *_schedule(steps, H),
                "eval.every=1" if smoke else "eval.every=2",
                f"inner.learning_rate={INNER_LR}",
                *table[label],
            ),
            {"name": label},
        )
        for label in labels
    ]


# ---------------------------------------------------------------------------------------------
# the next algorithms' orderings at equal bytes, and CO2 against DiLoCo over H and the outer lr

ORDER_STEPS = 1200
ORDER_H = 30
MUON_LR_RATIO = 16  # MuLoCo's paper: Muon's inner lr 0.0625 against AdamW-DiLoCo's 0.0039
# (label, key, H, overrides): SPARTA at p = 1/30 and SPARTA-DiLoCo at H = 60, p = 1/60 send
# what DiLoCo sends at H = 30 (a copy of the model per 30 steps); DES-LOC (K_u, K_v = 3, 6
# rounds) at H = 30 sends 1.5 copies per 30 steps, as Local Adam (everything every round) at
# H = 60 does; MuLoCo sends 2-bit pseudo-gradients (1/16 of DiLoCo's float32)
ORDER_ROWS = [
    ("DiLoCo H=30", "diloco", 30, ["outer.algorithm=diloco"]),
    ("DiLoCo H=60", "diloco60", 60, ["outer.algorithm=diloco"]),
    ("SPARTA p=1/30", "sparta", 30, ["outer.algorithm=sparta", "outer.fraction=0.0333"]),
    (
        "SPARTA-DiLoCo H=60 p=1/60",
        "sparta_diloco",
        60,
        ["outer.algorithm=sparta_diloco", "outer.fraction=0.0167"],
    ),
    ("Local SGD H=30 (local Adam states)", "local", 30, ["outer.algorithm=local_sgd"]),
    (
        "Local Adam H=60",
        "local_adam",
        60,
        ["outer.algorithm=desloc", "outer.first_moment_every=1", "outer.second_moment_every=1"],
    ),
    ("DES-LOC H=30 (3, 6)", "desloc", 30, ["outer.algorithm=desloc"]),
    (
        "MuLoCo H=30 (Muon lr x16)",
        "muloco",
        30,
        ["outer.algorithm=muloco", f"inner.learning_rate={MUON_LR_RATIO * 6e-3:g}"],
    ),
    ("MuLoCo H=30 (Muon lr x1)", "muloco_lr1", 30, ["outer.algorithm=muloco"]),
    # added after the first grid's x16 row diverged (its AdamW part at 16x too): exploratory,
    # no target reads it
    (
        "MuLoCo H=30 (Muon lr x16, AdamW x1)",
        "muloco_split_lr",
        30,
        ["outer.algorithm=muloco", f"outer.muon_lr_scale={MUON_LR_RATIO}"],
    ),
    (
        "MuLoCo H=30 uncompressed",
        "muloco_fp32",
        30,
        [
            "outer.algorithm=muloco",
            f"inner.learning_rate={MUON_LR_RATIO * 6e-3:g}",
            "outer.compression=none",
            "outer.collective=two_step",
            "outer.error_feedback=false",
        ],
    ),
]
# hierarchical DiLoCo (M = 4: two regions of two) at H1 = 10, K = 3 crosses the slow links as
# often as DiLoCo at H = 30 (one all-reduce of a model copy per 30 steps); DiLoCo at H = 10 is
# what flat training pays for the same H inside a region (3x the slow-link bytes)
HIER = ["outer.algorithm=hierarchical_diloco", "outer.regions=2", "outer.global_every=3"]
ORDER_ROWS += [
    ("DiLoCo H=10", "diloco10", 10, ["outer.algorithm=diloco"]),
    ("Hierarchical H1=10 K=3", "hier", 10, HIER),
    (
        "Hierarchical H1=10 K=3 (region mean, global Nesterov)",
        "hier_global",
        10,
        [
            *HIER,
            "outer.learning_rate=1.0",
            "outer.momentum=0.0",
            "outer.global_learning_rate=0.7",
            "outer.global_momentum=0.9",
        ],
    ),
    # the outer momentum's schedules, on DiLoCo H = 30 (40 rounds; the smoke grid's 4 rounds
    # take a quarter of them: momentum_warmup and momentum_decay are rounds)
    ("DiLoCo H=30 momentum restarts (every 5)", "restart", 30,
     ["outer.algorithm=diloco", "outer.momentum_restart=5"]),
    ("DiLoCo H=30 momentum warm-up and decay (10, 10)", "warm_decay", 30,
     ["outer.algorithm=diloco", "outer.momentum_warmup=10", "outer.momentum_decay=10"]),
    # GPA against AdamW at equal steps, both under DDP (every step's gradients averaged);
    # mu_x 0.9967 is the release's, 0.987 = 0.9^(1/8) its match of DiLoCo at H = 8
    ("DDP AdamW", "ddp", 30, ["outer.algorithm=ddp"]),
    ("DDP GPA (mu_x 0.9967)", "gpa", 30, ["outer.algorithm=ddp", "inner.optimizer=gpa"]),
    ("DDP GPA (mu_x 0.987)", "gpa_fast", 30,
     ["outer.algorithm=ddp", "inner.optimizer=gpa", "inner.gpa_mu_x=0.987"]),
]  # fmt: skip
SMOKE_ROUNDS = {"outer.momentum_warmup=10": "outer.momentum_warmup=1",
                "outer.momentum_decay=10": "outer.momentum_decay=1"}  # fmt: skip
CO2_HS = (10, 30)
CO2_LRS = (0.4, 0.7, 1.0)
CO2_VARIANTS = [  # the comparison report's three rows, their outer lr swept
    ("DiLoCo", ["outer.algorithm=diloco"]),
    ("CO2", ["outer.algorithm=co2", "outer.momentum=0.0"]),
    (
        "CO2 + penalty + clip",
        [
            "outer.algorithm=co2",
            "outer.momentum=0.2",
            "outer.penalty=gap_aware",
            "outer.clip_threshold=0.02",
        ],
    ),
]


def orderings_rows(smoke: bool = False, results: dict | None = None) -> list[Row]:
    shape = SCALING_SMOKE.sizes["smoke"] if smoke else SIZES["140k"]
    steps = 8 if smoke else ORDER_STEPS
    base = (*COMMON, *_model(shape), *BYTES_MESH, f"inner.learning_rate={INNER_LR}")
    rows = []
    for label, key, H, overrides in ORDER_ROWS:  # every algorithm, even in the smoke grid
        H = 2 if smoke else H
        every = "eval.every=1" if smoke else f"eval.every={max(60 // H, 1)}"
        if smoke:
            overrides = [SMOKE_ROUNDS.get(o, o) for o in overrides]
        rows.append(
            Row(
                f"orderings {label}",
                (*base, *_schedule(steps, H), every, *overrides),
                {"name": label, "key": key, "H": H},
            )
        )
    hs, lrs = ((2,), (0.7,)) if smoke else (CO2_HS, CO2_LRS)
    for H in hs:
        for lr in lrs:
            for name, overrides in CO2_VARIANTS:
                rows.append(
                    Row(
                        f"orderings {name} H={H} lr={lr}",
                        (
                            *base,
                            *_schedule(steps, H),
                            "eval.every=1" if smoke else f"eval.every={max(60 // H, 1)}",
                            *overrides,
                            f"outer.learning_rate={lr}",
                        ),
                        {"name": name, "key": "co2grid", "H": H, "lr": lr},
                    )
                )
    return rows


STUDIES = {
    "scaling": scaling_rows,
    "eager": eager_rows,
    "bytes": bytes_rows,
    "orderings": orderings_rows,
}


# ---------------------------------------------------------------------------------------------
# reading the runs


def seed_results(plan: list[dict]) -> dict[str, list[dict]]:
    """Per row label, each seed's finished ``result.json`` (missing or failed runs left out)."""
    results = {}
    for entry in plan:
        found = []
        for run in entry["runs"]:
            try:
                record = json.loads((run["dir"] / "result.json").read_text())
            except (OSError, ValueError):
                continue
            if record.get("hash") == run["hash"] and record.get("history"):
                found.append(record)
        results[entry["label"]] = found
    return results


def final_losses(records: list[dict]) -> list[float]:
    return [float(r["history"][-1]["eval_loss"]) for r in records]


def mean_sd(values: list[float]) -> tuple[float, float | None]:
    if not values:
        return math.nan, None
    sd = float(np.std(values, ddof=1)) if len(values) > 1 else None
    return float(np.mean(values)), sd


def fmt(values: list[float], digits: int = 4) -> str:
    m, sd = mean_sd(values)
    if math.isnan(m):
        return "not run"
    return f"{m:.{digits}f}" + ("" if sd is None else f" ± {sd:.{digits}f}")


@dataclasses.dataclass
class Target:
    """One published claim checked on the runs: ``held`` is None where it was not measured."""

    claim: str
    held: bool | None
    evidence: str

    def line(self) -> str:
        verdict = {True: "held", False: "not held", None: "not measured"}[self.held]
        return f"- **{verdict}**: {self.claim}. {self.evidence}"


def write_study(out: Path, title: str, sections: list[str], targets: list[Target], data) -> None:
    """``report.md`` (the targets first, then the tables) and ``study.json`` (the numbers)."""
    lines = [t.line() for t in targets] or ["None: this study measures, with no threshold."]
    text = [f"# {title}", "", "## Targets", "", *lines, ""]
    text += sections
    write_atomic(out / "report.md", "\n".join(text) + "\n")
    payload = {"targets": [dataclasses.asdict(t) for t in targets], "data": data}
    write_atomic(out / "study.json", json.dumps(payload, indent=1, default=float))


TITLES = {
    "scaling": "DiLoCo scaling in miniature: replicas, model size, H and the outer learning rate",
    "eager": "Overlapping the outer step: naive delay, eager updates and a one-step overlap",
    "bytes": "Compressed pseudo-gradients at equal bytes",
    "orderings": "SPARTA, DES-LOC, MuLoCo and hierarchical DiLoCo at equal bytes, outer-momentum "
    "schedules, GPA against AdamW; CO2 against DiLoCo over H and the outer learning rate",
}
