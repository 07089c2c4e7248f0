"""The benchmark tables of the README and docs/, rendered from the committed
JSON files (docs/results/*.json), so that the text cannot drift from the
measurement. A table sits between two markers:

    <!-- bench-table loss_cpu.json -->          (the file's "table")
    <!-- bench-table loss_cpu.json ibot -->     (its "ibot" part's "table")
    <!-- bench-table ema_cpu.json full -->      (every column, floors included)
    ... rendered rows ...
    <!-- /bench-table -->

and a figure in a sentence between two markers naming its path in the file
(keys and list indices, dot-separated) and its format:

    <!-- bench loss_cpu.json results.0.dino_opt_ms .1f -->19.9<!-- /bench -->

    python scripts/bench_tables.py            # rewrite the tables in place
    python scripts/bench_tables.py --check    # exit 1 naming the stale ones
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "docs" / "results"
DOCS = [
    ROOT / "README.md",
    *(
        ROOT / "docs" / f"{name}.md"
        for name in ("loss", "benchmarks", "ema", "loader", "checkpoints")
    ),
]
BLOCK = re.compile(
    r"(<!-- bench-table (?P<file>[\w.-]+)(?: (?!full\b)(?P<part>\w+))?(?P<full> full)? -->\n)"
    r"(?P<body>.*?)(<!-- /bench-table -->)",
    re.S,
)
FIGURE = re.compile(
    r"(<!-- bench (?P<file>[\w.-]+) (?P<path>[\w.]+) (?P<fmt>[\w.]+) -->)(?P<body>.*?)"
    r"(<!-- /bench -->)"
)
DROP = {"ours_MiB", "base_MiB", "ours/base_mem", "floor_ms", "ours/floor"}  # not in the text


def _cell(v: object) -> str:
    if isinstance(v, float):
        return f"{v:.2f}" if v < 100 else f"{v:.0f}"
    return str(v)


def render(file: str, part: str | None, full: bool = False) -> str:
    """The Markdown table of ``docs/results/<file>`` (its ``part``): every
    column with ``full``, else those but memory and floors."""
    data = json.loads((RESULTS / file).read_text())
    if part:
        data = data[part]
    table = data["table"]
    keep = [i for i, c in enumerate(table["columns"]) if full or c not in DROP]
    env = data.get("environment", {}).get("THP_MEM_ALLOC_ENABLE")
    lines = [
        "| " + " | ".join(table["columns"][i] for i in keep) + " |",
        "|" + "---|" * len(keep),
        *("| " + " | ".join(_cell(row[i]) for i in keep) + " |" for row in table["rows"]),
        "",
        f"*From `docs/results/{file}`{f' ({part})' if part else ''}: "
        + (f"median of {data['repeats']}, " if "repeats" in data else "")
        + f"{data['machine']['cpu']}, "
        f"{data['machine']['torch_threads']} threads"
        + ("" if "environment" not in data else f", THP_MEM_ALLOC_ENABLE={env or 'unset'}")
        + ".*",
    ]
    return "\n".join(lines) + "\n"


def figure(file: str, path: str, fmt: str) -> str:
    """The number at ``path`` (dot-separated keys and list indices) of
    ``docs/results/<file>``, formatted with ``fmt``."""
    value = json.loads((RESULTS / file).read_text())
    for key in path.split("."):
        value = value[int(key)] if isinstance(value, list) else value[key]
    return format(value, fmt)


def update(text: str) -> str:
    text = BLOCK.sub(
        lambda m: (
            m.group(1)
            + render(m.group("file"), m.group("part"), bool(m.group("full")))
            + m.group(6)
        ),
        text,
    )
    return FIGURE.sub(
        lambda m: (
            m.group(1) + figure(m.group("file"), m.group("path"), m.group("fmt")) + m.group(6)
        ),
        text,
    )


def stale(paths=DOCS) -> list[str]:
    """Files whose tables differ from the JSON."""
    return [str(p.relative_to(ROOT)) for p in paths if update(p.read_text()) != p.read_text()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true")
    args = parser.parse_args()
    if args.check:
        bad = stale()
        if bad:
            sys.exit(f"stale benchmark tables in {', '.join(bad)}: run scripts/bench_tables.py")
        return
    for p in DOCS:
        new = update(p.read_text())
        if new != p.read_text():
            p.write_text(new)
            print(f"updated {p.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
