#pragma once
// Profiler: named, nestable ranges from any thread, timed on the host with a
// steady clock and, when a CUDA device is given, on the device with CUDA events
// recorded on the current stream (taken from a pool, resolved later: nothing in
// push/pop synchronises). Each range is also an NVTX range, so Nsight Systems
// shows the same names. Step boundaries give per-step shares, throughput and
// the device's idle time between steps. Plain C++; Python binds it.
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

namespace dino_opt::profiler {

struct Range {
  std::string name;
  int64_t step = 0;       // the step the range began in
  int depth = 0;          // nesting depth on its thread
  uint64_t thread = 0;    // a small per-thread id
  double host_start = 0;  // microseconds since the profiler was made
  double host_end = 0;
  std::optional<double> device_ms;  // GPU time between the range's two events
};

struct Step {
  int64_t index = 0;
  double host_start = 0, host_end = 0;   // microseconds
  int64_t samples = 0;                   // batch size given to step()
  std::optional<double> device_idle_ms;  // device idle before this step began
};

// Summary statistics of one set of durations (milliseconds).
struct Stats {
  int64_t count = 0;
  double total = 0, mean = 0, median = 0, p95 = 0, min = 0, max = 0;
};
// Linear-interpolated percentile (q in [0, 100]) as numpy's default does.
Stats summarize(std::vector<double> values_ms);

class Profiler {
 public:
  // device: CUDA device index for device timing, or -1 for host timing only.
  explicit Profiler(int device = -1);
  ~Profiler();
  Profiler(const Profiler&) = delete;
  Profiler& operator=(const Profiler&) = delete;

  void push(const std::string& name);
  void pop();  // ends the innermost open range of the calling thread
  // Ends the current step and starts the next; `samples` (e.g. the batch
  // size) feeds the throughput.
  void step(int64_t samples = 0);

  // Finished ranges from index `first` on (in order of finishing) and all
  // steps, with device times resolved; waits for the device events recorded
  // so far (call it off the hot path).
  std::vector<Range> ranges(size_t first = 0);
  std::vector<Step> steps();
  // Per name: host and device statistics (ms) and share of the step time.
  struct NameStats {
    Stats host, device;
    double share_of_step = 0;  // total host time / total time of finished steps
  };
  std::map<std::string, NameStats> stats();
  // Samples per second over finished steps (0 without samples).
  double throughput();

  // Chrome trace (chrome://tracing, Perfetto): host ranges on their threads;
  // device ranges, placed at their host start, on a "GPU" track.
  std::string chrome_trace();
  void clear();

  int64_t current_step() const;
  // Number of finished ranges held (clear() empties them).
  size_t range_count() const;
  int device() const { return device_; }
  // Number of device synchronisations the profiler has made (tests check that
  // push/pop make none).
  int64_t synchronizations() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
  const int device_;
};

// A range for the lifetime of a C++ scope: `ScopedRange r(profiler, "forward");`.
class ScopedRange {
 public:
  ScopedRange(Profiler& profiler, const std::string& name) : profiler_(profiler) {
    profiler_.push(name);
  }
  ~ScopedRange() { profiler_.pop(); }
  ScopedRange(const ScopedRange&) = delete;
  ScopedRange& operator=(const ScopedRange&) = delete;

 private:
  Profiler& profiler_;
};

}  // namespace dino_opt::profiler
