"""Checks that built shared objects and executables load with nothing but the
carried prefix, torch's own libraries and the C/C++ runtime.

For each file, every library it names (DT_NEEDED) is resolved as the dynamic
linker of a process that has already imported torch would resolve it (ldd with
torch's library folders on LD_LIBRARY_PATH, then the process's own LD_LIBRARY_PATH,
the file's own RUNPATH after them)
and is classified:

  prefix   under --prefix (then its own needs are checked the same way)
  torch    in a folder that torch's own libraries load from, or the very file
           that torch itself loads under that name
  built    another of the files being checked (libdino_opt_core.so)
  runtime  glibc, libstdc++, libgcc_s, libgomp
  other    anything else (a system library the GPU machine may not have)

Any `other` library, and any library of the whole closure that ldd cannot
find, is a violation: the script prints them and exits 1. With --json the
classification is written out for the report.

    python scripts/check_closure.py --prefix .gpu-prefix --json closure.json build/x/*.so
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import torch

RUNTIME = {
    "linux-vdso.so.1",
    "ld-linux-x86-64.so.2",
    "libc.so.6",
    "libm.so.6",
    "libdl.so.2",
    "libpthread.so.0",
    "librt.so.1",
    "libutil.so.1",
    "libstdc++.so.6",
    "libgcc_s.so.1",
    "libgomp.so.1",
}
LDD_LINE = re.compile(r"^\s*(\S+)\s+=>\s+(not found|\S+)")
LDD_DIRECT = re.compile(r"^\s*(/\S+)\s+\(0x")  # the dynamic linker: a path, no "=>"


def needed(path: Path) -> list[str]:
    """The DT_NEEDED entries of an ELF file, in order."""
    out = subprocess.run(
        ["readelf", "-d", str(path)], capture_output=True, text=True, check=True
    ).stdout
    return re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", out)


def resolve(path: Path, env: dict) -> dict[str, str | None]:
    """soname -> resolved path (None when not found) over the whole closure."""
    out = subprocess.run(
        ["ldd", str(path)], capture_output=True, text=True, env=env, check=False
    ).stdout
    found = {}
    for line in out.splitlines():
        if m := LDD_LINE.match(line):
            found[m.group(1)] = None if m.group(2) == "not found" else m.group(2)
        elif m := LDD_DIRECT.match(line):
            found[Path(m.group(1)).name] = m.group(1)
    return found


def normal(path: str | Path) -> Path:
    """The path with `..` folded but symbolic links kept (a link may be how an
    environment holds torch's libraries)."""
    return Path(os.path.normpath(os.path.abspath(path)))


def torch_libraries() -> tuple[list[Path], dict[str, Path]]:
    """Where torch's own libraries load from: torch/lib and every folder of its
    Python environment that libtorch_cuda.so (or libtorch.so) loads from (e.g.
    site-packages/nvidia/*/lib), and that library's whole closure (soname ->
    path), which a machine where torch runs has by definition."""
    lib = normal(Path(torch.__file__).parent / "lib")
    env_root = lib.parent.parent
    dirs, closure = [lib], {}
    for name in ("libtorch_cuda.so", "libtorch.so"):
        if (lib / name).exists():
            closure = {s: normal(p) for s, p in resolve(lib / name, dict(os.environ)).items() if p}
            break
    for path in closure.values():
        if path.parent.is_relative_to(env_root) and path.parent not in dirs:
            dirs.append(path.parent)
    return dirs, closure


class Checker:
    def __init__(self, prefix: Path, files: list[Path]):
        self.prefix = prefix.resolve()
        self.torch_dirs, self.torch_closure = torch_libraries()
        self.built = {f.name for f in files}
        self.env = dict(os.environ)
        # the process's own LD_LIBRARY_PATH after torch's folders, as it loads
        inherited = [os.environ["LD_LIBRARY_PATH"]] if os.environ.get("LD_LIBRARY_PATH") else []
        self.env["LD_LIBRARY_PATH"] = ":".join([*map(str, self.torch_dirs), *inherited])

    def kind(self, soname: str, path: str | None) -> str:
        if path is None:
            return "not found"
        real = Path(path).resolve()
        if real.is_relative_to(self.prefix):
            return "prefix"
        if soname in self.built:
            return "built"
        if soname in RUNTIME:
            return "runtime"
        if normal(path).parent in self.torch_dirs or self.torch_closure.get(soname) == normal(path):
            return "torch"
        return "other"

    def check(self, path: Path, seen: set[Path] | None = None) -> dict:
        """The classified needs of `path`, recursing into prefix libraries."""
        seen = seen if seen is not None else set()
        seen.add(path.resolve())
        closure = resolve(path, self.env)
        needs = []
        for soname in needed(path):
            resolved = closure.get(soname)
            entry = {"soname": soname, "path": resolved, "kind": self.kind(soname, resolved)}
            if entry["kind"] == "prefix" and Path(resolved).resolve() not in seen:
                entry["needs"] = self.check(Path(resolved), seen)["needs"]
            needs.append(entry)
        missing = sorted(s for s, p in closure.items() if p is None)
        return {"file": str(path), "needs": needs, "closure_not_found": missing}


def violations(report: dict) -> list[str]:
    out = []

    def walk(needs, owner):
        for n in needs:
            if n["kind"] in ("other", "not found"):
                out.append(f"{owner}: {n['soname']} -> {n['path'] or 'not found'} ({n['kind']})")
            walk(n.get("needs", []), n["soname"])

    walk(report["needs"], Path(report["file"]).name)
    out += [f"{Path(report['file']).name}: {s} not found" for s in report["closure_not_found"]]
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prefix", type=Path, required=True, help="the carried prefix")
    parser.add_argument("--json", type=Path, help="write the classification here")
    parser.add_argument("files", type=Path, nargs="+", help="shared objects and executables")
    args = parser.parse_args(argv)
    missing = [str(f) for f in args.files if not f.is_file()]
    if missing:
        print(f"check_closure: no such file: {', '.join(missing)}", file=sys.stderr)
        return 2
    checker = Checker(args.prefix, args.files)
    reports = [checker.check(f) for f in args.files]
    problems = [v for r in reports for v in violations(r)]
    result = {
        "prefix": str(checker.prefix),
        "torch_dirs": [str(d) for d in checker.torch_dirs],
        "files": reports,
        "violations": problems,
    }
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    for r in reports:
        kinds = sorted({n["kind"] for n in r["needs"]})
        print(f"{Path(r['file']).name}: {len(r['needs'])} libraries ({', '.join(kinds)})")
    for p in problems:
        print("  NOT CARRIED:", p)
    print("closure:", "ok" if not problems else f"{len(problems)} violation(s)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
