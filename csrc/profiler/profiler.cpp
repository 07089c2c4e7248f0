#include "profiler/profiler.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <sstream>
#include <thread>
#include <unordered_map>

#include "build_config.h"

#if DINO_OPT_WITH_CUDA
#include <ATen/Context.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#include <nvtx3/nvToolsExt.h>
#endif

namespace dino_opt::profiler {

Stats summarize(std::vector<double> v) {
  Stats s;
  s.count = static_cast<int64_t>(v.size());
  if (v.empty()) return s;
  std::sort(v.begin(), v.end());
  for (double x : v) s.total += x;
  s.mean = s.total / static_cast<double>(v.size());
  s.min = v.front();
  s.max = v.back();
  auto percentile = [&](double q) {
    const double pos = q / 100.0 * static_cast<double>(v.size() - 1);
    const size_t lo = static_cast<size_t>(std::floor(pos));
    const size_t hi = std::min(lo + 1, v.size() - 1);
    return v[lo] + (v[hi] - v[lo]) * (pos - static_cast<double>(lo));
  };
  s.median = percentile(50);
  s.p95 = percentile(95);
  return s;
}

namespace {
constexpr int kNoEvent = -1;

std::string json_string(const std::string& s) {
  std::string out = "\"";
  for (const char c : s) {
    switch (c) {
      case '"':
        out += "\\\"";
        break;
      case '\\':
        out += "\\\\";
        break;
      case '\n':
        out += "\\n";
        break;
      case '\t':
        out += "\\t";
        break;
      default:
        if (static_cast<unsigned char>(c) < 0x20) {
          char buf[8];
          std::snprintf(buf, sizeof(buf), "\\u%04x", c);
          out += buf;
        } else {
          out += c;
        }
    }
  }
  return out + "\"";
}
}  // namespace

struct Profiler::Impl {
  struct Open {
    std::string name;
    int64_t step;
    int depth;
    double host_start;
    int event_start;
  };
  struct Finished {
    Range range;
    int event_start = kNoEvent, event_end = kNoEvent;
    std::optional<double> device_start_ms;  // since the reference event
  };

  explicit Impl(int device) : device(device), origin(std::chrono::steady_clock::now()) {
#if DINO_OPT_WITH_CUDA
    // The first CUDA call of a process may be this one: initialise as torch does.
    if (device >= 0) at::globalContext().lazyInitDevice(c10::DeviceType::CUDA);
#endif
    reference_event = record_event();
  }
  ~Impl() {
#if DINO_OPT_WITH_CUDA
    for (cudaEvent_t e : events) cudaEventDestroy(e);
#endif
  }

  double now_us() const {
    return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - origin)
        .count();
  }

  uint64_t thread_id() {
    const auto id = std::this_thread::get_id();
    const auto it = thread_ids.find(id);
    if (it != thread_ids.end()) return it->second;
    const uint64_t small = thread_ids.size();
    thread_ids.emplace(id, small);
    return small;
  }

  // An event from the pool, recorded on the current stream (kNoEvent without a device).
  int record_event() {
#if DINO_OPT_WITH_CUDA
    if (device < 0) return kNoEvent;
    int index;
    if (!free_events.empty()) {
      index = free_events.back();
      free_events.pop_back();
    } else {
      const c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
      cudaEvent_t e;
      C10_CUDA_CHECK(cudaEventCreate(&e));
      events.push_back(e);
      index = static_cast<int>(events.size()) - 1;
    }
    C10_CUDA_CHECK(cudaEventRecord(
        events[index],
        c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(device)).stream()));
    return index;
#else
    return kNoEvent;
#endif
  }

  // Whether `event` has completed; with `wait`, waits for it (a counted
  // synchronisation). Without events (no device) there is nothing to wait for.
  bool ready(int event, bool wait) {
#if DINO_OPT_WITH_CUDA
    if (event == kNoEvent) return true;
    if (wait) {
      C10_CUDA_CHECK(cudaEventSynchronize(events[event]));
      ++synchronizations;
      return true;
    }
    const cudaError_t status = cudaEventQuery(events[event]);
    if (status == cudaErrorNotReady) {
      cudaGetLastError();  // clear the sticky "not ready"
      return false;
    }
    C10_CUDA_CHECK(status);
#endif
    return true;
  }

  // Whether the reference event (recorded when the profiler was made) has
  // completed; once it has, it stays so.
  bool reference_ready(bool wait) {
    if (!reference_done) reference_done = ready(reference_event, wait);
    return reference_done;
  }

  // Milliseconds between two completed events.
  std::optional<double> elapsed_ms(int from, int to) {
#if DINO_OPT_WITH_CUDA
    if (from == kNoEvent || to == kNoEvent) return std::nullopt;
    float ms = 0;
    C10_CUDA_CHECK(cudaEventElapsedTime(&ms, events[from], events[to]));
    return ms;
#else
    return std::nullopt;
#endif
  }

  void release(int& event) {
    if (event != kNoEvent) free_events.push_back(event);
    event = kNoEvent;
  }

  // Device times of the finished ranges and steps whose events have completed
  // (all of them, waiting, with `wait`); their events go back to the pool.
  void resolve(bool wait) {
    // Ranges and steps before the cursors are resolved already.
    for (; resolved_ranges < finished.size(); ++resolved_ranges) {
      Finished& f = finished[resolved_ranges];
      if (f.event_end == kNoEvent) continue;
      // The reference too: ranges recorded on another stream can finish before
      // it, and the elapsed time of an unfinished event is an error.
      if (!reference_ready(wait) || !ready(f.event_start, wait) || !ready(f.event_end, wait)) {
        break;
      }
      f.range.device_ms = elapsed_ms(f.event_start, f.event_end);
      f.device_start_ms = elapsed_ms(reference_event, f.event_start);
      release(f.event_start);
      release(f.event_end);
    }
    for (; resolved_steps < steps.size(); ++resolved_steps) {
      auto& [previous_end, first_work] = step_events[resolved_steps];
      if (!ready(previous_end, wait) || !ready(first_work, wait)) break;
      steps[resolved_steps].device_idle_ms = elapsed_ms(previous_end, first_work);
      release(previous_end);
      release(first_work);
    }
  }

  const int device;
  const std::chrono::steady_clock::time_point origin;
  std::mutex mutex;
  std::unordered_map<std::thread::id, std::vector<Open>> stacks;
  std::unordered_map<std::thread::id, uint64_t> thread_ids;
  std::vector<Finished> finished;
  std::vector<Step> steps;
  // Per step: (end event of the previous step, first event of this step).
  std::vector<std::pair<int, int>> step_events;
  int64_t step_index = 0;
  double step_start = 0;
  int previous_step_end = kNoEvent;
  bool step_has_work = false;
  int64_t synchronizations = 0;
  size_t resolved_ranges = 0, resolved_steps = 0;
  int reference_event = kNoEvent;
  bool reference_done = false;
#if DINO_OPT_WITH_CUDA
  std::vector<cudaEvent_t> events;
#endif
  std::vector<int> free_events;
};

Profiler::Profiler(int device) : device_(device) {
  TORCH_CHECK(device >= -1, "Profiler: device must be a CUDA device index or -1, got ", device);
  impl_ = std::make_unique<Impl>(device);
}

Profiler::~Profiler() = default;

void Profiler::push(const std::string& name) {
#if DINO_OPT_WITH_CUDA
  nvtxRangePushA(name.c_str());
#endif
  const std::lock_guard<std::mutex> lock(impl_->mutex);
  auto& stack = impl_->stacks[std::this_thread::get_id()];
  const int event = impl_->record_event();
  if (!impl_->step_has_work) {
    // The first device work of this step: the gap since the previous step's
    // end event is time the device waited for the host.
    impl_->step_has_work = true;
    impl_->step_events.emplace_back(impl_->previous_step_end, impl_->record_event());
    impl_->previous_step_end = kNoEvent;
  }
  stack.push_back(
      Impl::Open{name, impl_->step_index, static_cast<int>(stack.size()), impl_->now_us(), event});
}

void Profiler::pop() {
  const std::lock_guard<std::mutex> lock(impl_->mutex);
  auto& stack = impl_->stacks[std::this_thread::get_id()];
  TORCH_CHECK(!stack.empty(), "Profiler: pop() without a matching push() on this thread");
  const Impl::Open open = std::move(stack.back());
  stack.pop_back();
  Impl::Finished f;
  f.range = Range{open.name,       open.step,       open.depth,  impl_->thread_id(),
                  open.host_start, impl_->now_us(), std::nullopt};
  f.event_start = open.event_start;
  f.event_end = impl_->record_event();
  impl_->finished.push_back(std::move(f));
#if DINO_OPT_WITH_CUDA
  nvtxRangePop();
#endif
}

void Profiler::step(int64_t samples) {
  const std::lock_guard<std::mutex> lock(impl_->mutex);
  const double now = impl_->now_us();
  Step s;
  s.index = impl_->step_index++;
  s.host_start = impl_->step_start;
  s.host_end = now;
  s.samples = samples;
  if (!impl_->step_has_work) impl_->step_events.emplace_back(kNoEvent, kNoEvent);
  impl_->steps.push_back(s);
  impl_->resolve(/*wait=*/false);  // recycles the events of work already done
  impl_->release(impl_->previous_step_end);
  impl_->previous_step_end = impl_->record_event();
  impl_->step_has_work = false;
  impl_->step_start = now;
}

std::vector<Range> Profiler::ranges(size_t first) {
  const std::lock_guard<std::mutex> lock(impl_->mutex);
  impl_->resolve(/*wait=*/true);
  std::vector<Range> out;
  for (size_t i = first; i < impl_->finished.size(); ++i) out.push_back(impl_->finished[i].range);
  return out;
}

std::vector<Step> Profiler::steps() {
  const std::lock_guard<std::mutex> lock(impl_->mutex);
  impl_->resolve(/*wait=*/true);
  return impl_->steps;
}

std::map<std::string, Profiler::NameStats> Profiler::stats() {
  const std::vector<Range> all = ranges();
  const std::vector<Step> all_steps = steps();
  double step_ms = 0;
  for (const Step& s : all_steps) step_ms += (s.host_end - s.host_start) / 1e3;
  std::map<std::string, std::pair<std::vector<double>, std::vector<double>>> by_name;
  for (const Range& r : all) {
    auto& [host, dev] = by_name[r.name];
    host.push_back((r.host_end - r.host_start) / 1e3);
    if (r.device_ms) dev.push_back(*r.device_ms);
  }
  std::map<std::string, NameStats> out;
  for (auto& [name, times] : by_name) {
    NameStats ns{summarize(times.first), summarize(times.second), 0.0};
    ns.share_of_step = step_ms > 0 ? ns.host.total / step_ms : 0.0;
    out.emplace(name, ns);
  }
  return out;
}

double Profiler::throughput() {
  const std::vector<Step> all = steps();
  double seconds = 0;
  int64_t samples = 0;
  for (const Step& s : all) {
    seconds += (s.host_end - s.host_start) / 1e6;
    samples += s.samples;
  }
  return seconds > 0 ? static_cast<double>(samples) / seconds : 0.0;
}

std::string Profiler::chrome_trace() {
  const std::lock_guard<std::mutex> lock(impl_->mutex);
  impl_->resolve(/*wait=*/true);
  std::ostringstream out;
  out.precision(3);
  out << std::fixed << "{\"displayTimeUnit\":\"ms\",\"traceEvents\":[";
  out << "{\"name\":\"process_name\",\"ph\":\"M\",\"pid\":0,\"args\":{\"name\":\"host\"}}";
  out << ",{\"name\":\"process_name\",\"ph\":\"M\",\"pid\":1,\"args\":{\"name\":\"GPU\"}}";
  for (const auto& f : impl_->finished) {
    const Range& r = f.range;
    out << ",{\"name\":" << json_string(r.name) << ",\"ph\":\"X\",\"pid\":0,\"tid\":" << r.thread
        << ",\"ts\":" << r.host_start << ",\"dur\":" << (r.host_end - r.host_start)
        << ",\"args\":{\"step\":" << r.step << "}}";
    if (r.device_ms && f.device_start_ms) {
      out << ",{\"name\":" << json_string(r.name) << ",\"ph\":\"X\",\"pid\":1,\"tid\":" << r.depth
          << ",\"ts\":" << *f.device_start_ms * 1e3 << ",\"dur\":" << *r.device_ms * 1e3
          << ",\"args\":{\"step\":" << r.step << "}}";
    }
  }
  for (const Step& s : impl_->steps) {
    out << ",{\"name\":\"step " << s.index << "\",\"ph\":\"X\",\"pid\":0,\"tid\":1000000"
        << ",\"ts\":" << s.host_start << ",\"dur\":" << (s.host_end - s.host_start) << "}";
  }
  out << "]}";
  return out.str();
}

void Profiler::clear() {
  const std::lock_guard<std::mutex> lock(impl_->mutex);
  impl_->resolve(/*wait=*/true);
  impl_->finished.clear();
  impl_->steps.clear();
  impl_->step_events.clear();
  impl_->resolved_ranges = impl_->resolved_steps = 0;
  impl_->step_index = 0;
  impl_->step_has_work = false;
  impl_->step_start = impl_->now_us();
}

int64_t Profiler::current_step() const {
  const std::lock_guard<std::mutex> lock(impl_->mutex);
  return impl_->step_index;
}

size_t Profiler::range_count() const {
  const std::lock_guard<std::mutex> lock(impl_->mutex);
  return impl_->finished.size();
}

int64_t Profiler::synchronizations() const {
  const std::lock_guard<std::mutex> lock(impl_->mutex);
  return impl_->synchronizations;
}

}  // namespace dino_opt::profiler
