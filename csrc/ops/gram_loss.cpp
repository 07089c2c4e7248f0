// Schemas of dino_opt::gram_loss / gram_loss_backward, their checks, and the
// driver both backends share: ATen matmuls on row chunks and tiles, so that no
// N x N (or (B N)^2) matrix is ever made.
//
// Without clamping and with D < N, the identity
//   ||S S^T - T T^T||_F^2 = ||S^T S||_F^2 - 2 ||S^T T||_F^2 + ||T^T T||_F^2
// reduces an image to three D x D matrices accumulated over chunks of rows,
// and the gradient 4 (S S^T - T T^T) S = 4 (S (S^T S) - T (T^T S)) to two.
// Otherwise (clamping, or D >= N) tiles of rows x rows of both similarity
// matrices are made one pair at a time, only the tiles on and above the
// diagonal (the matrices are symmetric), and the backend's tile kernel
// clamps and reduces them.
#include "ops/gram_loss.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/bmm.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/linalg_vector_norm.h>
#include <ATen/ops/where.h>
#include <ATen/ops/zeros.h>
#include <ATen/ops/zeros_like.h>
#include <torch/library.h>

#include <algorithm>

#include "ops/dino_loss.h"
#include "ops/dtype.h"

namespace dino_opt {

TORCH_LIBRARY_FRAGMENT(dino_opt, m) {
  m.def(
      "gram_loss(Tensor student, Tensor teacher, bool apply_norm=True, bool remove_neg=False, "
      "bool remove_only_teacher_neg=False, int form=0) -> Tensor");
  m.def(
      "gram_loss_backward(Tensor grad, Tensor student, Tensor teacher, bool apply_norm, "
      "bool remove_neg, bool remove_only_teacher_neg, int form) -> Tensor");
}

at::Tensor gram_loss(const at::Tensor& student, const at::Tensor& teacher, bool apply_norm,
                     bool remove_neg, bool remove_only_teacher_neg, int64_t form) {
  static auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("dino_opt::gram_loss", "")
          .typed<at::Tensor(const at::Tensor&, const at::Tensor&, bool, bool, bool, int64_t)>();
  return op.call(student, teacher, apply_norm, remove_neg, remove_only_teacher_neg, form);
}

at::Tensor gram_loss_backward(const at::Tensor& grad, const at::Tensor& student,
                              const at::Tensor& teacher, bool apply_norm, bool remove_neg,
                              bool remove_only_teacher_neg, int64_t form) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("dino_opt::gram_loss_backward", "")
                       .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                         bool, bool, bool, int64_t)>();
  return op.call(grad, student, teacher, apply_norm, remove_neg, remove_only_teacher_neg, form);
}

namespace gram_loss_detail {
namespace {

constexpr double kEps = 1e-12;                     // F.normalize's
constexpr int64_t kGramElems = int64_t(1) << 20;   // D x D matrices of a group of images
constexpr int64_t kChunkElems = int64_t(1) << 17;  // a chunk of rows
constexpr int64_t kTileElems = int64_t(1) << 20;   // a tile of similarities
constexpr int64_t kTileRows = 512;

void check_tensors(const char* op, const at::Tensor& student, const at::Tensor& teacher) {
  TORCH_CHECK(student.dim() == 2 || student.dim() == 3, op,
              ": student must be 3-D [B, N, D] (a Gram matrix per image) or 2-D [M, D] (one "
              "over the batch), got shape ",
              student.sizes());
  TORCH_CHECK(teacher.sizes() == student.sizes(), op, ": teacher has shape ", teacher.sizes(),
              " but student has shape ", student.sizes(), "; they must match");
  float_index(student.scalar_type(), op, "student");
  float_index(teacher.scalar_type(), op, "teacher");
  TORCH_CHECK(teacher.device() == student.device(), op,
              ": student and teacher must be on one device, got ", student.device(), " and ",
              teacher.device());
}

Clamp check_options(const char* op, bool remove_neg, bool remove_only_teacher_neg, int64_t form) {
  TORCH_CHECK(!(remove_neg && remove_only_teacher_neg), op,
              ": remove_neg and remove_only_teacher_neg exclude each other; got both true");
  TORCH_CHECK(form >= kAuto && form <= kTiles, op,
              ": form must be 0 (choose), 1 (D x D identity) or 2 (tiles), got ", form);
  const Clamp clamp = remove_neg ? kClampBoth : remove_only_teacher_neg ? kClampTeacher : kNoClamp;
  TORCH_CHECK(form != kIdentity || clamp == kNoClamp, op,
              ": form=1 (the D x D identity) holds only without clamping; remove_neg and "
              "remove_only_teacher_neg need the tiles (form 0 or 2)");
  return clamp;
}

// Normalised rows of a chunk (y) and their norms (undefined without apply_norm).
struct Rows {
  at::Tensor y, norm;
};

// Rows [r0, r1) of images [b0, b1) of x, in the accumulation dtype.
Rows rows_of(const at::Tensor& x, const Inputs& in, int64_t b0, int64_t b1, int64_t r0,
             int64_t r1) {
  at::Tensor v = x.slice(0, b0, b1).slice(1, r0, r1).to(in.acc);
  if (!in.apply_norm) return {v, {}};
  at::Tensor norm = at::linalg_vector_norm(v, 2, {-1}, true);
  return {v.div(norm.clamp_min(kEps)), norm};
}

// The gradient w.r.t. the raw rows from the one w.r.t. their normalised form:
// (g - y (y . g)) / ||x||, or g / eps where the norm was clamped at eps.
at::Tensor norm_backward(const Rows& rows, const at::Tensor& g) {
  if (!rows.norm.defined()) return g;
  const at::Tensor along = rows.y.mul(g).sum(-1, true);
  const at::Tensor proj = at::where(rows.norm.gt(kEps), along, at::zeros_like(along));
  return g.sub(rows.y.mul(proj)).div_(rows.norm.clamp_min(kEps));
}

at::Tensor sum_of_squares(const at::Tensor& m) {
  return at::linalg_vector_norm(m, 2, c10::nullopt, false, at::kDouble).square();
}

int64_t group_size(const Inputs& in, int64_t per_image) {
  return std::clamp<int64_t>(kGramElems / std::max<int64_t>(per_image, 1), 1,
                             std::max<int64_t>(in.images, 1));
}

int64_t chunk_rows(const Inputs& in, int64_t group) {
  return std::max<int64_t>(kChunkElems / std::max<int64_t>(group * in.dim, 1), 1);
}

// S^T S and S^T T of images [b0, b1) (and T^T T when asked), accumulated over
// chunks of rows: [g, D, D] each.
std::vector<at::Tensor> dim_grams(const Inputs& in, int64_t b0, int64_t b1, bool with_tt) {
  const auto options = in.student.options().dtype(in.acc);
  const int64_t g = b1 - b0, step = chunk_rows(in, g);
  std::vector<at::Tensor> grams;
  for (int i = 0; i < (with_tt ? 3 : 2); ++i)
    grams.push_back(at::zeros({g, in.dim, in.dim}, options));
  for (int64_t r0 = 0; r0 < in.rows; r0 += step) {
    const int64_t r1 = std::min(in.rows, r0 + step);
    const at::Tensor s = rows_of(in.student, in, b0, b1, r0, r1).y;
    const at::Tensor t = rows_of(in.teacher, in, b0, b1, r0, r1).y;
    grams[0].baddbmm_(s.transpose(1, 2), s);
    grams[1].baddbmm_(s.transpose(1, 2), t);
    if (with_tt) grams[2].baddbmm_(t.transpose(1, 2), t);
  }
  return grams;
}

at::Tensor identity_sum(const Inputs& in, int64_t b0, int64_t b1) {
  const std::vector<at::Tensor> grams = dim_grams(in, b0, b1, true);
  return sum_of_squares(grams[0]).sub_(sum_of_squares(grams[1]), 2).add_(sum_of_squares(grams[2]));
}

// Writes the gradient of images [b0, b1) into `out`: per chunk of rows,
// scale * (S (S^T S) - T (T^T S)) through the normalisation.
void identity_grad(const Inputs& in, int64_t b0, int64_t b1, const at::Tensor& scale,
                   at::Tensor& out) {
  const std::vector<at::Tensor> grams = dim_grams(in, b0, b1, false);
  const at::Tensor ts = grams[1].transpose(1, 2);
  const int64_t step = chunk_rows(in, b1 - b0);
  for (int64_t r0 = 0; r0 < in.rows; r0 += step) {
    const int64_t r1 = std::min(in.rows, r0 + step);
    const Rows s = rows_of(in.student, in, b0, b1, r0, r1);
    const at::Tensor t = rows_of(in.teacher, in, b0, b1, r0, r1).y;
    at::Tensor g = at::bmm(s.y, grams[0]);
    g.baddbmm_(t, ts, 1, -1);
    out.slice(0, b0, b1).slice(1, r0, r1).copy_(norm_backward(s, g.mul_(scale)));
  }
}

int64_t tile_rows(const Inputs& in) {
  return std::min<int64_t>(std::max<int64_t>(in.rows, 1), kTileRows);
}

// Calls visit(i0, i1, j0, j1, s_i, s_j, sim_s, sim_t) for every tile on and
// above the diagonal of images [b0, b1), sim_* the similarity tiles.
template <typename Visit>
void for_each_tile(const Inputs& in, int64_t b0, int64_t b1, Visit&& visit) {
  const int64_t step = tile_rows(in);
  for (int64_t i0 = 0; i0 < in.rows; i0 += step) {
    const int64_t i1 = std::min(in.rows, i0 + step);
    const at::Tensor si = rows_of(in.student, in, b0, b1, i0, i1).y;
    const at::Tensor ti = rows_of(in.teacher, in, b0, b1, i0, i1).y;
    for (int64_t j0 = i0; j0 < in.rows; j0 += step) {
      const int64_t j1 = std::min(in.rows, j0 + step);
      const at::Tensor sj = j0 == i0 ? si : rows_of(in.student, in, b0, b1, j0, j1).y;
      const at::Tensor tj = j0 == i0 ? ti : rows_of(in.teacher, in, b0, b1, j0, j1).y;
      at::Tensor sim_s = at::bmm(si, sj.transpose(1, 2));
      visit(i0, i1, j0, j1, si, sj, sim_s, at::bmm(ti, tj.transpose(1, 2)));
    }
  }
}

at::Tensor tiles_sum(const Inputs& in, TileKernel tile, int64_t b0, int64_t b1) {
  at::Tensor total = at::zeros({}, in.student.options().dtype(at::kDouble));
  for_each_tile(in, b0, b1,
                [&](int64_t i0, int64_t, int64_t j0, int64_t, const at::Tensor&, const at::Tensor&,
                    at::Tensor& sim_s, const at::Tensor& sim_t) {
                  total.add_(tile(sim_s, sim_t, in.clamp, false), j0 == i0 ? 1 : 2);
                });
  return total;
}

// Writes the gradient of images [b0, b1) into `out`: the gradient w.r.t. the
// normalised rows, scale * C S with C the tile kernel's coefficients, summed
// over the tiles into a buffer, then through the normalisation.
void tiles_grad(const Inputs& in, TileKernel tile, int64_t b0, int64_t b1, const at::Tensor& scale,
                at::Tensor& out) {
  // The sums go straight into the gradient when it has the accumulation
  // dtype; a half-precision gradient needs a float32 buffer for them.
  at::Tensor g = out.scalar_type() == in.acc
                     ? out.slice(0, b0, b1).zero_()
                     : at::zeros({b1 - b0, in.rows, in.dim}, in.student.options().dtype(in.acc));
  for_each_tile(in, b0, b1,
                [&](int64_t i0, int64_t i1, int64_t j0, int64_t j1, const at::Tensor& si,
                    const at::Tensor& sj, at::Tensor& sim_s, const at::Tensor& sim_t) {
                  tile(sim_s, sim_t, in.clamp, true);
                  g.slice(1, i0, i1).baddbmm_(sim_s, sj);
                  if (j0 != i0) g.slice(1, j0, j1).baddbmm_(sim_s.transpose(1, 2), si);
                });
  const int64_t step = chunk_rows(in, b1 - b0);
  for (int64_t r0 = 0; r0 < in.rows; r0 += step) {
    const int64_t r1 = std::min(in.rows, r0 + step);
    const Rows s = rows_of(in.student, in, b0, b1, r0, r1);
    at::Tensor part = g.slice(1, r0, r1).mul_(scale);
    out.slice(0, b0, b1).slice(1, r0, r1).copy_(norm_backward(s, part));
  }
}

int64_t images_per_group(const Inputs& in) {
  if (in.identity) return group_size(in, in.dim * in.dim);
  const int64_t step = tile_rows(in);
  return group_size(in, std::max(step * step, in.rows * in.dim));
}

}  // namespace

Inputs prepare(const char* op, const at::Tensor& student, const at::Tensor& teacher,
               bool apply_norm, bool remove_neg, bool remove_only_teacher_neg, int64_t form) {
  check_tensors(op, student, teacher);
  const Clamp clamp = check_options(op, remove_neg, remove_only_teacher_neg, form);
  const at::Tensor s = student.dim() == 3 ? student : student.unsqueeze(0);
  const at::Tensor t = teacher.dim() == 3 ? teacher : teacher.unsqueeze(0);
  const int64_t rows = s.size(1), dim = s.size(2);
  const bool identity = clamp == kNoClamp && (form == kIdentity || (form == kAuto && dim < rows));
  return Inputs{s.contiguous(),
                t.contiguous(),
                s.size(0),
                rows,
                dim,
                clamp,
                apply_norm,
                identity,
                dino_loss_detail::acc_dtype(student)};
}

at::Tensor forward(const Inputs& in, TileKernel tile) {
  at::Tensor total = at::zeros({}, in.student.options().dtype(at::kDouble));
  const int64_t group = images_per_group(in);
  for (int64_t b0 = 0; b0 < in.images; b0 += group) {
    const int64_t b1 = std::min(in.images, b0 + group);
    total.add_(in.identity ? identity_sum(in, b0, b1) : tiles_sum(in, tile, b0, b1));
  }
  const double count = static_cast<double>(in.images) * in.rows * in.rows;
  return total.div_(count).to(in.acc);  // 0 / 0 = NaN for no rows, as the mean of nothing
}

at::Tensor backward(const at::Tensor& grad, const Inputs& in, TileKernel tile) {
  const char* op = "gram_loss_backward";
  TORCH_CHECK(grad.numel() == 1, op, ": grad must be a scalar, got shape ", grad.sizes());
  TORCH_CHECK(grad.device() == in.student.device(), op, ": grad is on ", grad.device(),
              " but student is on ", in.student.device());
  at::Tensor out = at::empty(in.student.sizes(), in.student.options());
  const double count = static_cast<double>(in.images) * in.rows * in.rows;
  const at::Tensor scale = grad.reshape({}).to(in.acc).mul(4.0 / std::max(count, 1.0));
  const int64_t group = images_per_group(in);
  for (int64_t b0 = 0; b0 < in.images; b0 += group) {
    const int64_t b1 = std::min(in.images, b0 + group);
    if (in.identity) {
      identity_grad(in, b0, b1, scale, out);
    } else {
      tiles_grad(in, tile, b0, b1, scale, out);
    }
  }
  return out;
}

}  // namespace gram_loss_detail
}  // namespace dino_opt
