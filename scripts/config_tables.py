"""The docs' tables of configuration keys, written from the fields' defaults
and help (:func:`dino_opt.config.key_table`), so that the text cannot drift
from the code. A table sits between two markers naming its keys (sections,
nested sections or keys):

    <!-- config-table recipe.gram -->
    ... rendered rows ...
    <!-- /config-table -->

    python scripts/config_tables.py            # rewrite the tables in place
    python scripts/config_tables.py --check    # exit 1 naming the stale ones
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from dino_opt.config import key_table

ROOT = Path(__file__).resolve().parent.parent
DOCS = sorted((ROOT / "docs").glob("*.md"))
BLOCK = re.compile(
    r"(<!-- config-table (?P<names>[\w. ]+?) -->\n)(?P<body>.*?)(<!-- /config-table -->)", re.S
)


def rendered(text: str) -> str:
    """``text`` with each marked table rendered afresh."""
    return BLOCK.sub(lambda m: m[1] + key_table(*m["names"].split()) + m[4], text)


def stale() -> list[str]:
    """The docs whose tables differ from what the fields give."""
    return [str(p.relative_to(ROOT)) for p in DOCS if rendered(p.read_text()) != p.read_text()]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only say which docs are stale")
    args = parser.parse_args(argv)
    if args.check:
        old = stale()
        for path in old:
            print(
                f"{path}: its config tables differ from the fields (run scripts/config_tables.py)"
            )
        return 1 if old else 0
    for path in DOCS:
        text = path.read_text()
        if rendered(text) != text:
            path.write_text(rendered(text))
            print(f"rewrote {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
