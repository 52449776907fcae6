"""The layering, read from the source: no import cycle, no import from a lower layer to a
higher one, no lazy intra-package import without a stated reason (other than a cycle), no
private name (``_x``) of one module used by another, and no module over the size limit (600
lines: a module is one responsibility, not split to fit a count)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MAX_LINES = 600
# lowest first: a module may import modules of its own layer and of the layers before it
LAYERS = [
    ("base", ("co2jax._checks", "co2jax.axes", "co2jax.tree", "co2jax.compilation_cache")),
    ("kernels", ("co2jax.kernels",)),
    ("comm", ("co2jax.comm",)),
    (
        "algorithms",
        ("co2jax.protocol", "co2jax.penalties", "co2jax.fragments", "co2jax.algorithms"),
    ),
    ("engines", ("co2jax.mesh", "co2jax.engines", "co2jax.distributed")),
    ("tools", ("co2jax.hlo", "co2jax.overlap")),
    ("package", ("co2jax",)),
    ("experiments", ("experiments",)),
]
PACKAGES = ("co2jax", "experiments")


def module_files(root: Path = ROOT) -> dict[str, Path]:
    """Module name -> file, for the installed layout (``kernels/`` is ``co2jax.kernels``)."""
    out = {}
    for folder, package in (
        ("co2jax", "co2jax"),
        ("kernels", "co2jax.kernels"),
        ("experiments", "experiments"),
    ):
        for path in sorted((root / folder).rglob("*.py")):
            parts = list(path.relative_to(root / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join([package, *parts])] = path
    return out


def layer_of(name: str) -> int:
    """The index in ``LAYERS`` of the longest prefix naming ``name``'s layer."""
    best, index = "", None
    for i, (_, prefixes) in enumerate(LAYERS):
        for p in prefixes:
            if (name == p or name.startswith(p + ".")) and len(p) > len(best):
                best, index = p, i
    if index is None or (best == "co2jax" and name != "co2jax"):
        raise AssertionError(f"module {name} has no layer: add it to LAYERS in {__file__}")
    return index


class Import:
    def __init__(self, source, target, line, lazy, comment):
        self.source, self.target, self.line, self.lazy, self.comment = (
            source,
            target,
            line,
            lazy,
            comment,
        )


def imports(modules: dict[str, Path]) -> list[Import]:
    """Every import of one of ``modules`` by another, module-level or inside a function."""
    found = []
    for name, path in modules.items():
        text = path.read_text()
        lines = text.splitlines()
        tree = ast.parse(text)
        functions = [
            n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)
        ]
        nested = {id(n) for f in functions for n in ast.walk(f) if n is not f}
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                targets = [
                    f"{node.module}.{a.name}"
                    if f"{node.module}.{a.name}" in modules
                    else node.module
                    for a in node.names
                ]
            else:
                continue
            above = lines[node.lineno - 2] if node.lineno >= 2 else ""
            comment = lines[node.lineno - 1].partition("#")[2] + above.strip().lstrip("#")
            for target in targets:
                if target in modules and target != name:
                    found.append(Import(name, target, node.lineno, id(node) in nested, comment))
    return found


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in list(edges):
        if v not in index:
            visit(v)
    return out


def problems(modules: dict[str, Path]) -> list[str]:
    found = imports(modules)
    edges: dict[str, set[str]] = {}
    out = []
    for imp in found:
        edges.setdefault(imp.source, set()).add(imp.target)
        if layer_of(imp.target) > layer_of(imp.source):
            out.append(
                f"{imp.source}:{imp.line} imports {imp.target} from a lower layer "
                f"({LAYERS[layer_of(imp.source)][0]} -> {LAYERS[layer_of(imp.target)][0]})"
            )
        same_package = imp.source.split(".")[0] == imp.target.split(".")[0]
        if imp.lazy and same_package:
            reason = imp.comment.strip()
            if "lazy:" not in reason or "cycle" in reason.lower():
                out.append(
                    f"{imp.source}:{imp.line} imports {imp.target} inside a function without a "
                    "'# lazy: <reason>' comment (a cycle is not a reason)"
                )
    out += [f"import cycle: {' -> '.join(c)}" for c in cycles(edges)]
    return out


def test_layers_cycles_and_lazy_imports():
    assert problems(module_files()) == []


def private_uses(modules: dict[str, Path]) -> list[str]:
    """``module:line name`` where a module imports or reads another project module's
    private name (``from m import _x``, ``m._x``)."""
    out = []
    for name, path in modules.items():
        tree = ast.parse(path.read_text())
        aliases = {}  # local name -> project module
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and not node.level:
                for a in node.names:
                    full = f"{node.module}.{a.name}"
                    if full in modules:
                        aliases[a.asname or a.name] = full
                    elif node.module in modules and a.name.startswith("_"):
                        out.append(f"{name}:{node.lineno} from {node.module} import {a.name}")
            elif isinstance(node, ast.Import):
                for a in node.names:
                    if a.name in modules and a.asname:
                        aliases[a.asname] = a.name
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and node.attr.startswith("_")
                and not node.attr.startswith("__")
                and isinstance(node.value, ast.Name)
                and node.value.id in aliases
            ):
                out.append(f"{name}:{node.lineno} {aliases[node.value.id]}.{node.attr}")
    return out


def test_no_private_name_crosses_modules():
    modules = module_files()
    benchmarks = {f"benchmarks.{p.stem}": p for p in sorted((ROOT / "benchmarks").glob("*.py"))}
    assert private_uses({**modules, **benchmarks}) == []


def test_a_private_use_is_found(tmp_path):
    files = {
        "co2jax.comm.a": "def _x():\n    pass\n",
        "co2jax.comm.b": "from co2jax.comm.a import _x\n",
        "co2jax.comm.c": "from co2jax.comm import a as m\nm._x()\n",
    }
    found = private_uses(_fake(tmp_path, files))
    assert found == [
        "co2jax.comm.b:1 from co2jax.comm.a import _x",
        "co2jax.comm.c:2 co2jax.comm.a._x",
    ]


def test_module_sizes():
    big = {n: len(p.read_text().splitlines()) for n, p in module_files().items()}
    assert {n: k for n, k in big.items() if k > MAX_LINES} == {}


def test_every_module_has_a_layer():
    for name in module_files():
        layer_of(name)


def _fake(tmp_path: Path, files: dict[str, str]) -> dict[str, Path]:
    modules = {}
    for name, text in files.items():
        path = tmp_path / (name.replace(".", "_") + ".py")
        path.write_text(text)
        modules[name] = path
    return modules


@pytest.mark.parametrize(
    "files, match",
    [
        (  # a comm module importing an engine
            {"co2jax.comm.x": "import co2jax.engines.y\n", "co2jax.engines.y": ""},
            "from a lower layer",
        ),
        (  # two modules of one layer importing each other
            {"co2jax.comm.a": "import co2jax.comm.b\n", "co2jax.comm.b": "import co2jax.comm.a\n"},
            "import cycle",
        ),
        (  # a lazy import that dodges a cycle
            {
                "co2jax.comm.a": "def f():\n    import co2jax.comm.b  # lazy: avoids a cycle\n",
                "co2jax.comm.b": "",
            },
            "without a '# lazy",
        ),
        (
            {"co2jax.comm.a": "def f():\n    from co2jax.comm import b\n", "co2jax.comm.b": ""},
            "without a '# lazy",
        ),
    ],
)
def test_the_checker_finds_what_it_forbids(tmp_path, files, match):
    assert any(match in p for p in problems(_fake(tmp_path, files)))


def test_the_checker_accepts_a_lazy_import_with_a_reason(tmp_path):
    files = {
        "co2jax.comm.a": (
            "def f():\n    # lazy: an optional dependency's module\n    import co2jax.comm.b\n"
        ),
        "co2jax.comm.b": "",
    }
    assert problems(_fake(tmp_path, files)) == []
