// EMA inner loop, once per instruction set (see kernel_table.h). Built with
// -ffp-contract=off: t*m + s*w is two roundings and one add, exactly as the
// CUDA kernel computes it, so both give bit-identical results. The plain loop
// is vectorised by the compiler for this build's instruction set.
#include "ops/cpu/vectorized/isa_common.h"

namespace dino_opt::cpu::CPU_CAPABILITY {
namespace {

template <typename T, typename S>
void ema_span(void* teacher, const void* student, int64_t n, double keep, double mix_in) {
  using A = acc_t<T>;
  T* __restrict t = static_cast<T*>(teacher);
  const S* __restrict s = static_cast<const S*>(student);
  const A k = static_cast<A>(keep);
  const A w = static_cast<A>(mix_in);
  for (int64_t i = 0; i < n; ++i) {
    t[i] = static_cast<T>(static_cast<A>(t[i]) * k + static_cast<A>(s[i]) * w);
  }
}

}  // namespace

void fill_ema_kernels(KernelTable& table) {
  for_each_float_type([&]<typename T>(int ti) {
    for_each_float_type([&]<typename S>(int si) { table.ema_span[ti][si] = &ema_span<T, S>; });
  });
}

}  // namespace dino_opt::cpu::CPU_CAPABILITY
