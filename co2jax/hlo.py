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
        if m.group("start") and m.group("op") == "collective-permute":
            # (operands..., results..., u32[] contexts): the contexts are not sent
            while len(shapes) > 2 and shapes[-1] == ("u32", ()):
                shapes = shapes[:-1]
        if m.group("start") and len(shapes) > 1:
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


def _slice(device) -> int:
    return getattr(device, "slice_index", 0) or 0


def _positions(mesh) -> np.ndarray:
    """Each mesh device's number in the compiled program's groups: its position in the
    device assignment (the mesh's devices in row-major order). A program for several TPU
    slices is compiled per slice: there a device is numbered inside its own slice."""
    flat = list(mesh.devices.flat)
    seen: dict[int, int] = {}
    ids = []
    for d in flat:
        s = _slice(d)
        ids.append(seen.get(s, 0))
        seen[s] = ids[-1] + 1
    return np.array(ids).reshape(mesh.devices.shape)


def crosses_slices(mesh, axis: str) -> bool:
    """Whether ``axis`` of ``mesh`` joins devices of different slices (over DCN)."""
    k = mesh.axis_names.index(axis)
    slices = np.vectorize(_slice, otypes=[int])(mesh.devices)
    rows = np.moveaxis(slices, k, -1).reshape(-1, slices.shape[k])
    return bool((rows != rows[:, :1]).any())


def axis_groups(mesh, axis: str) -> frozenset[tuple[int, ...]]:
    """The groups that span ``axis`` of ``mesh`` (one per index of the other axes).

    Groups are given as HLO numbers them with ``use_global_device_ids``: positions in the
    program's device assignment (the mesh's devices in row-major order), not ``device.id``
    (the two differ on TPU meshes laid out by topology). On several slices the groups are the
    part of each line of ``axis`` inside one slice (what crosses slices goes over DCN:
    :func:`flights`); empty when every slice holds one device of each line.
    """
    ids = _positions(mesh)
    k = mesh.axis_names.index(axis)
    slices = np.vectorize(_slice, otypes=[int])(mesh.devices)
    rows = np.moveaxis(ids, k, -1).reshape(-1, ids.shape[k])
    where = np.moveaxis(slices, k, -1).reshape(-1, ids.shape[k])
    groups = set()
    for row, at in zip(rows, where, strict=True):
        for s in np.unique(at):
            group = tuple(sorted(int(v) for v in row[at == s]))
            if len(group) > 1 or len(np.unique(at)) == 1:
                groups.add(group)
    return frozenset(groups)


def over_axis(found: list[Collective], mesh, axis: str) -> list[Collective]:
    """The collectives in ``found`` whose groups are exactly the groups spanning ``axis``
    (inside each slice, on several)."""
    want = axis_groups(mesh, axis)
    if not want:
        return []
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


# ---------------------------------------------------------------------------------------------
# in flight under compute: reading the schedule


class Flight(NamedTuple):
    """One collective over an axis, as scheduled.

    Attributes:
      computation: where it is issued.
      op: the collective (``"all-gather"``, ...).
      bytes: what one execution moves (its result's bytes).
      count: executions per run of the program (loop trip counts; a conditional's branch is
        taken once per run of its loop, as the round engine's per-step branches are).
      hidden: issued asynchronously, with compute (a loop, a matmul, a custom call)
        scheduled between its start and its done, or after its start when its done sits in
        another computation.
      sent: bytes one device sends per execution (ring algorithms: an all-reduce of B over g
        devices 2(g-1)/g B, an all-gather of B (g-1)/g B, a reduce-scatter to b (g-1) b, a
        permute B), averaged over the devices that run it: a permute, or a cross-slice
        transfer, whose pairs start at only some of them (a shift of replicas that share
        slices: XLA splits it into a permute inside the slices and one between them) counts
        B times the share of devices that send.
      link: ``"ici"`` (inside a slice, or any single-slice or CPU/GPU program) or ``"dcn"``
        (between slices: XLA:TPU's megascale send/recv pairs, whose ``send`` carries this
        device's piece to the other slices).
      across_loop: issued asynchronously with a ``while`` loop scheduled between its start
        and its done (a payload in flight across an inner loop, not only under one step).
    """

    computation: str
    op: str
    bytes: int
    count: int
    hidden: bool
    sent: int = 0
    link: str = "ici"
    across_loop: bool = False


_LINE = re.compile(
    r"^\s*(?:ROOT )?%(?P<name>[\w.\-]+) = .*? (?P<op>[a-z][a-z0-9\-]*)\((?P<args>.*)"
)
_TRIPS = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')


def _computations(hlo: str) -> dict[str, list[tuple[str, str, str]]]:
    """Computation -> its instructions ``(name, op, line)`` in schedule order."""
    out: dict[str, list] = {}
    current = None
    for line in hlo.splitlines():
        header = _COMPUTATION.match(line)
        if header and not line.startswith(" "):
            current = header.group(1)
            out[current] = []
            if line.startswith("ENTRY "):
                out["__entry__"] = [("", "", current)]
            continue
        m = _LINE.match(line)
        if current is not None and m:
            out[current].append((m.group("name"), m.group("op"), line))
    return out


def _trips(comps: dict, line: str) -> int:
    """A while loop's trip count, from ``known_trip_count`` or its ``counter < N`` condition
    (1 when neither can be read)."""
    m = _TRIPS.search(line)
    if m:
        return int(m.group(1))
    cond = re.search(r"condition=%([\w.\-]+)", line)
    instrs = comps.get(cond.group(1), ()) if cond else ()
    constants = {
        n: int(v.group(1))
        for n, op, ln in instrs
        if op == "constant" and (v := re.search(r"constant\((\d+)\)", ln))
    }
    for _, op, ln in instrs:
        if op == "compare" and "direction=LT" in ln:
            for operand in re.findall(r"%([\w.\-]+)", ln.split("compare(", 1)[1]):
                if operand in constants:
                    return constants[operand]
    return 1


def _counts(comps: dict) -> dict[str, int]:
    """Executions of each computation per run of the program."""
    entry = comps["__entry__"][0][2]
    counts, stack = {entry: 1}, [entry]
    while stack:
        name = stack.pop()
        for _, op, line in comps.get(name, ()):
            trips = _trips(comps, line) if op == "while" else 1
            for kind, target in _CALLEE.findall(line):
                for callee in re.findall(r"%([\w.\-]+)", target):
                    n = counts[name] * (trips if kind == "body" else 1)
                    if callee not in counts or counts[callee] < n:
                        counts[callee] = n
                        stack.append(callee)
    return counts


def _is_compute(op: str, line: str, comps: dict) -> bool:
    if op in ("while", "convolution", "dot", "call"):
        return True
    if op == "custom-call":
        return "AllocateBuffer" not in line
    if op == "fusion":
        callee = re.search(r"calls=%([\w.\-]+)", line)
        body = comps.get(callee.group(1), ()) if callee else ()
        return any(o in ("convolution", "dot", "custom-call") for _, o, _ in body)
    return False


def sent_bytes(c: Collective) -> int:
    """Bytes one device sends for collective ``c`` (ring algorithms, its group's size)."""
    g = max((len(x) for x in c.groups), default=1)
    if c.op == "collective-permute":
        return c.bytes
    if c.op == "all-reduce":
        return 2 * (g - 1) * c.bytes // g
    if c.op == "reduce-scatter":
        return (g - 1) * c.bytes
    return (g - 1) * c.bytes // g  # all-gather, all-to-all


_MEGASCALE = re.compile(r'_xla_megascale_transfer_type="(?P<kind>\w+)"')


_TARGETS = re.compile(r"_xla_megascale_target=\{(.*?\})\}")


def _megascale(
    line: str, recv_shapes: dict, slices: int, devices: int = 0
) -> tuple[int, int] | None:
    """``(bytes, sent)`` of a megascale ``send`` (a cross-slice transfer among ``slices``
    slices), else None: an all-gather's send is this device's piece, for the others; an
    all-to-all's holds a piece for each slice, its own kept; an all-reduce's is the whole
    buffer (a ring's 2 (S-1)/S of it). A one-to-one transfer (a permute's part between
    slices) lists its pairs: only their sources send, of ``devices`` in all."""
    kind = _MEGASCALE.search(line)
    if kind is None or " send(" not in line:
        return None
    shapes = [
        (dt, [int(v) for v in dims.split(",") if v])
        for dt, dims in _SHAPE.findall(line.split(" send(")[0])
        if dt in _DTYPE_BYTES  # the data, then a u32[] and a token
    ]
    piece = sum(int(np.prod(d, dtype=np.int64)) * _DTYPE_BYTES[dt] for dt, d in shapes[:1])
    targets = _TARGETS.search(line)
    if targets is not None and devices:  # only the pairs' sources send
        sources = {pair.split("->")[0] for pair in re.findall(r"\{(\d+->\d+)\}", targets.group(1))}
        piece = piece * len(sources) // devices
    rendezvous = re.search(r'_xla_host_transfer_rendezvous="([^"]+)"', line)
    result = recv_shapes.get(rendezvous.group(1) if rendezvous else None, piece)
    kind = kind.group("kind")
    if kind == "ALL_GATHER":
        return result, piece * (slices - 1)
    if kind == "ALL_TO_ALL":
        return result, piece * (slices - 1) // slices
    if kind == "ALL_REDUCE":
        return result, 2 * piece * (slices - 1) // slices
    return result, piece


def _recv_bytes(hlo: str) -> dict:
    """A megascale ``recv``'s result bytes, by its rendezvous name."""
    out = {}
    for line in hlo.splitlines():
        if " recv(" not in line or _MEGASCALE.search(line) is None:
            continue
        rendezvous = re.search(r'_xla_host_transfer_rendezvous="([^"]+)"', line)
        shapes = [
            (dt, [int(v) for v in dims.split(",") if v])
            for dt, dims in _SHAPE.findall(line.split(" recv(")[0])
            if dt in _DTYPE_BYTES  # the data, then a u32[] and a token
        ]
        if rendezvous and shapes:
            dt, dims = shapes[0]
            out[rendezvous.group(1)] = int(np.prod(dims, dtype=np.int64)) * _DTYPE_BYTES[dt]
    return out


def flights(hlo: str, mesh, axis: str) -> list[Flight]:
    """Every collective over ``axis`` of ``mesh`` in the compiled ``hlo``, as scheduled.

    On several TPU slices a collective over an axis that crosses them is compiled as two
    parts: an ordinary collective over the part of the axis inside each slice (its groups in
    the slice's own numbering, :func:`axis_groups`), and megascale ``send``/``recv`` pairs
    between slices (``link="dcn"``), each found by its ``send`` and hidden when compute is
    scheduled between the ``send`` and its ``send-done``.
    """
    want = axis_groups(mesh, axis)
    dcn = crosses_slices(mesh, axis)
    slices = len({_slice(d) for d in mesh.devices.flat})
    comps = _computations(hlo)
    counts = _counts(comps)
    members = {d: g for g in want for d in g}
    total = mesh.devices.size
    per_slice = total // slices  # a permute's pairs number the devices of its slice
    recvs = _recv_bytes(hlo) if dcn else {}

    def spans(c: Collective) -> bool:
        if not want:
            return False
        if c.op == "collective-permute":  # source/target pairs, each inside one axis group
            return bool(c.groups) and all(
                len(p) == 2 and p[0] != p[1] and members.get(p[0]) == members.get(p[1]) is not None
                for p in c.groups
            )
        return frozenset(tuple(sorted(g)) for g in c.groups) == want

    def _sent(c: Collective) -> int:
        if c.op != "collective-permute":
            return sent_bytes(c)
        return sent_bytes(c) * len({p[0] for p in c.groups}) // per_slice

    by_computation: dict[str, list[Collective]] = {}
    for c in collectives(hlo):
        by_computation.setdefault(c.computation, []).append(c)
    async_bodies = {  # the computations an asynchronous collective fusion wraps
        m.group(1)
        for instrs in comps.values()
        for iname, op, line in instrs
        if iname.startswith("async-collective-") and (m := re.search(r"calls=%([\w.\-]+)", line))
    }
    out = []
    for name, instrs in comps.items():
        # an asynchronous collective's start stands for it; XLA:TPU also fuses its steps into
        # compute fusions (async_collective_fusion computations): the same collective again
        if (
            name == "__entry__"
            or name in async_bodies
            or name.startswith("async_collective_fusion")
        ):
            continue
        for i, (iname, op, line) in enumerate(instrs):
            found, link = None, "ici"
            if op in _COLLECTIVE_OPS or (op.endswith("-start") and op[:-6] in _COLLECTIVE_OPS):
                found = [(c.bytes, _sent(c), c.op) for c in collectives(line) if spans(c)]
            elif op == "fusion" and iname.startswith("async-collective-start"):
                callee = re.search(r"calls=%([\w.\-]+)", line).group(1)
                found = [
                    (c.bytes, _sent(c), c.op) for c in by_computation.get(callee, ()) if spans(c)
                ]
            elif op == "send" and dcn and (moved := _megascale(line, recvs, slices, total)):
                kind = _MEGASCALE.search(line).group("kind").lower().replace("_", "-")
                found, link = [(*moved, kind)], "dcn"
            if not found:
                continue
            hidden = across = False
            if op.endswith("-start") or op in ("fusion", "send"):
                done = next(
                    (
                        j
                        for j in range(i + 1, len(instrs))
                        if (instrs[j][1].endswith("-done") and f"%{iname}" in instrs[j][2])
                        or instrs[j][0].startswith("async-collective-done")
                    ),
                    len(instrs),
                )
                hidden = any(_is_compute(o, ln, comps) for _, o, ln in instrs[i + 1 : done])
                across = any(o == "while" for _, o, _ in instrs[i + 1 : done])
            for nbytes, sent, kind in found:
                n = counts.get(name, 1)
                out.append(Flight(name, kind, nbytes, n, hidden, sent, link, across))
    return out


def hidden_fraction(hlo: str, mesh, axis: str) -> float:
    """The fraction of the bytes moved over ``axis`` (each collective weighted by its
    executions) in flight under compute; 1.0 when nothing crosses the axis."""
    found = flights(hlo, mesh, axis)
    total = sum(f.bytes * f.count for f in found)
    return 1.0 if not total else sum(f.bytes * f.count for f in found if f.hidden) / total
