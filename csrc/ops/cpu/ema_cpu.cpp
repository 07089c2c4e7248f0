// CPU kernel of dino_opt::ema_update_: parallel over fixed-size chunks of all
// tensors (so one large and many tiny tensors balance alike); the inner loop
// is the instruction-set variant from the kernel table.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <vector>

#include "ops/cpu/kernel_table.h"
#include "ops/dtype.h"
#include "ops/ema.h"

namespace dino_opt {
namespace {

using ema_detail::FlatPair;

// Elements per parallel work item: large enough to amortise scheduling, small
// enough that a few big tensors still spread over all threads.
constexpr int64_t kChunk = 1 << 15;

void ema_group(cpu::EmaSpanFn span, int64_t teacher_size, int64_t student_size,
               const std::vector<FlatPair>& pairs, ema_detail::Coefficients c) {
  // first_chunk[i]: index of the first chunk of pair i; the chunks of all pairs
  // form one index space for parallel_for.
  std::vector<int64_t> first_chunk(pairs.size() + 1, 0);
  for (size_t i = 0; i < pairs.size(); ++i) {
    first_chunk[i + 1] = first_chunk[i] + (pairs[i].numel + kChunk - 1) / kChunk;
  }
  at::parallel_for(0, first_chunk.back(), 1, [&](int64_t begin, int64_t end) {
    size_t p =
        std::upper_bound(first_chunk.begin(), first_chunk.end(), begin) - first_chunk.begin() - 1;
    for (int64_t chunk = begin; chunk < end; ++chunk) {
      while (chunk >= first_chunk[p + 1]) ++p;
      const int64_t offset = (chunk - first_chunk[p]) * kChunk;
      span(static_cast<char*>(pairs[p].teacher) + offset * teacher_size,
           static_cast<const char*>(pairs[p].student) + offset * student_size,
           std::min(kChunk, pairs[p].numel - offset), c.keep, c.mix_in);
    }
  });
}

void ema_update_cpu(at::TensorList teacher, at::TensorList student, double momentum) {
  ema_detail::check_args(teacher, student, momentum, c10::DeviceType::CPU);
  const ema_detail::Coefficients c = ema_detail::coefficients(momentum);
  ema_detail::for_each_group(
      teacher, student,
      [&](at::ScalarType tt, at::ScalarType st, const std::vector<FlatPair>& pairs) {
        const auto span = cpu::kernels().ema_span[float_index(tt, "ema_update_", "teacher")]
                                                 [float_index(st, "ema_update_", "student")];
        ema_group(span, c10::elementSize(tt), c10::elementSize(st), pairs, c);
      });
}

}  // namespace

TORCH_LIBRARY_IMPL(dino_opt, CPU, m) { m.impl("ema_update_", &ema_update_cpu); }

}  // namespace dino_opt
