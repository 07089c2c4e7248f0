#include "memory/memory_tracker.h"

#include <c10/util/Exception.h>
#include <dlfcn.h>

#include <cmath>
#include <fstream>
#include <sstream>

#include "build_config.h"

#if DINO_OPT_WITH_CUDA
#include <ATen/Context.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <cuda_runtime_api.h>
#endif

namespace dino_opt::memory {
namespace {

// "Name:   123 kB" lines of /proc files, in bytes; -1 when absent.
int64_t proc_kib_field(const char* path, const std::string& name) {
  std::ifstream file(path);
  std::string line;
  while (std::getline(file, line)) {
    if (line.compare(0, name.size(), name) == 0 && line.size() > name.size() &&
        line[name.size()] == ':') {
      std::istringstream fields(line.substr(name.size() + 1));
      int64_t kib = -1;
      fields >> kib;
      return kib < 0 ? -1 : kib * 1024;
    }
  }
  return -1;
}

// The few NVML entry points the tracker needs, resolved at run time.
class Nvml {
 public:
  static Nvml& get() {
    static Nvml nvml;
    return nvml;
  }
  const std::string& status() const { return status_; }

  std::optional<DeviceMemory> memory(const char* pci_bus_id) const {
    if (!status_.empty()) return std::nullopt;
    void* handle = nullptr;
    if (by_pci_(pci_bus_id, &handle) != 0) return std::nullopt;
    struct {
      unsigned long long total, free, used;
    } info{};
    if (memory_info_(handle, &info) != 0) return std::nullopt;
    return DeviceMemory{static_cast<int64_t>(info.total), static_cast<int64_t>(info.used),
                        static_cast<int64_t>(info.free)};
  }

 private:
  using InitFn = int (*)();
  using ByPciFn = int (*)(const char*, void**);
  using MemoryInfoFn = int (*)(void*, void*);

  Nvml() {
    lib_ = dlopen("libnvidia-ml.so.1", RTLD_LAZY | RTLD_LOCAL);
    if (!lib_) {
      status_ = "libnvidia-ml.so.1 not found";
      return;
    }
    auto init = reinterpret_cast<InitFn>(dlsym(lib_, "nvmlInit_v2"));
    by_pci_ = reinterpret_cast<ByPciFn>(dlsym(lib_, "nvmlDeviceGetHandleByPciBusId_v2"));
    memory_info_ = reinterpret_cast<MemoryInfoFn>(dlsym(lib_, "nvmlDeviceGetMemoryInfo"));
    if (!init || !by_pci_ || !memory_info_) {
      status_ = "libnvidia-ml.so.1 lacks the NVML functions needed";
    } else if (init() != 0) {
      status_ = "nvmlInit failed (no NVIDIA driver?)";
    }
  }

  void* lib_ = nullptr;
  ByPciFn by_pci_ = nullptr;
  MemoryInfoFn memory_info_ = nullptr;
  std::string status_;
};

}  // namespace

HostMemory read_host_memory() {
  HostMemory host;
  host.rss = proc_kib_field("/proc/self/status", "VmRSS");
  host.peak_rss = proc_kib_field("/proc/self/status", "VmHWM");
  host.total = proc_kib_field("/proc/meminfo", "MemTotal");
  host.available = proc_kib_field("/proc/meminfo", "MemAvailable");
  return host;
}

bool reset_host_peak() {
  std::ofstream clear_refs("/proc/self/clear_refs");
  clear_refs << "5";
  return static_cast<bool>(clear_refs.flush());
}

#if DINO_OPT_WITH_CUDA
namespace {
// Whether `device` is a CUDA device of this process; if so, CUDA is
// initialised first (once, as torch does on first use): before that the
// caching allocator has no statistics and asking for them throws.
bool device_ready(int device) {
  if (device < 0 || device >= static_cast<int>(c10::cuda::device_count())) return false;
  at::globalContext().lazyInitDevice(c10::DeviceType::CUDA);
  return true;
}
}  // namespace

std::optional<AllocatorMemory> read_allocator_memory(int device) {
  if (!device_ready(device)) return std::nullopt;
  const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(device);
  constexpr auto all = static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE);
  AllocatorMemory m;
  m.allocated = stats.allocated_bytes[all].current;
  m.reserved = stats.reserved_bytes[all].current;
  m.active = stats.active_bytes[all].current;
  m.peak_allocated = stats.allocated_bytes[all].peak;
  m.peak_reserved = stats.reserved_bytes[all].peak;
  m.peak_active = stats.active_bytes[all].peak;
  m.alloc_retries = stats.num_alloc_retries;
  m.ooms = stats.num_ooms;
  return m;
}

void reset_allocator_peaks(int device) {
  if (device_ready(device)) c10::cuda::CUDACachingAllocator::resetPeakStats(device);
}

std::optional<DeviceMemory> read_device_memory(int device) {
  if (!device_ready(device)) return std::nullopt;
  // NVML numbers devices its own way; the PCI bus id names the same device.
  char pci_bus_id[32] = {};
  if (cudaDeviceGetPCIBusId(pci_bus_id, sizeof(pci_bus_id), device) != cudaSuccess) {
    cudaGetLastError();
    return std::nullopt;
  }
  return Nvml::get().memory(pci_bus_id);
}
#else
std::optional<AllocatorMemory> read_allocator_memory(int) { return std::nullopt; }
void reset_allocator_peaks(int) {}
std::optional<DeviceMemory> read_device_memory(int) { return std::nullopt; }
#endif

std::string nvml_status() { return Nvml::get().status(); }

MemoryTracker::MemoryTracker(int device, double sample_period)
    : device_(device), period_(sample_period), origin_(std::chrono::steady_clock::now()) {
  TORCH_CHECK(sample_period > 0 && std::isfinite(sample_period),
              "MemoryTracker: sample_period must be a positive number of seconds, got ",
              sample_period);
  TORCH_CHECK(device >= -1, "MemoryTracker: device must be a CUDA device index or -1, got ",
              device);
  read_allocator_memory(device);  // initialises CUDA for a device of this process
}

MemoryTracker::~MemoryTracker() { stop_sampling(); }

double MemoryTracker::now() const {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - origin_).count();
}

MemorySample MemoryTracker::sample() const {
  return MemorySample{now(), read_host_memory(), read_allocator_memory(device_),
                      read_device_memory(device_)};
}

void MemoryTracker::start_step() {
  reset_host_peak();
  reset_allocator_peaks(device_);
  step_start_ = now();
}

StepPeaks MemoryTracker::end_step() {
  TORCH_CHECK(step_start_ >= 0, "MemoryTracker: end_step() without start_step()");
  StepPeaks peaks;
  peaks.seconds = now() - step_start_;
  peaks.host_peak_rss = read_host_memory().peak_rss;
  if (const auto allocator = read_allocator_memory(device_)) {
    peaks.device_peak_allocated = allocator->peak_allocated;
    peaks.device_peak_reserved = allocator->peak_reserved;
  }
  step_start_ = -1;
  const std::lock_guard<std::mutex> lock(mutex_);
  peaks.step = static_cast<int64_t>(steps_.size());
  steps_.push_back(peaks);
  return peaks;
}

std::vector<StepPeaks> MemoryTracker::steps() const {
  const std::lock_guard<std::mutex> lock(mutex_);
  return steps_;
}

void MemoryTracker::start_sampling() {
  const std::lock_guard<std::mutex> lock(mutex_);
  if (sampler_.joinable() && !stop_) return;
  if (sampler_.joinable()) sampler_.join();  // a thread that stopped on an error
  stop_ = false;
  sampling_error_.clear();
  sampler_ = std::thread([this] { sample_loop(); });
}

void MemoryTracker::stop_sampling() {
  {
    const std::lock_guard<std::mutex> lock(mutex_);
    stop_ = true;
  }
  wake_.notify_all();
  if (sampler_.joinable()) sampler_.join();
}

bool MemoryTracker::sampling() const {
  const std::lock_guard<std::mutex> lock(mutex_);
  return sampler_.joinable() && !stop_;
}

std::string MemoryTracker::sampling_error() const {
  const std::lock_guard<std::mutex> lock(mutex_);
  return sampling_error_;
}

std::vector<MemorySample> MemoryTracker::timeline() const {
  const std::lock_guard<std::mutex> lock(mutex_);
  return timeline_;
}

void MemoryTracker::sample_loop() {
  const auto period = std::chrono::duration<double>(period_);
  auto next = std::chrono::steady_clock::now();
  std::unique_lock<std::mutex> lock(mutex_);
  while (!stop_) {
    lock.unlock();
    std::optional<MemorySample> s;
    std::string error;
    try {
      s = sample();  // outside the lock: reading /proc and NVML takes time
    } catch (const std::exception& e) {
      error = e.what();
    } catch (...) {
      error = "an exception that is not a std::exception";
    }
    lock.lock();
    if (!s) {  // nothing may escape a thread (std::terminate): stop and keep the reason
      sampling_error_ = "memory sampling stopped: " + error;
      stop_ = true;
      break;
    }
    timeline_.push_back(std::move(*s));
    next += std::chrono::duration_cast<std::chrono::steady_clock::duration>(period);
    wake_.wait_until(lock, next, [this] { return stop_; });
  }
}

}  // namespace dino_opt::memory
