"""Places to look: files and functions of the package past the size guide.

A guide, never a failure: a long file or function is a place where concerns
may have grown together, and the fix is a split where they part, not a
compression to fit a number (docs/design.md, "The house's rules").
`make lint` prints the list; this script always exits 0.
"""

import argparse
import ast
from pathlib import Path

FILE_LINES = 1000
FUNCTION_LINES = 80


def long_functions(path: Path, limit: int):
    """(qualified name, first line, number of lines) of every function in
    ``path`` longer than ``limit`` lines, nested ones included."""
    tree = ast.parse(path.read_text(), str(path))

    def walk(node, prefix):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = f"{prefix}{child.name}"
                if not isinstance(child, ast.ClassDef):
                    n = child.end_lineno - child.lineno + 1
                    if n > limit:
                        yield name, child.lineno, n
                yield from walk(child, f"{name}.")

    yield from walk(tree, "")


def places_to_look(root: Path, file_lines: int = FILE_LINES, function_lines: int = FUNCTION_LINES):
    """Lines of the report: files past ``file_lines``, functions past
    ``function_lines``, longest first."""
    files, functions = [], []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root.parent)
        n = len(path.read_text().splitlines())
        if n > file_lines:
            files.append((n, f"{rel}: {n} lines"))
        for name, line, count in long_functions(path, function_lines):
            functions.append((count, f"{rel}:{line}: {name}, {count} lines"))
    return [text for _, text in sorted(files, reverse=True)], [
        text for _, text in sorted(functions, reverse=True)
    ]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("root", type=Path, nargs="?", default=Path("python/dino_opt"))
    parser.add_argument("--file-lines", type=int, default=FILE_LINES)
    parser.add_argument("--function-lines", type=int, default=FUNCTION_LINES)
    args = parser.parse_args(argv)
    files, functions = places_to_look(args.root, args.file_lines, args.function_lines)
    print(
        f"size guide (a place to look, not a failure): {len(files)} files past "
        f"{args.file_lines} lines, {len(functions)} functions past {args.function_lines} lines"
    )
    for line in files + functions:
        print(f"  {line}")


if __name__ == "__main__":
    main()
