#pragma once
// Inner loops of the CPU kernels, compiled once per instruction set (DEFAULT,
// AVX2, AVX512: csrc/ops/cpu/vectorized/*.cpp with ATen's CPU_CAPABILITY
// flags, so at::vec::Vectorized and its Sleef exp are the fast ones) and
// chosen once at run time. The outer loops (parallel_for, checks) call through
// this table from ordinary translation units.
#include <cstdint>

#include "ops/kernel_types.h"

namespace dino_opt::cpu {

// t[i] = keep * t[i] + mix_in * s[i] for i < n, in the teacher's accumulation type.
using EmaSpanFn = void (*)(void* teacher, const void* student, int64_t n, double keep,
                           double mix_in);

// DINO loss inner loops over one chunk of n elements. Rows are given as raw
// pointers of the input dtype; `center` is in the accumulation type (double for
// float64 inputs, float otherwise) and already offset to the chunk.
struct DinoLossKernels {
  // max and sum(exp(x - max)) of x = (row - center) * inv_temp (center may be null).
  void (*row_stats)(const void* row, const void* center, int64_t n, double inv_temp,
                    double* max_out, double* sum_out);
  // One sample's chunk of n elements, each logit read once: per teacher view t,
  // teacher_max[t] = m_t and teacher_sum[t] = sum_k w_t[k], w_t = exp(u_t - m_t)
  // (u_t = (teacher_t - center) * inv_tt; w_t = 0 where m_t = -inf); per student
  // view v, student_max[v] and student_sum[v] as row_stats of x_v = student_v * inv_ts,
  // and dots[v * n_teacher + t] = sum_k w_t[k] * (x_v[k] - chunk_shift(m_v)), no term
  // where w_t[k] = 0. scratch holds n_teacher * n accumulation-type values.
  void (*chunk_forward)(const void* const* teacher, int64_t n_teacher, const void* const* student,
                        int64_t n_student, const void* center, int64_t n, double inv_ts,
                        double inv_tt, double* teacher_max, double* teacher_sum,
                        double* student_max, double* student_sum, double* dots, void* scratch);
  // grad_v[k] = scale * inv_ts * (w_v * exp(student_v[k] * inv_ts - lse_s[v])
  //                               - sum_{t != u} p_t[k]),  w_v = n_teacher - (u < n_teacher),
  // where u = v + view_offset is student view v's place among all student views.
  // scratch holds (n_teacher + 1) * n accumulation-type values.
  void (*student_grad)(const void* const* teacher, int64_t n_teacher, const void* const* student,
                       void* const* grad, int64_t n_student, int64_t view_offset,
                       const void* center, int64_t n, double inv_ts, double inv_tt,
                       const double* lse_t, const double* lse_s, double scale, void* scratch);
};

// iBOT loss inner loops over one chunk of n elements of a student row and its
// target row (the student's dtype, or float32 for a bfloat16/float16 student).
// The chunk's max and sum of exp come from DinoLossKernels::row_stats.
struct IbotLossKernels {
  // dot = sum_k t[k] * (student[k] * inv_temp - shift), no term where t[k] = 0
  // (0 log 0 = 0), and tsum = sum_k t[k].
  void (*target_dot)(const void* targets, const void* student, int64_t n, double inv_temp,
                     double shift, double* dot_out, double* tsum_out);
  // tsum = sum_k t[k].
  void (*target_sum)(const void* targets, int64_t n, double* tsum_out);
  // grad[k] = scale * (tsum * exp(student[k] * inv_temp - lse) - t[k]).
  void (*student_grad)(const void* targets, const void* student, void* grad, int64_t n,
                       double inv_temp, double lse, double tsum, double scale);
};

// Targets of an iBOT kernel: the student's dtype, or float32 under a half student.
enum IbotTargets : int { kSameTargets = 0, kFloatTargets = 1, kNumTargets = 2 };

struct KernelTable {
  const char* isa;
  EmaSpanFn ema_span[kNumFloat][kNumFloat];           // [teacher][student]
  DinoLossKernels dino_loss[kNumFloat];               // by input dtype
  IbotLossKernels ibot_loss[kNumFloat][kNumTargets];  // [student][targets]
};

// The table for the best instruction set this CPU supports.
const KernelTable& kernels();

// Filled by each instruction-set variant.
#define DINO_OPT_DECLARE_ISA(ISA)                  \
  namespace ISA {                                  \
  void fill_ema_kernels(KernelTable& table);       \
  void fill_dino_loss_kernels(KernelTable& table); \
  void fill_ibot_loss_kernels(KernelTable& table); \
  }
DINO_OPT_DECLARE_ISA(DEFAULT)
DINO_OPT_DECLARE_ISA(AVX2)
DINO_OPT_DECLARE_ISA(AVX512)
#undef DINO_OPT_DECLARE_ISA

}  // namespace dino_opt::cpu
