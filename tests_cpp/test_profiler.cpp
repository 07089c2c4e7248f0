// The native profiler: statistics against hand-computed values, nesting,
// ranges from several threads, the Chrome trace's shape.
#include <gtest/gtest.h>

#include <chrono>
#include <string>
#include <thread>
#include <vector>

#include "profiler/profiler.h"
#include "test_util.h"

namespace {

using namespace dino_opt::profiler;

TEST(Profiler, SummarizeMatchesHandComputedPercentiles) {
  const Stats s = summarize({5, 1, 4, 2, 3});
  EXPECT_EQ(s.count, 5);
  EXPECT_DOUBLE_EQ(s.total, 15);
  EXPECT_DOUBLE_EQ(s.mean, 3);
  EXPECT_DOUBLE_EQ(s.median, 3);
  EXPECT_DOUBLE_EQ(s.p95, 4.8);  // 0.95 * 4 = 3.8 -> 4 + 0.8 * (5 - 4)
  EXPECT_DOUBLE_EQ(s.min, 1);
  EXPECT_DOUBLE_EQ(s.max, 5);
  EXPECT_EQ(summarize({}).count, 0);
}

TEST(Profiler, NestingAndSteps) {
  Profiler p;
  for (int i = 0; i < 2; ++i) {
    p.push("outer");
    {
      const ScopedRange inner(p, "inner");
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
    p.pop();
    p.step(8);
  }
  const auto ranges = p.ranges();
  ASSERT_EQ(ranges.size(), 4u);
  EXPECT_EQ(ranges[0].name, "inner");
  EXPECT_EQ(ranges[0].depth, 1);
  EXPECT_EQ(ranges[1].depth, 0);
  EXPECT_EQ(ranges[3].step, 1);
  const auto stats = p.stats();
  EXPECT_EQ(stats.at("inner").host.count, 2);
  EXPECT_GE(stats.at("inner").host.min, 2.0);
  EXPECT_GT(stats.at("outer").share_of_step, 0.5);
  EXPECT_GT(p.throughput(), 0);
  EXPECT_EQ(p.synchronizations(), 0);
  dino_opt::testing::expect_error([&] { p.pop(); }, "without a matching push");
}

TEST(Profiler, RangesFromSeveralThreads) {
  Profiler p;
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&p, t] {
      for (int i = 0; i < 100; ++i) {
        p.push("thread" + std::to_string(t));
        p.push("inner");
        p.pop();
        p.pop();
      }
    });
  }
  for (auto& t : threads) t.join();
  const auto ranges = p.ranges();
  EXPECT_EQ(ranges.size(), 800u);
  for (const auto& r : ranges) EXPECT_EQ(r.depth, r.name == "inner" ? 1 : 0);
}

TEST(Profiler, ChromeTraceHasTheEvents) {
  Profiler p;
  p.push("a \"b\"");
  p.pop();
  p.step();
  const std::string trace = p.chrome_trace();
  EXPECT_EQ(trace.front(), '{');
  EXPECT_EQ(trace.back(), '}');
  EXPECT_NE(trace.find("\"a \\\"b\\\"\""), std::string::npos);
  EXPECT_NE(trace.find("\"step 0\""), std::string::npos);
}

}  // namespace
