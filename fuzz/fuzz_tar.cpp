// libFuzzer target: the tar reader of the shard index (512-byte headers,
// ustar name prefixes, pax records, GNU long names, base-256 sizes) and the
// grouping of members into samples with their `.cls` labels, on arbitrary
// bytes. Any outcome but success or a SourceError is a bug: a crash, a
// sanitizer report, another exception, a hang, a leak, or a member that the
// parser places outside the bytes.
#include <cstddef>
#include <cstdint>
#include <cstdlib>

#include "loader/tar_index.h"

using namespace dino_opt::loader;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const MemoryBytes bytes(data, size);
  try {
    const auto members = scan_tar(bytes);
    for (const TarMember& m : members) {
      if (m.offset % 512 != 0 || m.offset > size || m.size > size - m.offset) std::abort();
    }
    const ShardIndex index = shard_samples(members, bytes);
    if (index.names.size() != index.entries.size()) std::abort();
    for (const IndexEntry& e : index.entries) {
      if (e.offset > size || e.size > size - e.offset || e.label < -1) std::abort();
    }
  } catch (const SourceError&) {
    // Bad data, reported as such: the expected outcome for most inputs.
  }
  return 0;
}
