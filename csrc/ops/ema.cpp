// Schema of dino_opt::ema_update_ and the argument checks shared by all kernels.
#include "ops/ema.h"

#include <ATen/MemoryOverlap.h>
#include <ATen/core/LegacyTypeDispatch.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <cmath>
#include <map>
#include <string>
#include <utility>

#include "ops/dtype.h"

namespace dino_opt {

TORCH_LIBRARY_FRAGMENT(dino_opt, m) {
  m.def("ema_update_(Tensor(a!)[] teacher, Tensor[] student, float momentum) -> ()");
}

// Devices without a compiled kernel (and empty lists, which have no device)
// reach the plain-torch kernel that the Python package registers under
// CompositeExplicitAutograd (dino_opt.ops.fallback).

// As for native in-place ops: bump the version counters of the mutated
// teacher tensors, so that autograd refuses a backward through values that
// were saved before this update instead of computing with the new ones.
void ema_update_ad_inplace_or_view(c10::DispatchKeySet keys, at::TensorList teacher,
                                   at::TensorList student, double momentum) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("dino_opt::ema_update_", "")
                       .typed<void(at::TensorList, at::TensorList, double)>();
  {
    at::AutoDispatchBelowADInplaceOrView guard;
    op.redispatch(keys & c10::after_ADInplaceOrView_keyset, teacher, student, momentum);
  }
  for (const at::Tensor& t : teacher) t.unsafeGetTensorImpl()->bump_version();
}

TORCH_LIBRARY_IMPL(dino_opt, ADInplaceOrView, m) {
  m.impl("ema_update_", &ema_update_ad_inplace_or_view);
}

void ema_update_(at::TensorList teacher, at::TensorList student, double momentum) {
  if (teacher.empty() && student.empty()) {  // nothing to dispatch on, nothing to do
    ema_detail::check_args(teacher, student, momentum, c10::DeviceType::CPU);
    return;
  }
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("dino_opt::ema_update_", "")
                       .typed<void(at::TensorList, at::TensorList, double)>();
  op.call(teacher, student, momentum);
}

namespace ema_detail {
namespace {

// Dense tensors with equal strides occupy [data_ptr, data_ptr + numel) in the
// same element order, so they can be updated as flat spans.
bool same_dense_layout(const at::Tensor& t, const at::Tensor& s) {
  return t.is_non_overlapping_and_dense() && t.strides() == s.strides();
}

}  // namespace

void check_args(at::TensorList teacher, at::TensorList student, double momentum,
                c10::DeviceType device_type) {
  TORCH_CHECK(teacher.size() == student.size(), "ema_update_: teacher has ", teacher.size(),
              " tensors but student has ", student.size());
  TORCH_CHECK(std::isfinite(momentum) && momentum >= 0.0 && momentum <= 1.0,
              "ema_update_: momentum must be in [0, 1], got ", momentum);
  for (size_t i = 0; i < teacher.size(); ++i) {
    const at::Tensor& t = teacher[i];
    const at::Tensor& s = student[i];
    TORCH_CHECK(t.defined() && s.defined(), "ema_update_: teacher[", i, "] or student[", i,
                "] is undefined");
    TORCH_CHECK(t.device().type() == device_type, "ema_update_: teacher[", i, "] is on ",
                t.device(), " but the ", c10::DeviceTypeName(device_type),
                " kernel is running (teacher[0] is on ", teacher[0].device(),
                "); all tensors must be on one device");
    TORCH_CHECK(s.device() == t.device(), "ema_update_: teacher[", i, "] is on ", t.device(),
                " but student[", i, "] is on ", s.device());
    TORCH_CHECK(t.device() == teacher[0].device(), "ema_update_: teacher[", i, "] is on ",
                t.device(), " but teacher[0] is on ", teacher[0].device());
    float_index(t.scalar_type(), "ema_update_", ("teacher[" + std::to_string(i) + "]").c_str());
    float_index(s.scalar_type(), "ema_update_", ("student[" + std::to_string(i) + "]").c_str());
    TORCH_CHECK(t.sizes() == s.sizes(), "ema_update_: teacher[", i, "] has shape ", t.sizes(),
                " but student[", i, "] has shape ", s.sizes());
    TORCH_CHECK(!t.requires_grad(), "ema_update_: teacher[", i,
                "] requires grad; the teacher is updated in place and must not require grad "
                "(call teacher.requires_grad_(False))");
    TORCH_CHECK(at::has_internal_overlap(t) != at::MemOverlap::Yes, "ema_update_: teacher[", i,
                "] has overlapping memory (an expanded view) and cannot be written in place");
  }
}

Coefficients coefficients(double momentum) { return Coefficients{momentum, 1.0 - momentum}; }

void for_each_group(at::TensorList teacher, at::TensorList student, const GroupFn& run) {
  std::map<std::pair<at::ScalarType, at::ScalarType>, std::vector<FlatPair>> groups;
  // Temporaries for pairs that are not dense with identical layouts: keep them
  // alive until every group has run, then copy the results back.
  std::vector<std::pair<at::Tensor, at::Tensor>> write_back;
  std::vector<at::Tensor> keep_alive;
  for (size_t i = 0; i < teacher.size(); ++i) {
    at::Tensor t = teacher[i];
    at::Tensor s = student[i];
    if (t.numel() == 0) continue;
    if (!same_dense_layout(t, s)) {
      if (!t.is_contiguous()) {
        at::Tensor tmp = t.contiguous();
        write_back.emplace_back(t, tmp);
        t = tmp;
      }
      s = s.contiguous();
      keep_alive.push_back(s);
    }
    groups[{t.scalar_type(), s.scalar_type()}].push_back(
        FlatPair{t.data_ptr(), s.const_data_ptr(), t.numel()});
  }
  for (const auto& [dtypes, pairs] : groups) run(dtypes.first, dtypes.second, pairs);
  for (auto& [dst, tmp] : write_back) dst.copy_(tmp);
}

}  // namespace ema_detail
}  // namespace dino_opt
