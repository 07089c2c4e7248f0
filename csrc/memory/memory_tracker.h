#pragma once
// Memory tracker: host memory from /proc, the CUDA caching allocator's
// statistics through c10, device memory through NVML (loaded with dlopen, so
// there is no link-time dependency and a machine without it still works), per
// step peaks without emptying the allocator's cache, and a sampling thread that
// records a timeline. Plain C++; Python binds it in csrc/bindings.
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

namespace dino_opt::memory {

struct HostMemory {
  int64_t rss = 0;        // resident set of this process, bytes
  int64_t peak_rss = 0;   // its high-water mark since the last reset
  int64_t total = 0;      // system memory
  int64_t available = 0;  // system memory available to new work
};

// The CUDA caching allocator of this process on one device.
struct AllocatorMemory {
  int64_t allocated = 0, reserved = 0, active = 0;
  int64_t peak_allocated = 0, peak_reserved = 0, peak_active = 0;
  int64_t alloc_retries = 0, ooms = 0;
};

// The whole device, all processes (NVML).
struct DeviceMemory {
  int64_t total = 0, used = 0, free = 0;
};

struct MemorySample {
  double time = 0;  // seconds since the tracker was made
  HostMemory host;
  std::optional<AllocatorMemory> allocator;
  std::optional<DeviceMemory> device;
};

struct StepPeaks {
  int64_t step = 0;
  double seconds = 0;                            // wall time of the step
  int64_t host_peak_rss = 0;                     // bytes
  std::optional<int64_t> device_peak_allocated;  // bytes
  std::optional<int64_t> device_peak_reserved;
};

// Reads /proc/self/status and /proc/meminfo.
HostMemory read_host_memory();
// Resets the process's peak resident set (/proc/self/clear_refs); false if refused.
bool reset_host_peak();
// The allocator's statistics for `device`, or nullopt in a build without CUDA
// or when the device does not exist.
std::optional<AllocatorMemory> read_allocator_memory(int device);
void reset_allocator_peaks(int device);
// NVML's view of the CUDA device `device`, or nullopt when NVML is absent.
std::optional<DeviceMemory> read_device_memory(int device);
// Why NVML is unusable ("" when it is usable).
std::string nvml_status();

class MemoryTracker {
 public:
  // `device`: a CUDA device index, or -1 for host memory only.
  // `sample_period`: seconds between timeline samples.
  // With a device, CUDA is initialised here (lazily, as torch does on first
  // use): the caching allocator's statistics exist only after that.
  explicit MemoryTracker(int device = -1, double sample_period = 0.1);
  // A subclass that overrides sample() must call stop_sampling() in its own
  // destructor, while its sample() still exists.
  virtual ~MemoryTracker();
  MemoryTracker(const MemoryTracker&) = delete;
  MemoryTracker& operator=(const MemoryTracker&) = delete;

  int device() const { return device_; }
  // One reading of host, allocator and device memory (virtual: tests stand in
  // a failing one for the sampling thread).
  virtual MemorySample sample() const;

  // Per-step peaks: the allocator's and the host's peak counters are reset at
  // start_step; end_step reads them. Nothing is freed or synchronised.
  void start_step();
  StepPeaks end_step();
  std::vector<StepPeaks> steps() const;

  // The sampling thread never lets an exception escape: an error stops it,
  // keeps the samples taken so far and is reported by sampling_error() ("" when
  // none) until the next start_sampling().
  void start_sampling();
  void stop_sampling();
  bool sampling() const;
  std::string sampling_error() const;
  std::vector<MemorySample> timeline() const;

 private:
  void sample_loop();
  double now() const;

  const int device_;
  const double period_;
  const std::chrono::steady_clock::time_point origin_;
  double step_start_ = -1;
  std::vector<StepPeaks> steps_;
  mutable std::mutex mutex_;  // guards timeline_, steps_, stop_, sampling_error_
  std::condition_variable wake_;
  std::vector<MemorySample> timeline_;
  std::thread sampler_;
  bool stop_ = false;
  std::string sampling_error_;  // guarded by mutex_
};

}  // namespace dino_opt::memory
