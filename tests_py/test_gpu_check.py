"""The GPU check's tools (scripts/): unpacking .deb files without dpkg, the
report rewritten after every step, the ldd closure check, the rehearsal's
verdict, and gpu_check.sh's stage budget. The whole check runs in CI as
`make gpu-rehearsal`; these tests pin the pieces, including the failures the
rehearsal never meets."""

import importlib.util
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import dino_opt
import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = ROOT / "scripts"


def load(name):
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


unpack_debs = load("unpack_debs")
gpu_report = load("gpu_report")
check_closure = load("check_closure")
check_rehearsal = load("check_rehearsal")


# ----------------------------------------------------------------- unpack_debs


def ar_member(name: str, payload: bytes) -> bytes:
    header = f"{name + '/':<16}{0:<12}{0:<6}{0:<6}{100644:<8}{len(payload):<10}`\n"
    return header.encode() + payload + (b"\n" if len(payload) % 2 else b"")


def tar_xz(files: dict, links: dict) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:xz") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo("./" + name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        for name, target in links.items():
            info = tarfile.TarInfo("./" + name)
            info.type, info.linkname = tarfile.SYMTYPE, target
            tar.addfile(info)
    return buf.getvalue()


def make_deb(path: Path, files: dict, links: dict) -> Path:
    path.write_bytes(
        b"!<arch>\n"
        + ar_member("debian-binary", b"2.0\n")
        + ar_member("control.tar.xz", tar_xz({"control": b"Package: x\n"}, {}))
        + ar_member("data.tar.xz", tar_xz(files, links))
    )
    return path


def test_unpack_debs_extracts_the_data_files_and_links(tmp_path):
    deb = make_deb(
        tmp_path / "libx_1_amd64.deb",
        {"usr/lib/libx.so.0.1": b"\x7fELF odd-sized", "usr/include/x.h": b"int x;\n"},
        {"usr/lib/libx.so.0": "libx.so.0.1"},
    )
    prefix = tmp_path / "prefix"
    assert unpack_debs.main([str(prefix), str(deb)]) == 0
    assert (prefix / "usr/include/x.h").read_bytes() == b"int x;\n"
    assert (prefix / "usr/lib/libx.so.0").is_symlink()
    assert (prefix / "usr/lib/libx.so.0").read_bytes() == b"\x7fELF odd-sized"
    assert not (prefix / "control").exists()  # control files are not unpacked
    if shutil.which("dpkg"):  # the same files as dpkg -x
        other = tmp_path / "dpkg"
        subprocess.run(["dpkg", "-x", str(deb), str(other)], check=True)
        listing = sorted(p.relative_to(other) for p in other.rglob("*"))
        assert listing == sorted(p.relative_to(prefix) for p in prefix.rglob("*"))


def test_unpack_debs_refuses_what_is_not_a_package(tmp_path, capsys):
    bad = tmp_path / "bad.deb"
    bad.write_bytes(b"PK\x03\x04 a zip file")
    assert unpack_debs.main([str(tmp_path / "p"), str(bad)]) == 1
    assert "bad.deb: not a Debian package" in capsys.readouterr().err
    cut = tmp_path / "cut.deb"
    cut.write_bytes(make_deb(tmp_path / "full.deb", {"a": b"x" * 100}, {}).read_bytes()[:-40])
    assert unpack_debs.main([str(tmp_path / "p"), str(cut)]) == 1
    assert "cut short" in capsys.readouterr().err


# ----------------------------------------------------------------- gpu_report

PYTEST_XML = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest">
<testcase classname="t.a" name="test_ok" time="0.1"/>
<testcase classname="t.a" name="test_cuda"><skipped message="needs a CUDA device"/></testcase>
<testcase classname="t.a" name="test_bad"><failure message="assert 1 == 2">tb</failure></testcase>
<testcase classname="t.a" name="test_err"><error message="fixture broke"/></testcase>
<testcase classname="t.a" name="test_late"><skipped message="not run: time cap"/></testcase>
</testsuite></testsuites>"""
GTEST_XML = """<?xml version="1.0" encoding="UTF-8"?>
<testsuites tests="3" failures="0" disabled="0" errors="0" name="AllTests">
<testsuite name="Memory" tests="3">
<testcase name="A" status="run" result="completed" classname="Memory"/>
<testcase name="B" result="skipped" classname="Memory"><skipped message="x"/></testcase>
<testcase name="C" status="run" result="completed" classname="Memory"/></testsuite></testsuites>"""


def report_cli(*args) -> int:
    return gpu_report.main([str(a) for a in args])


def test_report_counts_junit_of_pytest_and_googletest(tmp_path):
    (tmp_path / "p.xml").write_text(PYTEST_XML)
    (tmp_path / "g.xml").write_text(GTEST_XML)
    report_cli(
        "record",
        tmp_path,
        "proof",
        "pytest_cuda",
        1,
        12,
        "--cap",
        110,
        "--junit",
        tmp_path / "p.xml",
    )
    report_cli("record", tmp_path, "proof", "cpp_tests", 0, 3, "--junit", tmp_path / "g.xml")
    steps = json.loads((tmp_path / "gpu_check.json").read_text())["steps"]
    assert steps[0]["counts"] == {
        "tests": 5,
        "passed": 1,
        "failed": 1,
        "errors": 1,
        "skipped": 1,
        "not_run": 1,
    }
    assert steps[0]["failures"][0] == {
        "test": "t.a::test_bad",
        "message": "assert 1 == 2",
    }
    assert steps[0]["status"] == "fail" and steps[0]["seconds"] == 12 and steps[0]["cap"] == 110
    assert "cap" not in steps[1]
    assert steps[1]["counts"] == {
        "tests": 3,
        "passed": 2,
        "failed": 0,
        "errors": 0,
        "skipped": 1,
        "not_run": 0,
    }


def test_report_marks_a_running_step_and_replaces_the_mark(tmp_path):
    report_cli("start", tmp_path, "bench", "bench_loss")
    # A call killed now brings back a report that names the step it was in.
    (step,) = json.loads((tmp_path / "gpu_check.json").read_text())["steps"]
    assert step == {"stage": "bench", "name": "bench_loss", "status": "running"}
    (tmp_path / "bench_loss.json").write_text(json.dumps({"rows": [1, 2]}))
    report_cli(
        "record",
        tmp_path,
        "bench",
        "bench_loss",
        124,
        90,
        "--embed",
        f"bench.bench_loss={tmp_path / 'bench_loss.json'}",
    )
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert [s["status"] for s in report["steps"]] == ["timeout"]
    assert report["bench"]["bench_loss"] == {"rows": [1, 2]}
    assert not list(tmp_path.glob("*.tmp"))  # written atomically


def test_verdict_fails_on_a_failed_step_and_on_a_gpu_without_cuda_tests(tmp_path, capsys):
    report_cli("record", tmp_path, "build", "build", 0, 40)
    assert report_cli("verdict", tmp_path) == 0
    assert "every step passed" in capsys.readouterr().out
    report_cli("record", tmp_path, "bench", "bench_ema", -1, 0)
    assert report_cli("verdict", tmp_path) == 1
    assert "bench/bench_ema: not run (rc -1)" in capsys.readouterr().out
    gpu = tmp_path / "gpu"
    (gpu / "info.json").parent.mkdir()
    (gpu / "info.json").write_text(json.dumps({"cuda_available": True}))
    (gpu / "p.xml").write_text(
        PYTEST_XML.replace('<testcase classname="t.a" name="test_ok" time="0.1"/>', "")
    )
    report_cli("record", gpu, "build", "import", 0, 1, "--embed", f"build_info={gpu / 'info.json'}")
    report_cli("record", gpu, "proof", "pytest_cuda", 0, 5, "--junit", gpu / "p.xml")
    assert report_cli("verdict", gpu) == 1
    out = capsys.readouterr().out
    assert "a GPU is present but no CUDA test passed" in out
    assert "proof/pytest_cuda: 1 tests not run (the time cap)" in out


# ----------------------------------------------------------------- check_closure


def native_objects():
    package = Path(dino_opt._C.__file__).parent
    return [package / "libdino_opt_core.so", Path(dino_opt._C.__file__)]


def test_closure_classifies_every_library_the_objects_need(tmp_path):
    out = tmp_path / "closure.json"
    rc = check_closure.main(
        ["--prefix", str(tmp_path / "empty"), "--json", str(out)]
        + [str(p) for p in native_objects()]
    )
    result = json.loads(out.read_text())
    core, module = result["files"]
    kinds = {n["soname"]: n["kind"] for n in core["needs"]}
    assert kinds["libc.so.6"] == "runtime" and kinds["libtorch.so"] == "torch"
    assert {n["soname"]: n["kind"] for n in module["needs"]}["libdino_opt_core.so"] == "built"
    # This checkout's build takes libjpeg-turbo (and OpenCV, if built with it)
    # from the system: not carried, so the check fails and names them.
    assert kinds["libturbojpeg.so.0"] == "other"
    assert rc == 1 and any("libturbojpeg.so.0" in v for v in result["violations"])
    # With the system's library folder as "the prefix", libjpeg-turbo passes.
    system = Path(next(n["path"] for n in core["needs"] if n["soname"] == "libturbojpeg.so.0"))
    check_closure.main(
        ["--prefix", str(system.resolve().parent), "--json", str(out), str(native_objects()[0])]
    )
    kinds = {n["soname"]: n["kind"] for n in json.loads(out.read_text())["files"][0]["needs"]}
    assert kinds["libturbojpeg.so.0"] == "prefix"


def test_closure_refuses_a_missing_file(tmp_path, capsys):
    assert check_closure.main(["--prefix", str(tmp_path), str(tmp_path / "nope.so")]) == 2
    assert "no such file" in capsys.readouterr().err


# ----------------------------------------------------------------- check_rehearsal


def test_rehearsal_verdict_names_each_problem(tmp_path, capsys):
    report = {
        "steps": [
            {"stage": "build", "name": n, "status": "pass", "rc": 0, "seconds": 1, "cap": 300}
            for n in ("unpack", "build", "closure", "import")
        ]
        + [
            {"stage": "proof", "name": n, "status": "pass", "rc": 0, "seconds": 1, "cap": 100}
            for n in ("closure", "import", "doctor", "cpp_tests")
        ]
        + [
            {"stage": "proof", "name": "bench_ema", "status": "fail", "rc": 1, "seconds": 1},
        ],
        "closure": {
            "violations": ["libdino_opt_core.so: libopencv_core.so.406 (other)"],
            "files": [{"needs": [{"soname": "libturbojpeg.so.0", "kind": "other"}]}],
        },
        "build_info": {"image_formats": ["JPEG", "PNG"], "native_module": "/elsewhere/_C.so"},
    }
    (tmp_path / "gpu_check.json").write_text(json.dumps(report))
    build = tmp_path / "build"
    build.mkdir()
    (build / "CMakeCache.txt").write_text(
        "GTest_DIR:PATH=/usr/lib/x86_64-linux-gnu/cmake/GTest\n"
        f"TURBOJPEG_LIBRARY:FILEPATH={tmp_path}/prefix/usr/lib/libturbojpeg.so\n"
        f"TURBOJPEG_INCLUDE_DIR:PATH={tmp_path}/prefix/usr/include\n"
        "OPENCV_CORE_LIBRARY:FILEPATH=/lib/x86_64-linux-gnu/libopencv_core.so\n"
    )
    args = [
        str(tmp_path),
        "--stages",
        "build,proof",
        "--build-dir",
        str(build),
        "--venv",
        str(tmp_path / "venv"),
        "--prefix",
        str(tmp_path / "prefix"),
        "--carried-bytes",
        str(65 << 20),
    ]
    assert check_rehearsal.main(args) == 1
    out = capsys.readouterr().out
    for problem in (
        "step proof/bench_ema: fail",
        "stage proof: step bench_loss did not run",
        "proof: the caps add up to 400 s",
        "proof: steps without a cap: ['bench_ema']",
        "closure: libdino_opt_core.so: libopencv_core.so.406",
        "libturbojpeg.so.0 resolved as 'other'",
        "must be JPEG-only",
        "dino_opt._C was loaded from /elsewhere/_C.so",
        "GTest_DIR is '/usr/lib/x86_64-linux-gnu/cmake/GTest', not in the carried prefix",
        "OPENCV_CORE_LIBRARY found OpenCV at /lib/x86_64-linux-gnu/libopencv_core.so",
        "over the device's 64 MiB",
        "bench bench_ema: no JSON in the report",
    ):
        assert problem in out, problem


# ----------------------------------------------------------------- CMake


def configure(tmp_path, *defines):
    """Configures the project with the system prefixes hidden (as the GPU
    machine lacks them) and libjpeg-turbo named directly; returns (rc, output)."""
    args = [
        "cmake",
        "-S",
        str(ROOT),
        "-B",
        str(tmp_path / "cfg"),
        "-G",
        "Ninja",
        f"-DPython_EXECUTABLE={sys.executable}",
        "-DCMAKE_IGNORE_PREFIX_PATH=/usr;/",
        "-DTURBOJPEG_INCLUDE_DIR=/usr/include",
        "-DTURBOJPEG_LIBRARY=/usr/lib/x86_64-linux-gnu/libturbojpeg.so",
        *defines,
    ]
    done = subprocess.run(args, capture_output=True, text=True)
    return done.returncode, done.stdout + done.stderr


@pytest.mark.skipif(not shutil.which("cmake"), reason="needs cmake")
def test_tests_without_googletest_are_a_configure_error(tmp_path):
    rc, out = configure(tmp_path, "-DDINO_OPT_BUILD_TESTS=ON", "-DDINO_OPT_WITH_OPENCV=OFF")
    assert rc != 0
    assert "DINO_OPT_BUILD_TESTS=ON but GoogleTest was not found" in " ".join(out.split())


@pytest.mark.skipif(not shutil.which("cmake"), reason="needs cmake")
def test_a_missing_opencv_names_the_option_that_builds_without_it(tmp_path):
    rc, out = configure(tmp_path)
    assert rc != 0
    assert "configure with -DDINO_OPT_WITH_OPENCV=OFF for a JPEG-only loader" in " ".join(
        out.split()
    )


# ----------------------------------------------------------------- gpu_check.sh


def run_check(tmp_path, stage, budget=450):
    env = {
        **os.environ,
        "PYTHON": sys.executable,
        "STAGE": stage,
        "REPORT_DIR": str(tmp_path / "report"),
        "GPU_CHECK_BUILD_DIR": str(tmp_path / "build"),
        "GPU_CHECK_PREFIX": str(tmp_path / "prefix"),
        "GPU_CHECK_CARRY": str(tmp_path / "carry"),
        "GPU_CHECK_BUDGET_S": str(budget),
    }
    done = subprocess.run(
        ["bash", str(SCRIPTS / "gpu_check.sh")], env=env, capture_output=True, text=True
    )
    report_file = tmp_path / "report" / "gpu_check.json"
    report = json.loads(report_file.read_text()) if report_file.exists() else {"steps": []}
    return done, report


def test_a_stage_past_its_budget_records_its_steps_as_not_run(tmp_path):
    # No build in the (empty) build folder: proof builds first, but a 1 s budget
    # leaves no time, so the first step is recorded as not run and the stage ends.
    done, report = run_check(tmp_path, "proof", budget=1)
    assert done.returncode == 1
    assert report["steps"][0]["status"] == "not run"
    assert report["steps"][0]["name"] in ("unpack", "build")
    log = (tmp_path / "report" / "gpu_check.log").read_text()
    assert "budget is spent" in log and "gpu-check:" in log


def test_an_unknown_stage_is_refused(tmp_path):
    done, _ = run_check(tmp_path, "benchmarks")
    assert done.returncode == 1
    assert "unknown stage 'benchmarks'" in done.stdout


@pytest.mark.skipif(not shutil.which("readelf"), reason="needs binutils' readelf")
def test_readelf_lists_what_ldd_resolves():
    core = native_objects()[0]
    needed = check_closure.needed(core)
    assert "libc.so.6" in needed and "libtorch.so" in needed


def test_rehearsal_refuses_a_proof_whose_caps_do_not_fit_one_call(capsys):
    steps = [
        {"stage": "proof", "name": n, "status": "pass", "seconds": 2, "cap": cap}
        for n, cap in (("doctor", 30), ("pytest_cuda", 300), ("bench_train", 170))
    ]
    assert check_rehearsal.plan_problems({"steps": steps}) == [
        "proof: the caps add up to 500 s, over one call's 480 s"
    ]
    out = capsys.readouterr().out
    assert "pytest_cuda" in out and "300" in out  # the plan: here and the cap there
    assert check_rehearsal.plan_problems({"steps": steps[:2]}) == []


# ----------------------------------------------------------------- the test run's time cap


def test_tests_past_the_deadline_are_recorded_as_not_run(tmp_path):
    xml = tmp_path / "junit.xml"
    chosen = "tests_py/test_gpu_check.py::test_an_unknown_stage_is_refused"
    env = {**os.environ, "DINO_OPT_TEST_DEADLINE": str(time.time() - 1)}
    done = subprocess.run(
        [sys.executable, "-m", "pytest", chosen, "-p", "no:cacheprovider", f"--junitxml={xml}"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stdout[-2000:]
    counts = gpu_report.junit_counts(xml)["counts"]
    assert counts["not_run"] == 1 and counts["passed"] == 0


def test_slow_tests_are_collected_last():
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "--collect-only",
            "-q",
            "-p",
            "no:cacheprovider",
            "tests_py/test_memory.py",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    ids = [line for line in done.stdout.splitlines() if "::" in line]
    slow = "tests_py/test_memory.py::test_cuda_tracker_as_the_first_cuda_call_of_a_process"
    assert len(ids) > 2 and ids[-1] == slow, ids
