"""The documentation's examples run, and user-facing text cites only the repository.

Every fenced block tagged ``python`` on a page under ``docs/`` (``docs/*.md`` and
``docs/algorithms/*.md``) runs, in order, in one fresh namespace per page, on the 8 emulated
CPU devices of ``tests/conftest.py``. A block that needs an accelerator or several hosts is
marked by the line ``<!-- not-run: reason -->`` just before its fence; it is counted and
reported as skipped, and the rest of the page still runs.
"""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
PAGES = sorted([*DOCS.glob("*.md"), *DOCS.glob("algorithms/*.md")])

# A fenced block: its info string, then its body up to the closing fence (at line start).
FENCE = re.compile(r"^```([^\n`]*)\n(.*?)^```[ \t]*$", re.S | re.M)
NOT_RUN = re.compile(r"<!--\s*not-run:\s*(.*?)\s*-->\s*$")


def python_blocks(text: str) -> list[tuple[int, str, str | None]]:
    """The page's ``python`` blocks as ``(line, source, skip reason or None)``, in order."""
    blocks = []
    for match in FENCE.finditer(text):
        if match.group(1).strip() != "python":
            continue
        before = text[: match.start()].rstrip("\n").rsplit("\n", 1)[-1]
        skip = NOT_RUN.search(before)
        line = text.count("\n", 0, match.start()) + 2  # the block's first line of code
        blocks.append((line, match.group(2), skip.group(1) if skip else None))
    return blocks


def run_page(name: str, text: str) -> tuple[int, list[str]]:
    """Runs the page's ``python`` blocks in one namespace; returns (ran, skip notes)."""
    namespace: dict = {"__name__": f"docs:{name}"}
    ran, skipped = 0, []
    for line, source, reason in python_blocks(text):
        if reason is not None:
            skipped.append(f"{name}:{line}: {reason}")
            continue
        code = compile("\n" * (line - 1) + source, str(DOCS / name), "exec")
        exec(code, namespace)
        ran += 1
    return ran, skipped


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(DOCS)))
@pytest.mark.cases("first", 21)
def test_python_blocks_run(page):
    name = str(page.relative_to(DOCS))
    ran, skipped = run_page(name, page.read_text())
    for note in skipped:
        warnings.warn(f"not run: {note}", stacklevel=1)
    if not ran and skipped:
        pytest.skip(f"{len(skipped)} block(s) not run: " + "; ".join(skipped))


def test_every_fence_is_closed():
    """An unclosed fence would swallow the rest of a page, and its examples with it."""
    for page in PAGES:
        fences = re.findall(r"^```", page.read_text(), re.M)
        assert len(fences) % 2 == 0, f"{page.relative_to(ROOT)}: unbalanced ``` fences"


# User-facing text: what a reader of a clone sees. Tests are excluded (they check for these).
USER_FACING = [ROOT / "README.md", DOCS, ROOT / "co2jax", ROOT / "experiments"]
SUFFIXES = {".md", ".py", ".txt", ".toml", ".yaml", ".yml", ".json", ".sh", ".cfg"}
FORBIDDEN = [
    ("ALGORITHMS.md", re.compile(r"ALGORITHMS\.md")),
    ("../shared", re.compile(r"\.\./shared")),
    ("an absolute path", re.compile(r"(?<![\w.:/~])/(?:work|home|Users)/")),
]


def user_facing_files() -> list[Path]:
    files = []
    for entry in USER_FACING:
        paths = [entry] if entry.is_file() else sorted(entry.rglob("*"))
        files += [p for p in paths if p.is_file() and p.suffix in SUFFIXES]
    return files


def test_user_facing_text_cites_only_repository_files():
    found = []
    for path in user_facing_files():
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            for label, pattern in FORBIDDEN:
                if pattern.search(line):
                    found.append(f"{path.relative_to(ROOT)}:{number}: {label}: {line.strip()}")
    assert not found, "references outside the repository:\n" + "\n".join(found)


def test_python_block_collection():
    text = (
        "```python\na = 1\n```\n\n"
        "<!-- not-run: needs a TPU -->\n```python\nraise SystemExit\n```\n"
        "```text\nnot python\n```\n```python\nb = a + 1\n```\n"
    )
    assert [(s, r) for _, s, r in python_blocks(text)] == [
        ("a = 1\n", None),
        ("raise SystemExit\n", "needs a TPU"),
        ("b = a + 1\n", None),
    ]
    assert run_page("example.md", text) == (2, ["example.md:7: needs a TPU"])
