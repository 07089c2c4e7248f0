#pragma once
// Allocation trace: every allocation and free that torch's allocators report
// (the CPU allocator and the CUDA caching allocator both report to whatever
// memory reporter is installed on the allocating thread), and the ranges that
// `torch.profiler.record_function` marks, without running torch's profiler.
//
// torch's profiler records every operator as an event and keeps them all; at
// its end it builds a tree of them. For a ConvNeXt step on the CPU that is
// half a million events and more time than the step itself. The memory
// reports need none of it: they go to the thread's PROFILER_STATE debug info
// if it says memory profiling is on. This installs a reporter there that
// says so (and says the profiler itself is off, so code that asks whether
// the profiler runs is told no), plus one RecordFunction callback for user
// ranges only, so that operators run no callback at all.
//
// The same semantics as torch's profiler with profile_memory=True: tensors
// allocated before start() are not counted when they are freed (the CPU
// allocator keeps sizes only while someone records).
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace dino_opt::memory {

struct AllocationEvent {
  int64_t time_ns = 0;  // steady clock, since start()
  int64_t bytes = 0;    // + allocated, - freed
  int device_type = 0;  // c10::DeviceType as an int (0: CPU, 1: CUDA)
  int device_index = -1;
};

// A user range (record_function): the events [first_event, end_event) were
// reported inside it, on any thread.
struct AllocationRange {
  std::string name;
  size_t first_event = 0, end_event = 0;
  int64_t start_ns = 0, end_ns = 0;
};

class AllocationTrace {
 public:
  AllocationTrace();
  ~AllocationTrace();  // stops a running trace
  AllocationTrace(const AllocationTrace&) = delete;
  AllocationTrace& operator=(const AllocationTrace&) = delete;

  // Installs the reporter and the range callback on the calling thread (the
  // autograd engine and intra-op threads inherit both, as they inherit
  // torch's profiler). Throws if this trace runs or torch's profiler (or
  // another trace) is active on this thread.
  void start();
  // Removes both; must be called on the thread that started it. Throws if
  // something pushed after start() is still installed above the reporter.
  void stop();
  bool running() const { return running_; }

  std::vector<AllocationEvent> events() const;
  // Ranges in the order they ended.
  std::vector<AllocationRange> ranges() const;

  struct State;  // the reporter (a torch profiler state that profiles nothing)

 private:
  std::shared_ptr<State> state_;
  uint64_t handle_ = 0;  // the RecordFunction callback
  bool running_ = false;
};

}  // namespace dino_opt::memory
