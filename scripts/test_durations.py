"""Where the test suite's seconds go, read from pytest's JUnit XML
(``pytest --junitxml FILE``): the slowest tests, and each file's total.

    python scripts/test_durations.py FILE [--slowest N] [--files N] [--markdown]

A test's time in the XML is its setup, call and teardown together, so a
module fixture's cost is counted in the first test that used it. Files are
summed over their tests; with pytest-xdist they ran on several workers at
once, so the files' sum is more than the run's wall time.
"""

from __future__ import annotations

import argparse
import sys
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path


def _file_of(classname: str) -> str:
    """``tests_py.test_x.TestClass`` -> ``test_x.py``: the test module's file."""
    parts = classname.split(".")
    modules = [p for p in parts if p.startswith("test_")]
    return f"{modules[0] if modules else parts[-1]}.py"


def read_cases(path: Path) -> list[dict]:
    """Every test case of the JUnit file ``path``: its file, name, seconds
    and outcome (passed, failed, error or skipped)."""
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError) as e:
        raise SystemExit(f"test_durations: cannot read {path}: {e}") from e
    cases = []
    for case in root.iter("testcase"):
        outcome = "passed"
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                outcome = child.tag if child.tag != "failure" else "failed"
        cases.append(
            {
                "file": _file_of(case.get("classname", "")),
                "name": case.get("name", "?"),
                "seconds": float(case.get("time") or 0.0),
                "outcome": outcome,
            }
        )
    return cases


def by_file(cases: list[dict]) -> list[tuple[str, int, float]]:
    """(file, tests, seconds) per file, the slowest first."""
    totals: dict[str, list] = defaultdict(lambda: [0, 0.0])
    for c in cases:
        totals[c["file"]][0] += 1
        totals[c["file"]][1] += c["seconds"]
    return sorted(((f, n, s) for f, (n, s) in totals.items()), key=lambda r: -r[2])


def render(rows: list[tuple], header: tuple[str, ...], markdown: bool) -> str:
    if markdown:
        lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        lines += ["| " + " | ".join(str(x) for x in r) + " |" for r in rows]
        return "\n".join(lines)
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows, strict=False)]
    fmt = "  ".join(f"{{:>{w}}}" if i else f"{{:<{w}}}" for i, w in enumerate(widths))
    return "\n".join(fmt.format(*map(str, r)) for r in [header, *rows])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("junit", type=Path)
    parser.add_argument("--slowest", type=int, default=50, help="tests listed (default 50)")
    parser.add_argument("--files", type=int, default=0, help="files listed (default all)")
    parser.add_argument("--markdown", action="store_true", help="Markdown tables")
    args = parser.parse_args(argv)
    cases = read_cases(args.junit)
    count = {
        k: sum(c["outcome"] == k for c in cases) for k in ("passed", "failed", "error", "skipped")
    }
    total = sum(c["seconds"] for c in cases)
    print(
        f"{len(cases)} tests ({', '.join(f'{v} {k}' for k, v in count.items())}), "
        f"{total:.0f} s summed over workers"
    )
    slow = sorted(cases, key=lambda c: -c["seconds"])[: args.slowest]
    rows = [(f"{c['file']}::{c['name']}", f"{c['seconds']:.1f}") for c in slow]
    print(f"\nslowest {len(rows)} tests:")
    print(render(rows, ("test", "s"), args.markdown))
    files = by_file(cases)
    files = files[: args.files] if args.files else files
    print(f"\n{len(files)} files by seconds:")
    print(render([(f, n, f"{s:.1f}") for f, n, s in files], ("file", "tests", "s"), args.markdown))
    return 0


if __name__ == "__main__":
    sys.exit(main())
