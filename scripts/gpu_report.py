"""Assemble the gpu-check report into REPORT_DIR/gpu_check.json: build info,
each step's status and time, the pytest summaries and the benchmark tables.
Exits non-zero when a step failed, or when a GPU was present but no CUDA test ran."""

import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

EXPECTED_STEPS = {"build", "ctest", "pytest_cuda", "pytest_rest"}


def junit_summary(path: Path) -> dict | None:
    if not path.exists():
        return None
    root = ET.parse(path).getroot()
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    summary = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    summary["passed"] = (
        summary["tests"] - summary["failures"] - summary["errors"] - summary["skipped"]
    )
    return summary


def main(scratch: Path, report_dir: Path) -> int:
    steps = []
    for line in (scratch / "steps.tsv").read_text().splitlines():
        name, rc, seconds = line.split("\t")
        steps.append({"name": name, "rc": int(rc), "seconds": int(seconds)})
    report = {"steps": steps}
    try:
        import dino_opt

        report["build_info"] = dino_opt.build_info()
    except Exception as e:  # the build failed: the report says so
        report["build_info"] = {"error": repr(e)}
    report["pytest_cuda"] = junit_summary(scratch / "pytest_cuda.xml")
    report["pytest_rest"] = junit_summary(scratch / "pytest_rest.xml")
    report["bench"] = {
        p.stem: json.loads(p.read_text()) for p in sorted(report_dir.glob("bench_*.json"))
    }
    (report_dir / "gpu_check.json").write_text(json.dumps(report, indent=2) + "\n")

    problems = [f"step {s['name']} failed (rc {s['rc']})" for s in steps if s["rc"] != 0]
    problems += [f"step {name} did not run" for name in EXPECTED_STEPS - {s["name"] for s in steps}]
    cuda = report["pytest_cuda"]
    if report["build_info"].get("cuda_available") and cuda and cuda["passed"] == 0:
        problems.append("a GPU is present but no CUDA test ran")
    print(json.dumps({k: report[k] for k in ("steps", "pytest_cuda", "pytest_rest")}, indent=1))
    print("gpu-check:", "; ".join(problems) if problems else "all steps passed")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1]), Path(sys.argv[2])))
