#pragma once
// Fused Gram anchoring loss (DINOv3): the mean squared difference between the
// Gram matrices of the L2-normalised patch features of the student and of the
// Gram teacher, per image or over the batch, without an N x N matrix
// (docs/loss.md, "Gram anchoring").
#include <ATen/core/Tensor.h>

#include "ops/gram_loss_math.h"

namespace dino_opt {

// Public C++ API (dispatcher calls). student and teacher of one shape: [B, N, D]
// (a Gram matrix per image) or [M, D] (one Gram matrix of all rows). Returns
// mean over the entries of (S S^T - T T^T)^2 (clamped as asked), S and T the
// rows divided by max(||row||, 1e-12) when apply_norm: a scalar of the
// accumulation dtype (float64 for float64 students, else float32). `form`:
// 0 chooses, 1 the D x D identity (no clamping only), 2 the tiles.
at::Tensor gram_loss(const at::Tensor& student, const at::Tensor& teacher, bool apply_norm,
                     bool remove_neg, bool remove_only_teacher_neg, int64_t form);

// Gradient of the loss w.r.t. the student (the teacher gets none), in the
// student's dtype; grad is the scalar gradient of the loss.
at::Tensor gram_loss_backward(const at::Tensor& grad, const at::Tensor& student,
                              const at::Tensor& teacher, bool apply_norm, bool remove_neg,
                              bool remove_only_teacher_neg, int64_t form);

namespace gram_loss_detail {

enum Form : int64_t { kAuto = 0, kIdentity = 1, kTiles = 2 };

// The arguments as the shared driver takes them, after the checks: both
// viewed as [B, N, D] (B = 1 for the batch level) and contiguous.
struct Inputs {
  at::Tensor student, teacher;
  int64_t images, rows, dim;
  Clamp clamp;
  bool apply_norm;
  bool identity;  // the D x D identity, else tiles
  at::ScalarType acc;
};

// Checks the arguments, throwing c10::Error naming the argument and its shape,
// dtype or device.
Inputs prepare(const char* op, const at::Tensor& student, const at::Tensor& teacher,
               bool apply_norm, bool remove_neg, bool remove_only_teacher_neg, int64_t form);

// A backend's tile kernel: s and t [g, r, c] contiguous of the accumulation
// dtype, the student's and teacher's similarities of a tile. Returns a 0-dim
// float64 tensor, the sum of gram_diff(s, t)^2 over the tile; with `coeff`,
// s is overwritten with gram_diff * slope (the backward's coefficients).
using TileKernel = at::Tensor (*)(at::Tensor& s, const at::Tensor& t, Clamp clamp, bool coeff);

// The loss and its gradient on any device, with ATen matmuls on row chunks
// and tiles and the backend's tile kernel for the elementwise part.
at::Tensor forward(const Inputs& in, TileKernel tile);
at::Tensor backward(const at::Tensor& grad, const Inputs& in, TileKernel tile);

}  // namespace gram_loss_detail
}  // namespace dino_opt
