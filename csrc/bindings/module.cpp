// The one Python extension module, dino_opt._C. Operators register themselves
// when the core library loads; this module binds the plain C++ classes.
#include <pybind11/stl.h>
#include <torch/extension.h>

#include "bindings/bindings.h"
#include "build_info.h"
#include "memory/allocation_trace.h"
#include "memory/memory_tracker.h"
#include "profiler/profiler.h"

namespace py = pybind11;

namespace {

using dino_opt::bindings::without_gil;
using namespace dino_opt::memory;

py::dict to_dict(const HostMemory& h) {
  py::dict d;
  d["rss"] = h.rss;
  d["peak_rss"] = h.peak_rss;
  d["total"] = h.total;
  d["available"] = h.available;
  return d;
}

py::object to_dict(const std::optional<AllocatorMemory>& a) {
  if (!a) return py::none();
  py::dict d;
  d["allocated"] = a->allocated;
  d["reserved"] = a->reserved;
  d["active"] = a->active;
  d["peak_allocated"] = a->peak_allocated;
  d["peak_reserved"] = a->peak_reserved;
  d["peak_active"] = a->peak_active;
  d["alloc_retries"] = a->alloc_retries;
  d["ooms"] = a->ooms;
  return std::move(d);
}

py::object to_dict(const std::optional<DeviceMemory>& m) {
  if (!m) return py::none();
  py::dict d;
  d["total"] = m->total;
  d["used"] = m->used;
  d["free"] = m->free;
  return std::move(d);
}

py::dict to_dict(const MemorySample& s) {
  py::dict d;
  d["time"] = s.time;
  d["host"] = to_dict(s.host);
  d["allocator"] = to_dict(s.allocator);
  d["device"] = to_dict(s.device);
  return d;
}

py::dict to_dict(const StepPeaks& p) {
  py::dict d;
  d["step"] = p.step;
  d["seconds"] = p.seconds;
  d["host_peak_rss"] = p.host_peak_rss;
  d["device_peak_allocated"] = p.device_peak_allocated;
  d["device_peak_reserved"] = p.device_peak_reserved;
  return d;
}

namespace prof = dino_opt::profiler;

py::dict to_dict(const prof::Range& r) {
  py::dict d;
  d["name"] = r.name;
  d["step"] = r.step;
  d["depth"] = r.depth;
  d["thread"] = r.thread;
  d["host_ms"] = (r.host_end - r.host_start) / 1e3;
  d["host_start_us"] = r.host_start;
  d["device_ms"] = r.device_ms;
  return d;
}

py::dict to_dict(const prof::Step& s) {
  py::dict d;
  d["step"] = s.index;
  d["host_ms"] = (s.host_end - s.host_start) / 1e3;
  d["samples"] = s.samples;
  d["device_idle_ms"] = s.device_idle_ms;
  return d;
}

py::dict to_dict(const prof::Stats& s) {
  py::dict d;
  d["count"] = s.count;
  d["total"] = s.total;
  d["mean"] = s.mean;
  d["median"] = s.median;
  d["p95"] = s.p95;
  d["min"] = s.min;
  d["max"] = s.max;
  return d;
}

template <typename T>
py::list to_list(const std::vector<T>& items) {
  py::list out;
  for (const T& item : items) out.append(to_dict(item));
  return out;
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "dino_opt native core";
  m.def("build_info", &dino_opt::build_info, "How the native core was built");
  dino_opt::bindings::bind_sources(m);
  dino_opt::bindings::bind_loader(m);

  m.def(
      "read_host_memory", [] { return to_dict(read_host_memory()); },
      "Process RSS and peak RSS, system total and available memory (bytes), from /proc");
  m.def("nvml_status", &nvml_status, "Why NVML is unusable ('' when usable)");

  py::class_<MemoryTracker>(m, "MemoryTracker")
      .def(py::init<int, double>(), py::arg("device") = -1, py::arg("sample_period") = 0.1)
      .def_property_readonly("device", &MemoryTracker::device)
      .def("sample", [](const MemoryTracker& t) { return to_dict(t.sample()); })
      .def("start_step", &MemoryTracker::start_step)
      .def("end_step", [](MemoryTracker& t) { return to_dict(t.end_step()); })
      .def("steps", [](const MemoryTracker& t) { return to_list(t.steps()); })
      .def("start_sampling", &MemoryTracker::start_sampling)
      .def("stop_sampling", &MemoryTracker::stop_sampling, py::call_guard<py::gil_scoped_release>())
      .def("sampling", &MemoryTracker::sampling)
      .def("sampling_error", &MemoryTracker::sampling_error)
      .def("timeline", [](const MemoryTracker& t) { return to_list(t.timeline()); });

  py::class_<AllocationTrace>(m, "AllocationTrace")
      .def(py::init<>())
      .def("start", &AllocationTrace::start)
      .def("stop", &AllocationTrace::stop)
      .def_property_readonly("running", &AllocationTrace::running)
      .def("events",
           [](const AllocationTrace& t) {
             // (time ns, bytes, device type name, device index) per report
             py::list out;
             for (const AllocationEvent& e : t.events()) {
               const auto type = static_cast<c10::DeviceType>(e.device_type);
               out.append(py::make_tuple(e.time_ns, e.bytes, c10::DeviceTypeName(type, true),
                                         e.device_index));
             }
             return out;
           })
      .def("ranges", [](const AllocationTrace& t) {
        // (name, first event, end event, start ns, end ns), in the order they ended
        py::list out;
        for (const AllocationRange& r : t.ranges())
          out.append(py::make_tuple(r.name, r.first_event, r.end_event, r.start_ns, r.end_ns));
        return out;
      });

  using release_gil = py::call_guard<py::gil_scoped_release>;
  py::class_<prof::Profiler>(m, "Profiler")
      .def(py::init<int>(), py::arg("device") = -1)
      .def_property_readonly("device", &prof::Profiler::device)
      .def("push", &prof::Profiler::push, py::arg("name"))
      .def("pop", &prof::Profiler::pop)
      .def("step", &prof::Profiler::step, py::arg("samples") = 0)
      .def("current_step", &prof::Profiler::current_step)
      .def("range_count", &prof::Profiler::range_count)
      .def("synchronizations", &prof::Profiler::synchronizations)
      .def(
          "ranges",
          [](prof::Profiler& p, size_t first) {
            return to_list(without_gil([&] { return p.ranges(first); }));
          },
          py::arg("first") = 0)
      .def("steps",
           [](prof::Profiler& p) { return to_list(without_gil([&] { return p.steps(); })); })
      .def("stats",
           [](prof::Profiler& p) {
             const auto stats = without_gil([&] { return p.stats(); });
             py::dict out;
             for (const auto& [name, s] : stats) {
               py::dict d;
               d["host"] = to_dict(s.host);
               d["device"] = s.device.count ? py::object(to_dict(s.device)) : py::none();
               d["share_of_step"] = s.share_of_step;
               out[py::str(name)] = d;
             }
             return out;
           })
      .def("throughput", &prof::Profiler::throughput, release_gil())
      .def("chrome_trace", &prof::Profiler::chrome_trace, release_gil())
      .def("clear", &prof::Profiler::clear, release_gil());
}
