"""Memory tracking over the native core: host memory from /proc, the CUDA
caching allocator's statistics, device memory through NVML, per-step peaks
without emptying the cache, and a sampling thread for a timeline; and the
bytes of live tensors on the CPU from torch's own allocation events
(:class:`AllocationTrace`), which a process's resident size cannot give.

The lesson's ``MemoryTracker`` called ``torch.cuda.empty_cache()`` every step
(which throws away the allocator's cache and slows training); this one only
resets the peak counters."""

from __future__ import annotations

import contextlib
import warnings
from pathlib import Path

import torch
from matplotlib.figure import Figure  # no pyplot: leaves the user's backend alone

from ..ops.native import _C

__all__ = [
    "AllocationTrace",
    "MemoryTracker",
    "VRAMProfiler",
    "device_index",
    "memory_snapshot",
    "nvml_status",
]

GB = 1024**3  # the lesson's "GB" are GiB


def nvml_status() -> str:
    """Why NVML (device-wide memory) is unusable; '' when it is usable."""
    return _C.nvml_status()


def device_index(device) -> int:
    """CUDA device index for the native tracker and profiler, or -1 for the host only."""
    if device is None:
        return torch.cuda.current_device() if torch.cuda.is_available() else -1
    device = torch.device(device) if not isinstance(device, int) else torch.device("cuda", device)
    if device.type == "cpu":
        return -1
    if device.type != "cuda":
        raise ValueError(f"device must be cpu or cuda, got {device}")
    if not torch.cuda.is_available():
        raise RuntimeError(f"device {device} requested but CUDA is not available")
    return device.index if device.index is not None else torch.cuda.current_device()


class MemoryTracker:
    """Host and GPU memory of a training run (the lesson's ``MemoryTracker``).

    Args:
        device: the CUDA device to track (index, ``"cuda:1"``, a torch.device);
            default the current CUDA device, or host memory only without CUDA.
        sample_period: seconds between timeline samples of the sampling thread.
        sampling: start the sampling thread at once.

    ``start_step()`` / ``end_step()`` bracket a step and give its peaks;
    ``get_memory_stats()`` returns the lesson's keys plus more;
    ``start_sampling()`` / ``stop_sampling()`` / ``timeline()`` record memory
    over time; ``summary()`` condenses both. Also a context manager (stops the
    sampling thread on exit).
    """

    def __init__(self, device=None, sample_period: float = 0.1, sampling: bool = False) -> None:
        self._native = _C.MemoryTracker(device_index(device), float(sample_period))
        if sampling:
            self.start_sampling()

    @property
    def device(self) -> torch.device:
        index = self._native.device
        return torch.device("cpu") if index < 0 else torch.device("cuda", index)

    def start_step(self) -> None:
        """Start a step: resets the allocator's and the process's peak counters."""
        self._native.start_step()

    def end_step(self) -> dict:
        """End the step; returns its wall time and peaks (bytes; device ones None without CUDA)."""
        return self._native.end_step()

    def steps(self) -> list[dict]:
        return self._native.steps()

    def get_memory_stats(self) -> dict[str, float]:
        """Current memory, in GiB unless said otherwise.

        The lesson's keys: ``gpu_memory_current_gb`` (bytes held by live
        tensors), ``gpu_memory_peak_gb`` (their peak since ``start_step``),
        ``gpu_memory_reserved_gb`` (held by the caching allocator),
        ``gpu_memory_utilization`` (live tensor bytes over the device's total
        memory, 0..1: how full the GPU is with this process's tensors),
        ``system_memory_percent`` and ``system_memory_available_gb``. Ours:
        ``host_rss_gb``, ``host_peak_rss_gb``, ``system_memory_total_gb``, and
        with a GPU ``gpu_memory_total_gb``, ``gpu_memory_used_gb`` and
        ``gpu_memory_free_gb`` (the whole device, all processes, from NVML when
        it is available) and the allocator's ``gpu_alloc_retries`` and
        ``gpu_ooms``. GPU keys are absent when no GPU is tracked.
        """
        s = self._native.sample()
        host = s["host"]
        stats = {}
        allocator = s["allocator"]
        if allocator is not None:
            device = s["device"]
            if device is None:  # no NVML: the driver's view through the CUDA runtime
                free, total = torch.cuda.mem_get_info(self.device)
                device = {"total": total, "used": total - free, "free": free}
            stats.update(
                gpu_memory_current_gb=allocator["allocated"] / GB,
                gpu_memory_peak_gb=allocator["peak_allocated"] / GB,
                gpu_memory_reserved_gb=allocator["reserved"] / GB,
                gpu_memory_utilization=allocator["allocated"] / device["total"],
                gpu_memory_total_gb=device["total"] / GB,
                gpu_memory_used_gb=device["used"] / GB,
                gpu_memory_free_gb=device["free"] / GB,
                gpu_alloc_retries=allocator["alloc_retries"],
                gpu_ooms=allocator["ooms"],
            )
        stats.update(
            system_memory_percent=100.0 * (host["total"] - host["available"]) / host["total"],
            system_memory_available_gb=host["available"] / GB,
            system_memory_total_gb=host["total"] / GB,
            host_rss_gb=host["rss"] / GB,
            host_peak_rss_gb=host["peak_rss"] / GB,
        )
        return stats

    def start_sampling(self) -> None:
        self._native.start_sampling()

    def stop_sampling(self) -> None:
        """Stop the sampling thread; warns if it had stopped on an error (see
        :attr:`sampling_error`). The samples taken are kept either way."""
        self._native.stop_sampling()
        if self.sampling_error:
            warnings.warn(self.sampling_error, RuntimeWarning, stacklevel=2)

    @property
    def sampling(self) -> bool:
        return self._native.sampling()

    @property
    def sampling_error(self) -> str | None:
        """Why the sampling thread stopped on its own (a failed reading), or
        None. A monitor never takes the training down: the thread stops, the
        samples so far stay, and the next ``start_sampling()`` clears this."""
        return self._native.sampling_error() or None

    def timeline(self) -> list[dict]:
        """Samples of the sampling thread: ``time`` (s), ``host``, ``allocator``, ``device``."""
        return self._native.timeline()

    def summary(self) -> dict:
        """Peaks over the recorded steps and timeline (GiB), and their counts."""
        steps, timeline = self.steps(), self.timeline()
        out = {"steps": len(steps), "samples": len(timeline)}
        if steps:
            out["step_host_peak_rss_gb"] = max(s["host_peak_rss"] for s in steps) / GB
            out["step_seconds_mean"] = sum(s["seconds"] for s in steps) / len(steps)
            device_peaks = [
                s["device_peak_allocated"] for s in steps if s["device_peak_allocated"] is not None
            ]
            if device_peaks:
                out["step_gpu_peak_allocated_gb"] = max(device_peaks) / GB
        if timeline:
            out["timeline_host_rss_max_gb"] = max(s["host"]["rss"] for s in timeline) / GB
            reserved = [s["allocator"]["reserved"] for s in timeline if s["allocator"] is not None]
            if reserved:
                out["timeline_gpu_reserved_max_gb"] = max(reserved) / GB
        return out

    def plot_timeline(self, path=None):
        """Host RSS and, with a GPU, the allocator's allocated and reserved
        memory and the device's used memory over the sampled timeline (GiB);
        saved to ``path`` (PNG) when given. Returns the matplotlib figure."""

        samples = self.timeline()
        if not samples:
            raise RuntimeError(
                "MemoryTracker.plot_timeline: no samples; call start_sampling() first"
            )
        t = [s["time"] for s in samples]
        fig = Figure(figsize=(10, 4))
        ax = fig.subplots()
        ax.plot(t, [s["host"]["rss"] / GB for s in samples], label="host RSS")
        if samples[0]["allocator"] is not None:
            ax.plot(t, [s["allocator"]["allocated"] / GB for s in samples], label="GPU allocated")
            ax.plot(t, [s["allocator"]["reserved"] / GB for s in samples], label="GPU reserved")
        if samples[0]["device"] is not None:
            ax.plot(t, [s["device"]["used"] / GB for s in samples], label="GPU used (device)")
        ax.set_xlabel("seconds")
        ax.set_ylabel("GiB")
        ax.set_title("Memory over time")
        ax.legend()
        fig.tight_layout()
        if path is not None:
            fig.savefig(path, dpi=100)
        return fig

    def close(self) -> None:
        self.stop_sampling()

    def __enter__(self) -> MemoryTracker:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _require_cuda(what: str) -> None:
    if not torch.cuda.is_available():
        raise RuntimeError(f"{what} needs a CUDA device, and none is available")


class VRAMProfiler:
    """Device memory of one GPU (the LoRA module's ``VRAMProfiler``), from NVML
    when available, else from the CUDA driver."""

    def __init__(self, device=0) -> None:
        _require_cuda("VRAMProfiler")
        self._tracker = MemoryTracker(device)

    def get_memory_info(self) -> dict[str, float]:
        """``total``, ``used`` and ``free`` memory of the whole device, in GiB."""
        stats = self._tracker.get_memory_stats()
        return {
            "total": stats["gpu_memory_total_gb"],
            "used": stats["gpu_memory_used_gb"],
            "free": stats["gpu_memory_free_gb"],
        }

    def profile_training_step(self, train_fn) -> dict[str, float]:
        """Runs ``train_fn()`` once; returns ``peak_usage`` (device memory used
        after it), ``step_allocation`` (the change of used device memory),
        ``remaining`` (free after it), and ``peak_allocated`` (the allocator's
        peak during the step, which the device-wide numbers miss), in GiB.
        The cache is not emptied, so the step runs as it does in training."""
        before = self.get_memory_info()
        self._tracker.start_step()
        train_fn()
        torch.cuda.synchronize(self._tracker.device)
        peaks = self._tracker.end_step()
        after = self.get_memory_info()
        return {
            "peak_usage": after["used"],
            "step_allocation": after["used"] - before["used"],
            "remaining": after["free"],
            "peak_allocated": peaks["device_peak_allocated"] / GB,
        }


@contextlib.contextmanager
def memory_snapshot(path, max_entries: int = 100_000):
    """Records every CUDA allocation (with stack traces) inside the block and
    writes torch's allocator snapshot to ``path``, for the memory visualiser
    (https://pytorch.org/memory_viz). Costly: for the deep view, not for every run."""
    _require_cuda("memory_snapshot")
    torch.cuda.memory._record_memory_history(max_entries=max_entries)
    try:
        yield
    finally:
        torch.cuda.memory._dump_snapshot(str(Path(path)))
        torch.cuda.memory._record_memory_history(enabled=None)


class AllocationTrace:
    """The bytes of live tensors of one device type over a block of code,
    from every allocation and free that torch's allocators report (the
    reports torch's profiler keeps with ``profile_memory=True``): exact tensor
    bytes, unlike the process's resident size (which the C library's heap and
    its caching blur) and, on the CPU, the only per-tensor account torch keeps.

    The native core installs a memory reporter on the calling thread in
    place of torch's profiler, so no operator is recorded: the traced code
    runs at nearly its own speed (docs/memory.md).

    Use as a context manager, on one thread; within it,
    ``torch.profiler.record_function(NAME)`` marks ranges. Afterwards
    :meth:`live` is the live-byte count (relative to the trace's start) after
    each event, :meth:`peak` its maximum (over a marked range with ``within``)
    and :meth:`live_at` its value when a range started. Tensors allocated
    before the trace began are not counted, not even when they are freed
    inside it. torch's profiler cannot run inside the block (nor this
    inside torch's profiler): both take the thread's profiler slot.
    """

    def __init__(self, device_type: str = "cpu") -> None:
        self.device_type = torch.device(device_type).type
        self._trace = _C.AllocationTrace()
        self._times: list[int] = []  # ns since the start, per event of this device type
        self._live = [0]  # live bytes before the first event and after each
        self._ranges: dict[str, tuple[int, int]] = {}  # name: (first event, end event)

    def __enter__(self) -> AllocationTrace:
        self._trace.start()
        return self

    def __exit__(self, *exc) -> None:
        self._trace.stop()
        position = []  # of each reported event, its index among this device's
        for t, nbytes, device, _ in self._trace.events():
            position.append(len(self._times))
            if device == self.device_type:
                self._times.append(t)
                self._live.append(self._live[-1] + nbytes)
        position.append(len(self._times))
        for name, first, end, _start, _ in sorted(self._trace.ranges(), key=lambda r: r[3]):
            self._ranges.setdefault(name, (position[first], position[end]))

    def live(self) -> list[tuple[int, int]]:
        """(time in ns, live bytes after the event) for every event."""
        return list(zip(self._times, self._live[1:], strict=True))

    def _range(self, name: str) -> tuple[int, int]:
        if name not in self._ranges:
            raise KeyError(f"no range {name!r} was recorded (ranges: {sorted(self._ranges)})")
        return self._ranges[name]

    def live_at(self, name: str) -> int:
        """Live bytes when range ``name`` started."""
        return self._live[self._range(name)[0]]

    def peak(self, within: str | None = None) -> int:
        """The most live bytes over the trace, or over range ``within``
        (counting the bytes live when it started)."""
        if within is None:
            return max(self._live[1:], default=0)
        first, end = self._range(within)
        return max(self._live[first : end + 1])
