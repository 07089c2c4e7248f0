"""The profiler: ranges, nesting, threads, steps, statistics, the Chrome trace,
the lesson's DINOProfiler end to end on the CPU, PerformanceMonitor and
PerformanceProfiler; on a GPU (marked `cuda`) device times and no hidden syncs."""

import json
import threading
import time

import numpy as np
import pytest
import torch
from dino_opt import DINOLoss, EMATeacher
from dino_opt.observe import DINOProfiler, PerformanceMonitor, PerformanceProfiler, Profiler
from torch import nn


def test_a_range_around_a_sleep_measures_it():
    p = Profiler("cpu")
    with p.range("sleep"):
        time.sleep(0.05)
    (r,) = p.ranges()
    assert r["name"] == "sleep" and r["device_ms"] is None
    assert 49 <= r["host_ms"] < 150


def test_nesting_steps_shares_and_throughput():
    p = Profiler("cpu")
    for _ in range(3):
        with p.range("step"):
            with p.range("inner"):
                time.sleep(0.01)
        p.step(samples=4)
    depths = {r["name"]: r["depth"] for r in p.ranges()}
    assert depths == {"step": 0, "inner": 1}
    stats = p.stats()
    assert stats["inner"]["host"]["count"] == 3
    assert stats["inner"]["host"]["min"] >= 10
    assert (
        stats["inner"]["host"]["median"]
        <= stats["inner"]["host"]["p95"]
        <= stats["inner"]["host"]["max"]
    )
    assert 0.5 < stats["step"]["share_of_step"] <= 1.0
    steps = p.steps()
    assert [s["step"] for s in steps] == [0, 1, 2] and all(s["samples"] == 4 for s in steps)
    assert p.throughput() == pytest.approx(12 / (sum(s["host_ms"] for s in steps) / 1e3))


def test_statistics_match_numpy():
    p = Profiler("cpu")
    for ms in [1, 7, 3, 12, 5]:
        with p.range("r"):
            time.sleep(ms / 1e3)
    host = [r["host_ms"] for r in p.ranges()]
    s = p.stats()["r"]["host"]
    assert s["median"] == pytest.approx(np.median(host))
    assert s["p95"] == pytest.approx(np.percentile(host, 95))
    assert s["total"] == pytest.approx(sum(host))


def test_ranges_from_several_threads():
    p = Profiler("cpu")
    together = threading.Barrier(4)  # all alive at once, so their ids differ

    def work(i):
        together.wait()
        for _ in range(50):
            with p.range(f"t{i}"):
                with p.range("inner"):
                    pass
        together.wait()

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    ranges = p.ranges()
    assert len(ranges) == 4 * 50 * 2
    assert len({r["thread"] for r in ranges}) == 4
    assert all(r["depth"] == (1 if r["name"] == "inner" else 0) for r in ranges)


def test_pop_without_push_is_refused():
    p = Profiler("cpu")
    with pytest.raises(RuntimeError, match="pop\\(\\) without a matching push\\(\\)"):
        p._native.pop()


def test_chrome_trace_is_json_with_the_ranges(tmp_path):
    p = Profiler("cpu")
    with p.range('forward "quoted"\n'):
        pass
    p.step()
    trace = json.loads(p.export_chrome_trace(tmp_path / "trace.json").read_text())
    names = [e["name"] for e in trace["traceEvents"] if e["ph"] == "X"]
    assert 'forward "quoted"\n' in names and "step 0" in names
    assert all(e["dur"] >= 0 for e in trace["traceEvents"] if e["ph"] == "X")


class TinyDino(nn.Module):
    def __init__(self):
        super().__init__()
        self.student = nn.Sequential(nn.Flatten(), nn.Linear(3 * 8 * 8, 32))
        self.ema = EMATeacher(self.student, momentum_schedule=0.99)
        self.teacher = self.ema.teacher
        self.steps = 0

    def update_teacher(self):
        self.ema.update(self.steps)
        self.steps += 1


def test_dino_profiler_lesson_api_end_to_end(tmp_path):
    model = TinyDino()
    dino_loss = DINOLoss(32, 4, 0.04, 0.04, 0, 1)

    def loss_fn(student_outputs, teacher_outputs):
        return dino_loss(torch.cat(student_outputs), torch.cat(teacher_outputs[:2]), 0)

    optimizer = torch.optim.SGD(model.student.parameters(), lr=0.1)
    profiler = DINOProfiler("cpu")
    for _ in range(3):
        crops = [torch.randn(5, 3, 8, 8) for _ in range(4)]
        timings = profiler.profile_training_step(model, crops, loss_fn, optimizer)
    blocks = [
        "data_movement",
        "student_forward",
        "teacher_forward",
        "loss_computation",
        "backward_pass",
        "optimizer_step",
        "teacher_update",
    ]
    assert set(timings) == {f"{b}_time" for b in blocks}
    stats = profiler.get_summary_stats()
    assert set(stats) == set(blocks)
    assert all(
        s["count"] == 3 and s["min_time"] <= s["mean_time"] <= s["max_time"] for s in stats.values()
    )
    png = tmp_path / "perf.png"
    profiler.plot_performance_analysis(png)
    assert png.stat().st_size > 10_000
    data = json.loads(profiler.export_profile_data(tmp_path / "profile.json").read_text())
    assert set(data) >= {"timings", "memory_usage", "summary_stats", "steps", "throughput"}
    assert data["throughput"] > 0 and len(data["steps"]) == 3


def test_performance_monitor_flags_degradation(caplog):
    monitor = PerformanceMonitor(window=10, threshold=0.8, min_history=30)
    assert all(monitor.log_performance(100.0, 1.0) is None for _ in range(40))
    alerts = [monitor.log_performance(50.0, 2.0) for _ in range(10)]
    assert alerts[-1] is not None and alerts[-1]["ratio"] == pytest.approx(0.5)
    assert "throughput degraded" in caplog.text
    with pytest.raises(ValueError, match="min_history >= 2 \\* window"):
        PerformanceMonitor(window=10, min_history=5)


def test_performance_profiler_prints_a_summary(capsys):
    profiler = PerformanceProfiler("cpu")
    for _ in range(2):
        with profiler.profile("step"):
            with profiler.profile("forward"):
                pass
        profiler.record_gpu_memory()
    profiler.print_summary()
    out = capsys.readouterr().out
    assert "forward" in out and "step" in out


@pytest.mark.cuda
def test_cuda_device_time_of_a_known_kernel_and_no_hidden_syncs():
    p = Profiler("cuda")
    torch.cuda._sleep(1000)  # warm up
    torch.cuda.synchronize()
    cycles = 50_000_000  # about 25 ms at 2 GHz: far longer than a launch
    for _ in range(5):
        with p.range("sleep"):
            torch.cuda._sleep(cycles)
        p.step()
    assert p.synchronizations() == 0, "push/pop/step must not synchronise"
    device = [r["device_ms"] for r in p.ranges()]
    host = [r["host_ms"] for r in p.ranges()]
    assert all(d is not None and d > 5 for d in device)
    assert np.median(host) < np.median(device), "launches return before the kernel ends"
    assert p.synchronizations() > 0  # reading waited, as documented


@pytest.mark.cuda
def test_cuda_ranges_on_a_side_stream_while_the_default_stream_is_busy(tmp_path):
    # The profiler's reference event is recorded on the default stream behind a
    # long kernel; ranges on a side stream finish first. Resolving them against
    # the unfinished reference raised cudaErrorNotReady inside step().
    x = torch.ones(1 << 20, device="cuda")
    side = torch.cuda.Stream()
    torch.cuda.synchronize()
    torch.cuda._sleep(1_000_000_000)  # about 0.5 s of the default stream
    p = Profiler("cuda")
    with torch.cuda.stream(side):
        for _ in range(3):
            with p.range("side"):
                y = x * 2
            p.step()
    side.synchronize()
    assert torch.cuda.current_stream().query() is False, "the default stream must still be busy"
    p.step()  # resolves what is ready without waiting, and must not raise
    assert p.synchronizations() == 0
    ranges = p.ranges()  # waits for every event, the reference included
    assert [r["name"] for r in ranges] == ["side"] * 3
    assert all(r["device_ms"] is not None and r["device_ms"] >= 0 for r in ranges)
    trace = json.loads(p.export_chrome_trace(tmp_path / "trace.json").read_text())
    assert sum(e.get("pid") == 1 and e["name"] == "side" for e in trace["traceEvents"]) == 3
    assert torch.equal(y, x * 2)


class StepModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Linear(8, 2)

    def training_step(self, batch):
        return self.net(batch).pow(2).mean()


@pytest.mark.parametrize("handler", ["chrome", "tensorboard"])
def test_training_profiler_writes_traces(tmp_path, handler):
    from dino_opt.observe import TrainingProfiler

    model = StepModel()
    profiler = TrainingProfiler(tmp_path, wait=1, warmup=1, active=2, handler=handler)
    prof = profiler.profile_training(model, [torch.randn(4, 8) for _ in range(10)])
    assert prof.key_averages()  # something was recorded
    assert any(tmp_path.iterdir()), "no trace written"
    with pytest.raises(ValueError, match="handler must be"):
        TrainingProfiler(tmp_path, handler="csv")
