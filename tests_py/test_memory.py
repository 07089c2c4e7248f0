"""The memory tracker on the CPU (host memory, steps, sampling thread, the
lesson's keys) and, marked `cuda`, against torch's allocator counters."""

import mmap
import subprocess
import sys
import time

import pytest
import torch
from dino_opt import _C
from dino_opt.observe import AllocationTrace, MemoryTracker, VRAMProfiler, memory_snapshot
from dino_opt.observe.memory import GB
from torch.profiler import ProfilerActivity, profile

BIG = 256 * 2**20


def big_block() -> mmap.mmap:
    """BIG bytes of an anonymous mapping of their own, touched (through a
    tensor on it), so resident until closed. Not a plain tensor: glibc serves
    a large request from a free chunk of its heap when one is big enough, and
    a long-lived process's fragmented heap may hold one already resident (in
    CI a pytest worker of 3.5 GB made a 256 MiB tensor without its RSS
    moving)."""
    block = mmap.mmap(-1, BIG)
    torch.frombuffer(block, dtype=torch.uint8).fill_(1)
    return block


def test_host_rss_rises_with_a_large_tensor_and_falls_when_it_is_freed():
    before = _C.read_host_memory()["rss"]
    x = big_block()
    during = _C.read_host_memory()["rss"]
    x.close()
    after = _C.read_host_memory()["rss"]
    assert during - before > 0.9 * BIG
    assert during - after > 0.9 * BIG


def test_step_peaks_see_a_temporary_allocation():
    tracker = MemoryTracker("cpu")
    tracker.start_step()
    base = _C.read_host_memory()["rss"]
    big_block().close()
    peaks = tracker.end_step()
    assert peaks["host_peak_rss"] - base > 0.9 * BIG
    assert peaks["device_peak_allocated"] is None
    assert peaks["seconds"] >= 0 and peaks["step"] == 0
    assert tracker.summary()["steps"] == 1
    with pytest.raises(RuntimeError, match=r"end_step\(\) without start_step\(\)"):
        tracker.end_step()


def test_allocation_trace_counts_tensor_bytes_exactly():
    kept = torch.empty(1000)  # before the trace: not counted
    with AllocationTrace() as trace:
        a = torch.empty(250, dtype=torch.float64)  # 2000 bytes
        with torch.profiler.record_function("step"):
            b = torch.empty(1000, dtype=torch.uint8)
            (a * 2).sum()  # a temporary of 2000 bytes and a scalar
            del b
        with torch.profiler.record_function("after"):
            pass
    assert trace.live_at("step") == 2000
    assert trace.peak("step") >= 2000 + 1000 + 2000
    assert trace.peak("step") <= 2000 + 1000 + 2000 + 64  # the sum's scalar
    assert trace.live_at("after") == 2000 and trace.peak() == trace.peak("step")
    assert trace.live()[-1][1] == 2000 and kept.numel() == 1000
    with pytest.raises(KeyError, match="no range 'missing' was recorded"):
        trace.peak("missing")


def test_allocation_trace_reports_what_torchs_profiler_reports():
    # The reference: torch's profiler with profile_memory=True over the same
    # training step (the second, so that the gradients already exist).
    torch.manual_seed(0)
    net = torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3),
        torch.nn.GELU(),
        torch.nn.Flatten(),
        torch.nn.Linear(8 * 14 * 14, 10),
    )
    x = torch.randn(4, 3, 16, 16)

    def step():
        with torch.profiler.record_function("step"):
            net(x).square().sum().backward()

    step()
    with AllocationTrace() as ours:
        step()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as ref:
        step()
    events = [
        (e.start_ns(), e.nbytes())
        for e in ref.profiler.kineto_results.events()
        if e.name() == "[memory]"
    ]
    events.sort(key=lambda t: t[0])  # stable: ties keep their order
    live, reference = 0, []
    for _, nbytes in events:
        live += nbytes
        reference.append(live)
    assert [b for _, b in ours.live()] == reference and len(reference) > 10
    assert ours.peak("step") == max(reference) and ours.live_at("step") == 0
    with pytest.raises(RuntimeError, match="already active on this thread"):
        with profile(activities=[ProfilerActivity.CPU]), AllocationTrace():
            pass


def test_lesson_keys_on_the_cpu():
    stats = MemoryTracker("cpu").get_memory_stats()
    assert 0 < stats["system_memory_percent"] < 100
    assert 0 < stats["system_memory_available_gb"] <= stats["system_memory_total_gb"]
    assert stats["host_rss_gb"] > 0
    assert not any(k.startswith("gpu_") for k in stats)


def test_sampling_thread_records_a_timeline_and_stops(tmp_path):
    with MemoryTracker("cpu", sample_period=0.02, sampling=True) as tracker:
        assert tracker.sampling
        time.sleep(0.3)
    assert not tracker.sampling
    samples = tracker.timeline()
    assert len(samples) >= 5
    assert all(b["time"] > a["time"] for a, b in zip(samples, samples[1:], strict=False))
    assert samples[0]["host"]["rss"] > 0 and samples[0]["allocator"] is None
    time.sleep(0.1)
    assert len(tracker.timeline()) == len(samples), "the thread kept sampling after stop"
    summary = tracker.summary()
    assert summary["samples"] == len(samples) and summary["timeline_host_rss_max_gb"] > 0
    png = tmp_path / "timeline.png"
    tracker.plot_timeline(png)
    assert png.stat().st_size > 5_000
    tracker.start_sampling()  # can be restarted
    tracker.close()


def test_bad_arguments_and_cpu_only_features():
    with pytest.raises(RuntimeError, match="sample_period must be a positive number"):
        MemoryTracker("cpu", sample_period=0)
    with pytest.raises(ValueError, match="device must be cpu or cuda"):
        MemoryTracker("meta")
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="VRAMProfiler needs a CUDA device"):
            VRAMProfiler()
        with pytest.raises(RuntimeError, match="memory_snapshot needs a CUDA device"):
            with memory_snapshot("unused.pickle"):
                pass


@pytest.mark.cuda
def test_cuda_allocator_peaks_match_torch(tmp_path):
    tracker = MemoryTracker("cuda:0")
    torch.cuda.synchronize()
    tracker.start_step()
    torch.cuda.reset_peak_memory_stats()
    x = torch.empty(64 * 2**20, device="cuda")
    y = x * 2
    del x, y
    torch.cuda.synchronize()
    peaks = tracker.end_step()
    assert peaks["device_peak_allocated"] == torch.cuda.max_memory_allocated()
    assert peaks["device_peak_reserved"] == torch.cuda.max_memory_reserved()
    stats = tracker.get_memory_stats()
    assert stats["gpu_memory_current_gb"] == pytest.approx(torch.cuda.memory_allocated() / GB)
    assert stats["gpu_memory_reserved_gb"] == pytest.approx(torch.cuda.memory_reserved() / GB)
    assert 0 <= stats["gpu_memory_utilization"] <= 1
    assert stats["gpu_memory_total_gb"] == pytest.approx(
        torch.cuda.get_device_properties(0).total_memory / GB, rel=0.05
    )
    profile = VRAMProfiler(0).profile_training_step(lambda: torch.ones(2**26, device="cuda").sum())
    assert profile["peak_allocated"] >= 2**26 * 4 / GB
    with memory_snapshot(tmp_path / "snap.pickle"):
        torch.ones(1000, device="cuda")
    assert (tmp_path / "snap.pickle").stat().st_size > 0


# What a fresh process does when the tracker is its first CUDA call: before the
# fix, the allocator's statistics threw ("did you call init?") and, inside the
# sampling thread, took the process down (std::terminate).
FIRST_CUDA_CALL = """
import time, warnings
import torch
from dino_opt.observe import MemoryTracker
assert not torch.cuda.is_initialized()
tracker = MemoryTracker(0, sample_period=0.01)
tracker.start_step()
stats = tracker.get_memory_stats()
assert stats["gpu_memory_current_gb"] == 0.0, stats
tracker.start_sampling()
time.sleep(0.2)
x = torch.ones(2**20, device="cuda")
time.sleep(0.1)
with warnings.catch_warnings():
    warnings.simplefilter("error")
    tracker.stop_sampling()
peaks = tracker.end_step()
assert peaks["device_peak_allocated"] >= 4 * 2**20, peaks
timeline = tracker.timeline()
assert len(timeline) >= 5 and all(s["allocator"] is not None for s in timeline)
assert tracker.sampling_error is None
print("ok", len(timeline))
"""


@pytest.mark.cuda
@pytest.mark.slow
def test_cuda_tracker_as_the_first_cuda_call_of_a_process():
    done = subprocess.run(
        [sys.executable, "-c", FIRST_CUDA_CALL], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.startswith("ok")
