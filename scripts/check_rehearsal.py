"""Judges the report of `make gpu-rehearsal` (scripts/gpu_rehearsal.sh): the
GPU check ran here, without a GPU, as it would run there.

It prints the plan: each step's seconds here and its cap there, and the sum of
the caps of the `proof` stage, which must fit one call (PROOF_CAP_S). It
passes when that sum fits, every requested stage recorded its steps and each
passed; the
closure check found nothing but the carried prefix, torch's libraries and the
C/C++ runtime, and libjpeg-turbo came from the prefix; dino_opt._C was loaded
from the rehearsal's own environment; the build is JPEG-only, and its
CMakeCache.txt found libjpeg-turbo and GoogleTest in the carried prefix and no
OpenCV; the C++ tests ran and passed (with a carried build: its own test
program); the CUDA tests were collected and all
skipped (no GPU here); every benchmark's JSON was embedded; and the carried
files fit the device's 64 MiB.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

CARRY_LIMIT = 64 << 20
PROOF_CAP_S = 480  # one call of at most 8 minutes on a cold GPU machine
STAGE_STEPS = {
    "build": ["closure", "import"],
    "carry": ["wheel"],
    "proof": [
        "closure",
        "import",
        "doctor",
        "cpp_tests",
        "pytest_cuda",
        "bench_train",
        "bench_loss",
        "bench_ema",
    ],
    "rest": [
        "bench_profiler",
        "bench_photometric",
        "bench_loader",
        "presets",
        "fsdp_job",
        "bench_checkpoint",
        "bench_head",
    ],
    "step": ["closure", "import", "bench_step"],
}
# The cache entries that say where the carried dependencies were found.
CARRIED = ("TURBOJPEG_INCLUDE_DIR", "TURBOJPEG_LIBRARY", "GTest_DIR")
CACHE_ENTRY = re.compile(r"^([A-Za-z_]\w*):\w+=(.*)$", re.M)


def step_problems(report: dict, stages: list[str]) -> list[str]:
    problems = []
    by_stage = {}
    for s in report.get("steps", []):
        by_stage.setdefault(s["stage"], {})[s["name"]] = s
        if s["status"] != "pass":
            problems.append(f"step {s['stage']}/{s['name']}: {s['status']}")
    for stage in stages:
        ran = by_stage.get(stage, {})
        problems += [
            f"stage {stage}: step {n} did not run" for n in STAGE_STEPS[stage] if n not in ran
        ]
    return problems


def test_problems(report: dict) -> list[str]:
    problems = []
    steps = {s["name"]: s for s in report.get("steps", [])}
    ctest = steps.get("cpp_tests", {}).get("counts")
    if not ctest or ctest["tests"] == 0 or ctest["failed"] or ctest["errors"]:
        problems.append(f"C++ tests: {ctest}")
    cuda = steps.get("pytest_cuda", {}).get("counts")
    if not cuda or cuda["tests"] == 0 or cuda["skipped"] != cuda["tests"]:
        problems.append(f"CUDA tests must all be collected and skipped without a GPU: {cuda}")
    return problems


def build_problems(report: dict, build_dir: Path, venv: Path, prefix: Path) -> list[str]:
    problems = []
    closure = report.get("closure", {})
    if closure.get("violations"):
        problems += [f"closure: {v}" for v in closure["violations"]]
    kinds = {n["soname"]: n["kind"] for f in closure.get("files", []) for n in f["needs"]}
    if kinds.get("libturbojpeg.so.0") != "prefix":
        problems.append(f"libturbojpeg.so.0 resolved as {kinds.get('libturbojpeg.so.0')!r}")
    info = report.get("build_info", {})
    if info.get("image_formats") != ["JPEG"]:
        problems.append(f"the GPU build must be JPEG-only, it reads {info.get('image_formats')}")
    module = Path(info.get("native_module", "")).resolve()
    if not module.is_relative_to(venv.resolve()):
        problems.append(f"dino_opt._C was loaded from {module}, not from {venv}")
    cache = build_dir / "CMakeCache.txt"
    if not cache.exists():
        problems.append(f"{cache} is missing")
    else:
        entries = dict(CACHE_ENTRY.findall(cache.read_text()))
        prefix = prefix.resolve()
        problems += [
            f"{cache.name}: {name} is {entries.get(name)!r}, not in the carried prefix {prefix}"
            for name in CARRIED
            if not Path(entries.get(name, "/")).resolve().is_relative_to(prefix)
        ]
        problems += [
            f"{cache.name}: {name} found OpenCV at {value}"
            for name, value in entries.items()
            if name.startswith("OPENCV_") and value and not value.endswith("NOTFOUND")
        ]
    return problems


def plan_problems(report: dict) -> list[str]:
    """Prints each step's seconds here against its cap there; the caps of
    `proof` must add up to at most PROOF_CAP_S."""
    print(f"  {'stage':<8} {'step':<18} {'here s':>7} {'cap s':>6}")
    for s in report.get("steps", []):
        here, cap = s.get("seconds", "?"), s.get("cap", "?")
        print(f"  {s['stage']:<8} {s['name']:<18} {here:>7} {cap:>6}")
    proof = [s for s in report.get("steps", []) if s["stage"] == "proof"]
    if not proof:
        return []
    total = sum(s.get("cap", 0) for s in proof)
    print(f"  proof: the caps add up to {total} s (at most {PROOF_CAP_S} s)")
    missing = [s["name"] for s in proof if "cap" not in s]
    problems = [f"proof: steps without a cap: {missing}"] if missing else []
    if total > PROOF_CAP_S:
        problems.append(f"proof: the caps add up to {total} s, over one call's {PROOF_CAP_S} s")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("report_dir", type=Path)
    parser.add_argument("--stages", default="build,proof,rest")
    parser.add_argument("--build-dir", type=Path, required=True)
    parser.add_argument("--venv", type=Path, required=True, help="the rehearsal's environment")
    parser.add_argument("--prefix", type=Path, required=True, help="the carried prefix")
    parser.add_argument("--carried-bytes", type=int, required=True)
    args = parser.parse_args(argv)
    stages = args.stages.split(",")
    report = json.loads((args.report_dir / "gpu_check.json").read_text())
    problems = step_problems(report, stages)
    problems += build_problems(report, args.build_dir, args.venv, args.prefix)
    problems += plan_problems(report)
    if "proof" in stages:
        problems += test_problems(report)
    for stage in ("proof", "rest", "step"):
        if stage in stages:
            benches = [n for n in STAGE_STEPS[stage] if n.startswith("bench_")]
            problems += [
                f"bench {n}: no JSON in the report"
                for n in benches
                if n not in report.get("bench", {})
            ]
    if args.carried_bytes > CARRY_LIMIT:
        problems.append(f"carried {args.carried_bytes} bytes, over the device's 64 MiB")
    total = sum(s.get("seconds", 0) for s in report.get("steps", []))
    print(f"rehearsal: {len(report.get('steps', []))} steps, {total} s of steps")
    for p in problems:
        print("  PROBLEM:", p)
    print("gpu-rehearsal:", "passed" if not problems else f"{len(problems)} problem(s)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
