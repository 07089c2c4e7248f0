#include "memory/allocation_trace.h"

#include <ATen/record_function.h>
#include <c10/util/Exception.h>
#include <c10/util/ThreadLocalDebugInfo.h>
#include <torch/csrc/profiler/orchestration/observer.h>

#include <chrono>
#include <mutex>

namespace dino_opt::memory {
namespace impl = torch::profiler::impl;

namespace {

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

}  // namespace

// A profiler state whose configuration says "disabled" (so profilerEnabled()
// is false and torch records no operator) but which asks for memory reports.
struct AllocationTrace::State : impl::ProfilerStateBase {
  State() : impl::ProfilerStateBase(impl::ProfilerConfig(impl::ProfilerState::Disabled)) {}

  bool memoryProfilingEnabled() const override { return true; }
  impl::ActiveProfilerType profilerType() override { return impl::ActiveProfilerType::NONE; }

  void reportMemoryUsage(void* /*ptr*/, int64_t bytes, size_t /*total_allocated*/,
                         size_t /*total_reserved*/, c10::Device device) override {
    const int64_t t = now_ns() - origin;
    std::lock_guard<std::mutex> lock(mutex);
    events.push_back({t, bytes, static_cast<int>(device.type()), device.index()});
  }

  const int64_t origin = now_ns();
  mutable std::mutex mutex;
  std::vector<AllocationEvent> events;
  std::vector<AllocationRange> ranges;
};

namespace {

using State = AllocationTrace::State;

State* thread_state() {
  return dynamic_cast<State*>(c10::ThreadLocalDebugInfo::get(c10::DebugInfoKind::PROFILER_STATE));
}

struct RangeStart : at::ObserverContext {
  size_t first_event = 0;
  int64_t start_ns = 0;
};

std::unique_ptr<at::ObserverContext> on_range_start(const at::RecordFunction&) {
  State* state = thread_state();
  if (state == nullptr) return nullptr;
  auto ctx = std::make_unique<RangeStart>();
  ctx->start_ns = now_ns() - state->origin;
  std::lock_guard<std::mutex> lock(state->mutex);
  ctx->first_event = state->events.size();
  return ctx;
}

void on_range_end(const at::RecordFunction& fn, at::ObserverContext* ctx) {
  State* state = thread_state();
  if (state == nullptr || ctx == nullptr) return;
  const auto* start = static_cast<RangeStart*>(ctx);
  const int64_t end_ns = now_ns() - state->origin;
  std::lock_guard<std::mutex> lock(state->mutex);
  state->ranges.push_back(
      {fn.name(), start->first_event, state->events.size(), start->start_ns, end_ns});
}

}  // namespace

AllocationTrace::AllocationTrace() = default;

AllocationTrace::~AllocationTrace() {
  try {
    stop();
  } catch (...) {  // NOLINT(bugprone-empty-catch): a destructor must not throw
  }
}

void AllocationTrace::start() {
  TORCH_CHECK(!running_, "AllocationTrace: already running");
  TORCH_CHECK(c10::ThreadLocalDebugInfo::get(c10::DebugInfoKind::PROFILER_STATE) == nullptr,
              "AllocationTrace: torch's profiler or another allocation trace is already active "
              "on this thread; trace allocations outside it");
  state_ = std::make_shared<State>();
  impl::ProfilerStateBase::push(std::shared_ptr<impl::ProfilerStateBase>(state_));
  handle_ = at::addThreadLocalCallback(at::RecordFunctionCallback(&on_range_start, &on_range_end)
                                           .needsInputs(false)
                                           .scopes({at::RecordScope::USER_SCOPE}));
  running_ = true;
}

void AllocationTrace::stop() {
  if (!running_) return;
  running_ = false;
  at::removeCallback(handle_);
  handle_ = 0;
  // Throws if something pushed after start() is still on top of the reporter.
  auto popped = impl::ProfilerStateBase::pop(/*global=*/false);
  TORCH_CHECK(popped.get() == state_.get(),
              "AllocationTrace: stopped on another thread than the one that started it, or "
              "under another profiler state");
}

std::vector<AllocationEvent> AllocationTrace::events() const {
  if (!state_) return {};
  std::lock_guard<std::mutex> lock(state_->mutex);
  return state_->events;
}

std::vector<AllocationRange> AllocationTrace::ranges() const {
  if (!state_) return {};
  std::lock_guard<std::mutex> lock(state_->mutex);
  return state_->ranges;
}

}  // namespace dino_opt::memory
