"""Assemble the gpu-check report: build info, each step's status and time,
the pytest summary and the benchmark tables, into REPORT_DIR/gpu_check.json."""

import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path


def main(report_dir: Path) -> int:
    steps = []
    for line in (report_dir / "steps.tsv").read_text().splitlines():
        name, rc, seconds = line.split("\t")
        steps.append({"name": name, "rc": int(rc), "seconds": int(seconds)})
    report = {"steps": steps}
    try:
        import dino_opt

        report["build_info"] = dino_opt.build_info()
    except Exception as e:  # the build failed: the report says so
        report["build_info"] = {"error": repr(e)}
    junit = report_dir / "pytest.xml"
    if junit.exists():
        suite = ET.parse(junit).getroot()
        suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
        report["pytest"] = {
            k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")
        }
        report["pytest"]["cuda_tests"] = [
            case.get("name")
            for case in suite.iter("testcase")
            if "cuda" in case.get("name", "").lower() and case.find("skipped") is None
        ]
    report["bench"] = {
        p.stem: json.loads(p.read_text()) for p in sorted(report_dir.glob("bench_*.json"))
    }
    (report_dir / "gpu_check.json").write_text(json.dumps(report, indent=2))
    failed = [s["name"] for s in steps if s["rc"] != 0]
    print(json.dumps({"steps": steps, "pytest": report.get("pytest")}, indent=1))
    print("gpu-check:", "FAILED " + ", ".join(failed) if failed else "all steps passed")
    return 1 if failed or len(steps) < 4 else 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1])))
