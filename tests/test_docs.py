"""docs/RELIABILITY.md is true to the suite: every row of its claim tables (those whose last
column is "test") names at least one test, and every test it names exists, so that a renamed
or deleted test cannot leave a claim standing unproven."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
_REF = re.compile(r"`([^`]*?test_\w+[^`]*)`")


def _claims(text: str) -> list[tuple[int, str]]:
    """(line number, last cell) of each row of the tables whose header's last cell is 'test';
    a row with another number of cells than its header is given as the cell ``"<cells>"``."""
    rows, in_claims, width = [], False, 0
    lines = text.splitlines()
    for i, line in enumerate(lines, 1):
        if not line.startswith("|"):
            in_claims = False
            continue
        if set(line) <= set("|-: "):
            continue
        cells = line.strip().strip("|").replace("\\|", "").split("|")
        if i < len(lines) and lines[i].startswith("|") and set(lines[i]) <= set("|-: "):
            in_claims, width = cells[-1].strip() == "test", len(cells)  # a header
            continue
        if in_claims:
            rows.append((i, cells[-1].strip() if len(cells) == width else "<cells>"))
    return rows


def problems(text: str, root: Path = ROOT) -> list[str]:
    """What is wrong with the claim tables of ``text``: rows naming no test, names that are
    not a test of the suite (``tests/a/test_x.py::test_y``, ``test_x.py::test_y``, a file, or
    ``test_y`` of the file named before it)."""
    files: dict[str, list[Path]] = {}
    for path in (root / "tests").rglob("test_*.py"):
        files.setdefault(path.name, []).append(path)
    found = []
    for line, cell in _claims(text):
        if cell == "<cells>":
            found.append(f"line {line}: the row has another number of cells than its header")
            continue
        refs = _REF.findall(cell)
        if not refs:
            found.append(f"line {line}: the row names no test")
        current: Path | None = None
        for ref in refs:
            ref = ref.split("[")[0].strip()  # a parametrized case: its function
            where, _, name = ref.rpartition("::") if "::" in ref else ("", "", ref)
            if ref.endswith(".py"):
                where, name = ref, ""
            if where:
                paths = [root / where] if "/" in where else files.get(where, [])
                paths = [p for p in paths if p.is_file()]
                if len(paths) != 1:
                    found.append(f"line {line}: {ref!r}: no single test file {where!r}")
                    current = None
                    continue
                current = paths[0]
            if current is None:
                found.append(f"line {line}: {ref!r}: a test name with no file before it")
            elif name and not re.search(rf"def {re.escape(name)}\(", current.read_text()):
                found.append(f"line {line}: {current.name} has no {name}")
    return found


def test_every_claim_names_tests_and_every_named_test_exists():
    text = (ROOT / "docs" / "RELIABILITY.md").read_text(encoding="utf-8")
    assert len(_claims(text)) >= 50  # (a parse that finds no table would pass vacuously)
    assert problems(text) == []


def test_the_checker_sees_a_missing_test_and_a_row_without_one():
    text = (
        "| case | what | test |\n|---|---|---|\n"
        "| a | b | `tests/test_docs.py::test_no_such_test`, `test_cli.py` |\n"
        "| c | d | - |\n"
        "| g | h | i | `test_docs.py` |\n"
        "| e | f | `test_docs.py::test_the_checker_sees_a_missing_test_and_a_row_without_one` |\n"
        "\n| process | MB |\n|---|---|\n| driver | 604 |\n"
    )
    assert problems(text) == [
        "line 3: test_docs.py has no test_no_such_test",
        "line 4: the row names no test",
        "line 5: the row has another number of cells than its header",
    ]
