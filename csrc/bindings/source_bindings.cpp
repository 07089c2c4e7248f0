// Python bindings of the loader's sample sources (csrc/loader/sample_source.h,
// shard_source.h) and of the tar index helpers `dino-opt prepare` uses.
#include <pybind11/stl.h>
#include <torch/extension.h>

#include <tuple>

#include "bindings/bindings.h"
#include "loader/image_decode.h"
#include "loader/prepare.h"
#include "loader/sample_source.h"
#include "loader/shard_source.h"
#include "loader/tar_index.h"

namespace py = pybind11;

namespace dino_opt::bindings {
namespace {

using namespace dino_opt::loader;

void check_index(const SampleSource& s, int64_t index) {
  if (index < 0 || index >= s.size()) {
    throw py::index_error("index " + std::to_string(index) + " is outside the data set of " +
                          std::to_string(s.size()) + " samples");
  }
}

py::dict to_dict(const ReadStats& s) {
  py::dict d;
  d["reads"] = s.reads;
  d["bytes"] = s.bytes;
  d["sequential"] = s.sequential;
  d["opens"] = s.opens;
  return d;
}

py::list entries_of(const ShardIndex& index) {
  py::list out;
  for (size_t i = 0; i < index.entries.size(); ++i) {
    const IndexEntry& e = index.entries[i];
    out.append(py::make_tuple(i < index.names.size() ? index.names[i] : std::string(), e.offset,
                              e.size, e.label));
  }
  return out;
}

// (length, bytes: validity, offsets, data, offset, large, paths: the same five, file, file_row),
// buffer addresses as integers (0: none).
using ChunkTuple = std::tuple<int64_t, uintptr_t, uintptr_t, uintptr_t, int64_t, bool, uintptr_t,
                              uintptr_t, uintptr_t, int64_t, bool, int32_t, int64_t>;

ArrowChunk to_chunk(const ChunkTuple& t) {
  ArrowChunk c;
  c.length = std::get<0>(t);
  c.bytes = {reinterpret_cast<const uint8_t*>(std::get<1>(t)),
             reinterpret_cast<const void*>(std::get<2>(t)),
             reinterpret_cast<const uint8_t*>(std::get<3>(t)), std::get<4>(t), std::get<5>(t)};
  c.paths = {reinterpret_cast<const uint8_t*>(std::get<6>(t)),
             reinterpret_cast<const void*>(std::get<7>(t)),
             reinterpret_cast<const uint8_t*>(std::get<8>(t)), std::get<9>(t), std::get<10>(t)};
  c.file = std::get<11>(t);
  c.file_row = std::get<12>(t);
  return c;
}

// Owns a Python object from C++; released with the GIL held (leaked at
// interpreter shutdown, when Python no longer runs).
std::shared_ptr<void> hold(py::object object) {
  return std::shared_ptr<void>(new py::object(std::move(object)), [](void* p) {
    if (!Py_IsInitialized()) return;
    py::gil_scoped_acquire gil;
    delete static_cast<py::object*>(p);
  });
}

}  // namespace

void bind_sources(py::module_& m) {
  py::register_exception<SourceError>(m, "SourceError", PyExc_ValueError);

  py::class_<SampleSource, std::shared_ptr<SampleSource>>(m, "SampleSource")
      .def("__len__", &SampleSource::size)
      .def(
          "label",
          [](const SampleSource& s, int64_t i) {
            check_index(s, i);
            return s.label(i);
          },
          py::arg("index"))
      .def("labels",
           [](const SampleSource& s) {
             at::Tensor out = at::empty({s.size()}, at::kLong);
             auto* p = out.data_ptr<int64_t>();
             for (int64_t i = 0; i < s.size(); ++i) p[i] = s.label(i);
             return out;
           })
      .def(
          "describe",
          [](const SampleSource& s, int64_t i) {
            check_index(s, i);
            return s.describe(i);
          },
          py::arg("index"),
          "What names a sample in messages: its path, 'shard: member', 'file: row N'")
      .def(
          "read",
          [](const SampleSource& s, int64_t i) {
            check_index(s, i);
            std::vector<uint8_t> bytes;
            without_gil([&] {
              try {
                s.read(i, -1, bytes);
              } catch (const ImageError& e) {
                throw ImageError(s.describe(i) + ": " + e.what());
              } catch (const SourceError& e) {
                throw SourceError(s.describe(i) + ": " + e.what());
              }
            });
            return py::bytes(reinterpret_cast<const char*>(bytes.data()), bytes.size());
          },
          py::arg("index"), "A sample's encoded image bytes (errors name the sample)")
      .def("read_stats", [](const SampleSource& s) { return to_dict(s.read_stats()); })
      .def_property_readonly("table_bytes", &SampleSource::table_bytes);

  py::class_<FileSource, SampleSource, std::shared_ptr<FileSource>>(m, "FileSource")
      .def(py::init([](std::string root, const std::vector<std::string>& paths,
                       const std::vector<int64_t>& labels) {
             if (labels.size() != paths.size()) {
               throw std::invalid_argument("labels has " + std::to_string(labels.size()) +
                                           " entries for " + std::to_string(paths.size()) +
                                           " paths");
             }
             auto source = std::make_shared<FileSource>(std::move(root));
             size_t bytes = 0;
             for (const auto& p : paths) bytes += p.size();
             source->reserve(paths.size(), bytes);
             for (size_t i = 0; i < paths.size(); ++i) {
               if (labels[i] < -1 || labels[i] > INT32_MAX)
                 throw std::invalid_argument("label " + std::to_string(labels[i]) +
                                             " is outside [-1, 2^31)");
               source->add(paths[i], static_cast<int32_t>(labels[i]));
             }
             return source;
           }),
           py::arg("root"), py::arg("paths"), py::arg("labels"))
      .def("path", [](const FileSource& s, int64_t i) {
        check_index(s, i);
        return s.path(i);
      });

  m.def(
      "read_file_list",
      [](const std::string& list_path, const std::string& root) {
        FileList list = without_gil([&] { return read_file_list(list_path, root); });
        return py::make_tuple(std::static_pointer_cast<FileSource>(list.source), list.classes);
      },
      py::arg("list_path"), py::arg("root"),
      "A text or CSV file list as a FileSource, and its class names (empty for integer labels)");

  py::class_<ShardSource, SampleSource, std::shared_ptr<ShardSource>>(m, "ShardSource")
      .def(py::init([](std::vector<std::string> shards,
                       std::vector<std::vector<std::string>> index_paths, int streams,
                       int64_t read_block, int threads) {
             ShardSourceOptions o;
             o.streams = streams;
             o.read_block = read_block;
             o.threads = threads;
             return without_gil([&] {
               return std::make_shared<ShardSource>(std::move(shards), std::move(index_paths), o);
             });
           }),
           py::arg("shards"), py::arg("index_paths"), py::arg("streams") = 4,
           py::arg("read_block") = int64_t{8} << 20, py::arg("threads") = 0)
      .def_property_readonly("num_shards", &ShardSource::num_shards)
      .def("shard_path", &ShardSource::shard_path, py::arg("shard"))
      .def("shard_of",
           [](const ShardSource& s, int64_t i) {
             check_index(s, i);
             return s.shard_of(i);
           })
      .def("index_path", &ShardSource::index_path, py::arg("shard"))
      .def("index_report", [](const ShardSource& s) {
        const ShardIndexReport& r = s.index_report();
        py::dict d;
        d["loaded"] = r.loaded;
        d["built"] = r.built;
        d["written"] = r.written;
        d["unwritten"] = r.unwritten;
        return d;
      });

  py::class_<ArrowSource, SampleSource, std::shared_ptr<ArrowSource>>(m, "ArrowSource")
      .def(py::init([](std::vector<std::string> files, const std::vector<ChunkTuple>& chunks,
                       std::vector<int32_t> labels, py::object keepalive) {
             std::vector<ArrowChunk> parsed;
             for (const auto& c : chunks) parsed.push_back(to_chunk(c));
             return std::make_shared<ArrowSource>(std::move(files), std::move(parsed),
                                                  std::move(labels), hold(std::move(keepalive)));
           }),
           py::arg("files"), py::arg("chunks"), py::arg("labels"), py::arg("keepalive"));

  m.def(
      "index_shard",
      [](const std::string& path, const std::string& index_path) {
        const ShardIndex index = without_gil([&] {
          ShardIndex built = index_shard(path);
          if (!index_path.empty()) write_shard_index(built, index_path);
          return built;
        });
        return entries_of(index);
      },
      py::arg("path"), py::arg("index_path") = "",
      "Scans a tar shard: its samples as (name, offset, size, label); writes the index file when "
      "index_path is given");
  m.def(
      "write_shard_index",
      [](const std::string& index_path, uint64_t shard_size, int64_t mtime_ns,
         const std::vector<uint64_t>& offsets, const std::vector<uint32_t>& sizes,
         const std::vector<int32_t>& labels, std::vector<std::string> names) {
        if (sizes.size() != offsets.size() || labels.size() != offsets.size() ||
            names.size() != offsets.size())
          throw std::invalid_argument("offsets, sizes, labels and names differ in length");
        ShardIndex index{shard_size, mtime_ns, {}, std::move(names)};
        for (size_t i = 0; i < offsets.size(); ++i)
          index.entries.push_back({offsets[i], sizes[i], labels[i]});
        without_gil([&] { write_shard_index(index, index_path); });
      },
      py::arg("index_path"), py::arg("shard_size"), py::arg("mtime_ns"), py::arg("offsets"),
      py::arg("sizes"), py::arg("labels"), py::arg("names"),
      "Writes an index file for a shard of that size and mtime (what a scan would find)");
  m.def(
      "read_shard_index",
      [](const std::string& index_path) -> py::object {
        const auto index = read_shard_index(index_path, true);
        if (!index) return py::none();
        return py::make_tuple(index->shard_size, index->shard_mtime_ns, entries_of(*index));
      },
      py::arg("index_path"),
      "An index file as (shard size, shard mtime in ns, [(name, offset, size, label)]), or None");
  m.def(
      "scan_tar",
      [](const py::bytes& data) {
        const std::string_view v = data;
        const MemoryBytes bytes(reinterpret_cast<const uint8_t*>(v.data()), v.size());
        py::list out;
        for (const TarMember& t : scan_tar(bytes))
          out.append(py::make_tuple(t.name, t.offset, t.size));
        return out;
      },
      py::arg("data"), "The regular-file members of tar bytes as (name, data offset, size)");
  m.def(
      "reencode_bytes",
      [](const py::bytes& data, int max_side, int quality, int64_t max_pixels) {
        const std::string_view v = data;
        const std::vector<uint8_t> out = without_gil([&] {
          return reencode_bytes(reinterpret_cast<const uint8_t*>(v.data()), v.size(), max_side,
                                quality, DecodeOptions{max_pixels});
        });
        return py::bytes(reinterpret_cast<const char*>(out.data()), out.size());
      },
      py::arg("data"), py::arg("max_side"), py::arg("quality"),
      py::arg("max_pixels") = DecodeOptions{}.max_pixels,
      "Encoded image bytes re-encoded as JPEG with the longer side at most max_side");
}

}  // namespace dino_opt::bindings
