"""The torch that a build of dino_opt compiles against, found once for both
sides of the build:

- scikit-build-core's ``[[tool.dynamic-metadata]]`` provider: the wheel's
  dependencies with torch pinned to that version's series (``torch==2.14.*``),
  since the compiled core only loads against the torch ABI it was built for;
- CMake (``python torch_pin.py --cmake``): torch's CMake prefix and its CUDA
  version, one per line.

Inside pip's build isolation the build's Python cannot import the torch the
user installed; the query then runs the same interpreter isolated from pip's
overlay (``-I``), which sees that environment's own packages. Without any
torch, the build stops at once with one line saying what to run.
"""

from __future__ import annotations

import json
import subprocess
import sys

__all__ = ["dynamic_metadata", "find_torch", "torch_requirement"]

_QUERY = (
    "import json, torch; print(json.dumps({'version': torch.__version__, "
    "'cmake_prefix_path': torch.utils.cmake_prefix_path, 'cuda': torch.version.cuda or ''}))"
)


class TorchNotFound(RuntimeError):
    pass


def find_torch() -> dict:
    """``version``, ``cmake_prefix_path`` and ``cuda`` of the torch this
    interpreter imports, as run or else outside pip's build isolation."""
    for flags in ([], ["-I"]):
        run = subprocess.run([sys.executable, *flags, "-c", _QUERY], capture_output=True, text=True)
        if run.returncode == 0:
            return json.loads(run.stdout.strip().splitlines()[-1])
    raise TorchNotFound(
        f"dino_opt compiles against an installed torch and {sys.executable} has none: run "
        f"'{sys.executable} -m pip install torch' (the build you will train with), then repeat "
        "this install with --no-build-isolation, e.g. 'pip install --no-build-isolation .'"
    )


def torch_requirement(version: str) -> str:
    """``torch==MAJOR.MINOR.*`` of a version such as ``2.14.1+cu130``."""
    major, minor = version.split("+")[0].split(".")[:2]
    return f"torch=={major}.{minor}.*"


def dynamic_metadata(settings: dict, project: dict) -> dict:
    """The ``[[tool.dynamic-metadata]]`` hook: ``dependencies``, the entry's
    ``requires`` and the torch pin."""
    try:
        torch = find_torch()
    except TorchNotFound as e:
        print(e, file=sys.stderr)
        raise SystemExit(1) from None
    return {"dependencies": [*settings.get("requires", []), torch_requirement(torch["version"])]}


def main(argv: list[str]) -> int:
    if argv != ["--cmake"]:
        print("usage: torch_pin.py --cmake", file=sys.stderr)
        return 2
    try:
        torch = find_torch()
    except TorchNotFound as e:
        print(e, file=sys.stderr)
        return 1
    print(torch["cmake_prefix_path"])
    print(torch["cuda"])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
