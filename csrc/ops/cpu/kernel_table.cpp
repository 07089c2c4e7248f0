#include "ops/cpu/kernel_table.h"

namespace dino_opt::cpu {
namespace {

template <void (*FillEma)(KernelTable&), void (*FillLoss)(KernelTable&),
          void (*FillIbot)(KernelTable&)>
KernelTable make_table(const char* isa) {
  KernelTable table{};
  table.isa = isa;
  FillEma(table);
  FillLoss(table);
  FillIbot(table);
  return table;
}

KernelTable best_table() {
#if defined(__x86_64__) && defined(__GNUC__)
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq")) {
    return make_table<AVX512::fill_ema_kernels, AVX512::fill_dino_loss_kernels,
                      AVX512::fill_ibot_loss_kernels>("avx512");
  }
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
      __builtin_cpu_supports("f16c")) {
    return make_table<AVX2::fill_ema_kernels, AVX2::fill_dino_loss_kernels,
                      AVX2::fill_ibot_loss_kernels>("avx2");
  }
#endif
  return make_table<DEFAULT::fill_ema_kernels, DEFAULT::fill_dino_loss_kernels,
                    DEFAULT::fill_ibot_loss_kernels>("default");
}

}  // namespace

const KernelTable& kernels() {
  static const KernelTable table = best_table();
  return table;
}

}  // namespace dino_opt::cpu
