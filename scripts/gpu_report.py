"""The GPU check's report, REPORT_DIR/gpu_check.json, rewritten after every
step so that a call killed at its time limit still brings back what ran.

    gpu_report.py start  REPORT_DIR STAGE STEP
    gpu_report.py record REPORT_DIR STAGE STEP RC SECONDS [--cap S] [--junit F] [--embed KEY=F]...
    gpu_report.py verdict REPORT_DIR

`start` marks a step as running; `record` replaces that mark with the exit
status (0 pass, 124/137 timeout, -1 not run, else fail), the seconds and the
step's time cap, the pass/fail/skip counts and failing tests of a JUnit file
(pytest or GoogleTest; tests skipped because the run's time cap was reached
are counted as not_run), and embeds JSON files (bench tables, build info, the closure
check) under dotted keys. `verdict` prints the summary and exits 1 when a
step failed, or when a GPU was present but no CUDA test passed.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

REPORT = "gpu_check.json"
MAX_FAILURES = 30


def status_of(rc: int) -> str:
    if rc == 0:
        return "pass"
    if rc in (124, 137):
        return "timeout"
    if rc == -1:
        return "not run"
    return "fail"


def junit_counts(path: Path) -> dict:
    """Counts over every <testcase> of a pytest or GoogleTest JUnit file, and
    the failing ones (name and the start of the message)."""
    counts = {"tests": 0, "passed": 0, "failed": 0, "errors": 0, "skipped": 0, "not_run": 0}
    failures = []
    for case in ET.parse(path).getroot().iter("testcase"):
        counts["tests"] += 1
        name = f"{case.get('classname', '')}::{case.get('name', '')}"
        problem = case.find("failure") if case.find("failure") is not None else case.find("error")
        if problem is not None:
            counts["failed" if problem.tag == "failure" else "errors"] += 1
            if len(failures) < MAX_FAILURES:
                text = problem.get("message") or problem.text or ""
                failures.append({"test": name, "message": text[:500]})
        elif case.find("skipped") is not None or case.get("result") == "skipped":
            skipped = case.find("skipped")
            text = "" if skipped is None else (skipped.get("message") or "")
            counts["not_run" if "not run:" in text else "skipped"] += 1
        else:
            counts["passed"] += 1
    return {"counts": counts, "failures": failures}


def load(report_dir: Path) -> dict:
    path = report_dir / REPORT
    if path.exists():
        return json.loads(path.read_text())
    return {"host": socket.gethostname(), "steps": []}


def save(report_dir: Path, report: dict) -> None:
    report["updated"] = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    tmp = report_dir / (REPORT + ".tmp")
    tmp.write_text(json.dumps(report, indent=1) + "\n")
    os.replace(tmp, report_dir / REPORT)


def set_dotted(report: dict, key: str, value) -> None:
    *parents, last = key.split(".")
    node = report
    for p in parents:
        node = node.setdefault(p, {})
    node[last] = value


def drop_running(report: dict, stage: str, step: str) -> None:
    report["steps"] = [
        s
        for s in report["steps"]
        if not (s["stage"] == stage and s["name"] == step and s["status"] == "running")
    ]


def start(args) -> None:
    report = load(args.report_dir)
    drop_running(report, args.stage, args.step)
    report["steps"].append({"stage": args.stage, "name": args.step, "status": "running"})
    save(args.report_dir, report)


def record(args) -> None:
    report = load(args.report_dir)
    drop_running(report, args.stage, args.step)
    entry = {
        "stage": args.stage,
        "name": args.step,
        "status": status_of(args.rc),
        "rc": args.rc,
        "seconds": args.seconds,
    }
    if args.cap is not None:
        entry["cap"] = args.cap
    if args.junit and args.junit.exists():
        try:
            entry.update(junit_counts(args.junit))
        except ET.ParseError as e:  # a run killed while writing it
            entry["junit_error"] = f"{args.junit.name}: {e}"
    for spec in args.embed:
        key, _, file = spec.partition("=")
        path = Path(file)
        if path.exists():
            try:
                set_dotted(report, key, json.loads(path.read_text()))
            except json.JSONDecodeError as e:
                entry.setdefault("embed_errors", []).append(f"{path.name}: {e}")
    report["steps"].append(entry)
    save(args.report_dir, report)


def problems_of(report: dict) -> list[str]:
    problems = [
        f"{s['stage']}/{s['name']}: {s['status']}" + (f" (rc {s['rc']})" if "rc" in s else "")
        for s in report["steps"]
        if s["status"] != "pass"
    ]
    problems += [
        f"{s['stage']}/{s['name']}: {s['counts']['not_run']} tests not run (the time cap)"
        for s in report["steps"]
        if s.get("counts", {}).get("not_run")
    ]
    cuda_tests = [s for s in report["steps"] if s["name"] == "pytest_cuda" and "counts" in s]
    if report.get("build_info", {}).get("cuda_available") and cuda_tests:
        if cuda_tests[-1]["counts"]["passed"] == 0:
            problems.append("a GPU is present but no CUDA test passed")
    return problems


def verdict(args) -> int:
    report = load(args.report_dir)
    for s in report["steps"]:
        counts = s.get("counts")
        tests = " ".join(f"{k} {v}" for k, v in counts.items() if k != "tests") if counts else ""
        print(
            f"  {s['stage']:<10} {s['name']:<18} {s['status']:<8}",
            f"{s.get('seconds', '?'):>5} s  {tests}",
        )
        for f in s.get("failures", [])[:10]:
            print(f"      FAILED {f['test']}: {f['message'][:200]}")
    problems = problems_of(report)
    print("gpu-check:", "; ".join(problems) if problems else "every step passed")
    return 1 if problems else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name in ("start", "record", "verdict"):
        p = sub.add_parser(name)
        p.add_argument("report_dir", type=Path)
        if name != "verdict":
            p.add_argument("stage")
            p.add_argument("step")
        if name == "record":
            p.add_argument("rc", type=int)
            p.add_argument("seconds", type=int)
            p.add_argument("--cap", type=int, help="the step's time cap in seconds")
            p.add_argument("--junit", type=Path)
            p.add_argument("--embed", action="append", default=[], metavar="KEY=FILE")
    args = parser.parse_args(argv)
    args.report_dir.mkdir(parents=True, exist_ok=True)
    if args.command == "verdict":
        return verdict(args)
    (start if args.command == "start" else record)(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
