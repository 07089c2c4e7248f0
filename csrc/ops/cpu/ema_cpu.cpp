// CPU kernel of dino_opt::ema_update_: parallel over fixed-size chunks of all
// tensors (so one large and many tiny tensors balance alike), vectorised by the
// compiler inside ISA-specific clones chosen at run time.
//
// Compiled with -ffp-contract=off: t*m + s*w is two roundings and one add,
// exactly as the CUDA kernel does it, so both give bit-identical results.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <type_traits>
#include <vector>

#include "ops/ema.h"

namespace dino_opt {
namespace {

using ema_detail::FlatPair;

// Elements per parallel work item: large enough to amortise scheduling, small
// enough that a few big tensors still spread over all threads.
constexpr int64_t kChunk = 1 << 15;

template <typename T>
using opmath_t = std::conditional_t<std::is_same_v<T, double>, double, float>;

template <typename T, typename S>
inline __attribute__((always_inline)) void ema_span(T* __restrict t, const S* __restrict s,
                                                    int64_t n, opmath_t<T> keep,
                                                    opmath_t<T> mix_in) {
  using acc_t = opmath_t<T>;
  for (int64_t i = 0; i < n; ++i) {
    t[i] = static_cast<T>(static_cast<acc_t>(t[i]) * keep + static_cast<acc_t>(s[i]) * mix_in);
  }
}

#if defined(__x86_64__) && defined(__GNUC__)
#define DINO_OPT_ISA_CLONES 1
template <typename T, typename S>
__attribute__((target("avx512f,avx512bw,avx512vl,f16c"))) void ema_span_avx512(T* t, const S* s,
                                                                               int64_t n,
                                                                               opmath_t<T> keep,
                                                                               opmath_t<T> mix_in) {
  ema_span(t, s, n, keep, mix_in);
}
template <typename T, typename S>
__attribute__((target("avx2,f16c"))) void ema_span_avx2(T* t, const S* s, int64_t n,
                                                        opmath_t<T> keep, opmath_t<T> mix_in) {
  ema_span(t, s, n, keep, mix_in);
}
#endif

template <typename T, typename S>
void ema_group(const std::vector<FlatPair>& pairs, ema_detail::Coefficients c) {
  using acc_t = opmath_t<T>;
  using SpanFn = void (*)(T*, const S*, int64_t, acc_t, acc_t);
  SpanFn span = [](T* t, const S* s, int64_t n, acc_t k, acc_t w) { ema_span(t, s, n, k, w); };
#ifdef DINO_OPT_ISA_CLONES
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl")) {
    span = &ema_span_avx512<T, S>;
  } else if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c")) {
    span = &ema_span_avx2<T, S>;
  }
#endif
  // first_chunk[i]: index of the first chunk of pair i; the chunks of all pairs
  // form one index space for parallel_for.
  std::vector<int64_t> first_chunk(pairs.size() + 1, 0);
  for (size_t i = 0; i < pairs.size(); ++i) {
    first_chunk[i + 1] = first_chunk[i] + (pairs[i].numel + kChunk - 1) / kChunk;
  }
  const acc_t k = static_cast<acc_t>(c.keep);
  const acc_t w = static_cast<acc_t>(c.mix_in);
  at::parallel_for(0, first_chunk.back(), 1, [&](int64_t begin, int64_t end) {
    size_t p =
        std::upper_bound(first_chunk.begin(), first_chunk.end(), begin) - first_chunk.begin() - 1;
    for (int64_t c = begin; c < end; ++c) {
      while (c >= first_chunk[p + 1]) ++p;
      const int64_t offset = (c - first_chunk[p]) * kChunk;
      const int64_t n = std::min(kChunk, pairs[p].numel - offset);
      span(static_cast<T*>(pairs[p].teacher) + offset,
           static_cast<const S*>(pairs[p].student) + offset, n, k, w);
    }
  });
}

void ema_update_cpu(at::TensorList teacher, at::TensorList student, double momentum) {
  ema_detail::check_args(teacher, student, momentum, c10::DeviceType::CPU);
  const ema_detail::Coefficients c = ema_detail::coefficients(momentum);
  ema_detail::for_each_group(
      teacher, student,
      [&](at::ScalarType tt, at::ScalarType st, const std::vector<FlatPair>& pairs) {
        AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, tt, "ema_update_cpu", [&] {
          using teacher_t = scalar_t;
          AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, st, "ema_update_cpu",
                                          [&] { ema_group<teacher_t, scalar_t>(pairs, c); });
        });
      });
}

}  // namespace

TORCH_LIBRARY_IMPL(dino_opt, CPU, m) { m.impl("ema_update_", &ema_update_cpu); }

}  // namespace dino_opt
