// The native memory tracker: /proc readings, per-step host peaks, the
// sampling thread's start and stop; the allocation trace's events and ranges.
#include <ATen/ATen.h>
#include <ATen/record_function.h>
#include <gtest/gtest.h>
#include <torch/csrc/profiler/orchestration/observer.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <stdexcept>
#include <thread>
#include <vector>

#include "memory/allocation_trace.h"
#include "memory/memory_tracker.h"
#include "test_util.h"

namespace {

using namespace dino_opt::memory;

TEST(Memory, HostReadingsAreSane) {
  const HostMemory h = read_host_memory();
  EXPECT_GT(h.rss, 0);
  EXPECT_GE(h.peak_rss, h.rss);
  EXPECT_GT(h.total, 0);
  EXPECT_GT(h.available, 0);
  EXPECT_LE(h.available, h.total);
}

TEST(Memory, StepPeakSeesATemporaryBuffer) {
  MemoryTracker tracker(-1, 0.1);
  tracker.start_step();
  const int64_t base = read_host_memory().rss;
  {
    std::vector<char> buffer(200 << 20);
    std::memset(buffer.data(), 1, buffer.size());  // make it resident
  }
  const StepPeaks peaks = tracker.end_step();
  EXPECT_GT(peaks.host_peak_rss - base, int64_t{180} << 20);
  EXPECT_FALSE(peaks.device_peak_allocated.has_value());
  EXPECT_EQ(tracker.steps().size(), 1u);
}

TEST(Memory, SamplingThreadStartsAndStops) {
  MemoryTracker tracker(-1, 0.01);
  tracker.start_sampling();
  EXPECT_TRUE(tracker.sampling());
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  tracker.stop_sampling();
  EXPECT_FALSE(tracker.sampling());
  const size_t n = tracker.timeline().size();
  EXPECT_GE(n, 3u);
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  EXPECT_EQ(tracker.timeline().size(), n);
}

// A tracker whose readings fail from the third on, as a CUDA call can fail
// inside the sampling thread.
class FailingTracker : public MemoryTracker {
 public:
  using MemoryTracker::MemoryTracker;
  ~FailingTracker() override { stop_sampling(); }  // before this class's part is gone
  MemorySample sample() const override {
    if (++calls_ > 2) throw std::runtime_error("the sensor went away");
    return MemoryTracker::sample();
  }

 private:
  mutable std::atomic<int> calls_{0};
};

TEST(Memory, AnErrorInTheSamplingThreadStopsItAndIsKept) {
  FailingTracker tracker(-1, 0.001);
  EXPECT_EQ(tracker.sampling_error(), "");
  tracker.start_sampling();
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (tracker.sampling() && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  EXPECT_FALSE(tracker.sampling());
  EXPECT_EQ(tracker.timeline().size(), 2u);  // the samples before the error are kept
  EXPECT_NE(tracker.sampling_error().find("the sensor went away"), std::string::npos)
      << tracker.sampling_error();
  tracker.stop_sampling();
  tracker.start_sampling();  // a new start clears the error and samples again (and fails)
  tracker.stop_sampling();
}

TEST(Memory, BadArguments) {
  dino_opt::testing::expect_error([] { MemoryTracker(-1, 0.0); }, "sample_period must be");
  dino_opt::testing::expect_error([] { MemoryTracker(-2, 0.1); }, "device must be");
  MemoryTracker tracker;
  dino_opt::testing::expect_error([&] { tracker.end_step(); }, "without start_step");
}

TEST(AllocationTrace, CountsEveryTensorAllocatedInsideAndItsRanges) {
  at::Tensor before = at::empty({1000}, at::kFloat);  // its free is not counted
  AllocationTrace trace;
  trace.start();
  EXPECT_FALSE(torch::profiler::impl::profilerEnabled());  // torch records no operator
  at::Tensor a = at::empty({250}, at::kDouble);            // +2000
  {
    RECORD_USER_SCOPE("step");
    at::Tensor b = at::empty({1000}, at::kByte);  // +1000, then -1000
    before.reset();
  }
  trace.stop();
  a.reset();  // after the trace: not counted
  const auto events = trace.events();
  ASSERT_EQ(events.size(), 3u);
  EXPECT_EQ(events[0].bytes, 2000);
  EXPECT_EQ(events[1].bytes, 1000);
  EXPECT_EQ(events[2].bytes, -1000);
  for (const auto& e : events) EXPECT_EQ(e.device_type, 0);
  EXPECT_LE(events[0].time_ns, events[2].time_ns);
  const auto ranges = trace.ranges();
  ASSERT_EQ(ranges.size(), 1u);
  EXPECT_EQ(ranges[0].name, "step");
  EXPECT_EQ(ranges[0].first_event, 1u);
  EXPECT_EQ(ranges[0].end_event, 3u);
  EXPECT_LE(ranges[0].start_ns, ranges[0].end_ns);
}

TEST(AllocationTrace, RefusesASecondTraceAndRestartsClean) {
  AllocationTrace trace, other;
  trace.start();
  dino_opt::testing::expect_error([&] { trace.start(); }, "already running");
  dino_opt::testing::expect_error([&] { other.start(); }, "already active on this thread");
  trace.stop();
  trace.stop();   // stopping twice is harmless
  other.start();  // the slot is free again
  at::Tensor t = at::empty({8}, at::kFloat);
  other.stop();
  EXPECT_EQ(other.events().size(), 1u);
  trace.start();  // a restart begins a new record
  trace.stop();
  EXPECT_TRUE(trace.events().empty());
}

}  // namespace
