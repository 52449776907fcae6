"""Reading collectives out of compiled HLO text: communication asserted, not assumed.

``jax.jit(f).lower(*args).compile().as_text()`` is the program XLA will run. These helpers
find its collectives, tell which mesh axis each one spans, and add up what they move, so that
tests can count the all-reduces of a sync and drivers can report bytes communicated.

Example:
  >>> line = ("  %ar = (f32[2]{0}, bf16[3]{0}) all-reduce(%a, %b), channel_id=1, "
  ...         "replica_groups={{0,2},{1,3}}, to_apply=%add")
  >>> [c] = collectives(line)
  >>> c.op, c.groups, c.elements, c.bytes
  ('all-reduce', ((0, 2), (1, 3)), 5, 14)
"""

from __future__ import annotations

import re
from typing import NamedTuple

import numpy as np

_DTYPE_BYTES = {
    "pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4,
    "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16,
    "f8e4m3fn": 1, "f8e5m2": 1, "f8e4m3": 1, "f8e5m2fnuz": 1, "f8e4m3fnuz": 1,
    "s4": 1, "u4": 1, "f4e2m1fn": 1,
}  # fmt: skip
_COLLECTIVE_OPS = (
    "all-reduce",
    "all-gather",
    "reduce-scatter",
    "collective-permute",
    "all-to-all",
)


class Collective(NamedTuple):
    """One collective instruction of an HLO module.

    Attributes:
      op: the HLO op name (``"all-reduce"``, ``"all-gather"``, ...), without ``-start``.
      asynchronous: True for the ``-start`` form of an asynchronous collective.
      groups: the device-id groups it runs over (``source_target_pairs`` for permutes).
      shapes: ``(dtype, dims)`` of each result.
      computation: the name of the HLO computation that holds it.
    """

    op: str
    asynchronous: bool
    groups: tuple[tuple[int, ...], ...]
    shapes: tuple[tuple[str, tuple[int, ...]], ...]
    computation: str

    @property
    def elements(self) -> int:
        return int(sum(np.prod(dims, dtype=np.int64) for _, dims in self.shapes))

    @property
    def bytes(self) -> int:
        return int(
            sum(np.prod(dims, dtype=np.int64) * _DTYPE_BYTES.get(dt, 4) for dt, dims in self.shapes)
        )


def parse_groups(attr: str) -> tuple[tuple[int, ...], ...]:
    """Parses ``replica_groups``: explicit ``{{0,2},{1,3}}`` or iota ``[2,2]<=[4]T(1,0)``."""
    attr = attr.strip()
    if attr.startswith("{"):
        return tuple(
            tuple(int(v) for v in g.split(",") if v) for g in re.findall(r"\{([\d,]*)\}", attr)
        )
    m = re.match(r"\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", attr)
    if m is None:
        raise ValueError(f"unrecognised replica_groups attribute: {attr!r}")
    shape = [int(v) for v in m.group(1).split(",")]
    dims = [int(v) for v in m.group(2).split(",")]
    ids = np.arange(int(np.prod(dims))).reshape(dims)
    if m.group(3):
        ids = ids.transpose([int(v) for v in m.group(3).split(",")])
    return tuple(tuple(int(v) for v in row) for row in ids.reshape(shape))


_INSTR = re.compile(
    r"^\s*(?:ROOT )?%\S+ = (?P<type>.*?) (?P<op>"
    + "|".join(_COLLECTIVE_OPS)
    + r")(?P<start>-start)?\("
)
_GROUPS = re.compile(
    r"replica_groups=(\{\{[\d,{}]*\}\}|\[[\d,]+\]<=\[[\d,]+\](?:T\([\d,]+\))?|\{\})"
)
_PAIRS = re.compile(r"source_target_pairs=\{([\d,{}]*)\}")
_SHAPE = re.compile(r"\b([a-z]+[0-9a-z]*)\[([\d,]*)\]")
_COMPUTATION = re.compile(r"^(?:ENTRY )?%([\w.\-]+) ")  # headers start at column 0


def collectives(hlo: str) -> list[Collective]:
    """Every collective instruction in ``hlo`` (``-done`` halves are not listed)."""
    out, computation = [], ""
    for line in hlo.splitlines():
        header = _COMPUTATION.match(line)
        if header:
            computation = header.group(1)
            continue
        m = _INSTR.search(line)
        if m is None:
            continue
        groups: tuple[tuple[int, ...], ...] = ()
        g = _GROUPS.search(line)
        if g and g.group(1) != "{}":
            groups = parse_groups(g.group(1))
        p = _PAIRS.search(line)
        if p:
            groups = tuple(
                tuple(int(v) for v in pair.split(","))
                for pair in re.findall(r"\{([\d,]+)\}", p.group(0))
            )
        shapes = tuple(
            (dt, tuple(int(v) for v in dims.split(",") if v))
            for dt, dims in _SHAPE.findall(m.group("type"))
            if dt in _DTYPE_BYTES
        )
        if m.group("start") and m.group("op") != "collective-permute" and len(shapes) > 1:
            # async start ops return (operands..., results...): keep the results half
            shapes = shapes[len(shapes) // 2 :]
        out.append(Collective(m.group("op"), bool(m.group("start")), groups, shapes, computation))
    return out


_CALLEE = re.compile(
    r"(calls|to_apply|body|condition|branch_computations|true_computation|false_computation)"
    r"=(\{[^}]*\}|%[\w.\-]+)"
)


def conditional_computations(hlo: str) -> frozenset[str]:
    """Names of the computations that run only when a ``conditional`` takes their branch.

    A collective whose ``computation`` is in this set is issued only on the steps that take
    that branch (e.g. the sync steps of :func:`co2jax.local_updates`), not on every step.
    """
    calls: dict[str, set[str]] = {}
    roots: set[str] = set()
    computation = ""
    for line in hlo.splitlines():
        header = _COMPUTATION.match(line)
        if header:
            computation = header.group(1)
            calls.setdefault(computation, set())
            continue
        for kind, target in _CALLEE.findall(line):
            names = set(re.findall(r"%([\w.\-]+)", target))
            calls.setdefault(computation, set()).update(names)
            if kind in ("branch_computations", "true_computation", "false_computation"):
                roots |= names
    seen, stack = set(), list(roots)
    while stack:
        name = stack.pop()
        if name not in seen:
            seen.add(name)
            stack.extend(calls.get(name, ()))
    return frozenset(seen)


def axis_groups(mesh, axis: str) -> frozenset[tuple[int, ...]]:
    """The groups that span ``axis`` of ``mesh`` (one per index of the other axes).

    Groups are given as HLO numbers them with ``use_global_device_ids``: positions in the
    program's device assignment (the mesh's devices in row-major order), not ``device.id``
    (the two differ on TPU meshes laid out by topology).
    """
    ids = np.arange(mesh.devices.size).reshape(mesh.devices.shape)
    k = mesh.axis_names.index(axis)
    rows = np.moveaxis(ids, k, -1).reshape(-1, ids.shape[k])
    return frozenset(tuple(sorted(int(v) for v in row)) for row in rows)


def over_axis(found: list[Collective], mesh, axis: str) -> list[Collective]:
    """The collectives in ``found`` whose groups are exactly the groups spanning ``axis``."""
    want = axis_groups(mesh, axis)
    return [c for c in found if frozenset(tuple(sorted(g)) for g in c.groups) == want]


_ENTRY_OP = re.compile(r"^\s*(?:ROOT )?%(?P<name>[\w.\-]+) = .*? (?P<op>[a-z][a-z0-9\-]*)\(")


def entry_sequence(hlo: str) -> list[str]:
    """The scheduled order of loops and collectives in the ENTRY computation of ``hlo``.

    Items are HLO op names: ``"while"``, synchronous collectives (``"all-reduce"``,
    ``"all-gather"``, ...), and asynchronous halves (``"all-gather-start"``,
    ``"collective-permute-done"``, ...). XLA:TPU's fused asynchronous collectives appear as
    ``"async-collective-start"`` / ``"async-collective-done"`` (their done may sit inside the
    loop body, fused with its compute).

    Example:
      >>> text = "\\n".join([
      ...     "ENTRY %main (p: f32[4]) -> f32[4] {",
      ...     "  %ag = f32[8] all-gather-start(%p), replica_groups={{0,1}}",
      ...     "  %w = (s32[]) while(%t), condition=%c, body=%b",
      ...     "  %d = f32[8] all-gather-done(%ag)",
      ...     "}"])
      >>> entry_sequence(text)
      ['all-gather-start', 'while', 'all-gather-done']
    """
    names = ("while", *_COLLECTIVE_OPS)
    out, inside = [], False
    for line in hlo.splitlines():
        if line.startswith("ENTRY "):
            inside = True
            continue
        if inside and line.startswith("}"):
            break
        if not inside:
            continue
        m = _ENTRY_OP.match(line)
        if m is None:
            continue
        name, op = m.group("name"), m.group("op")
        if name.startswith("async-collective-start") or name.startswith("async-collective-done"):
            out.append(name.rsplit(".", 1)[0] if "." in name else name)
        elif op in names or any(
            op == f"{c}-{half}" for c in _COLLECTIVE_OPS for half in ("start", "done")
        ):
            out.append(op)
    return out
