// dino_opt from C++: the EMA and DINO-loss operators and the multi-crop loader
// (usage: dino_opt_example IMAGE.jpg ...). Exit status 0 when all three work.
#include <ATen/ATen.h>

#include <cmath>
#include <cstdio>

#include "loader/multicrop_loader.h"
#include "ops/dino_loss.h"
#include "ops/ema.h"

int main(int argc, char** argv) {
  at::Tensor teacher = at::zeros({4}), student = at::ones({4});
  dino_opt::ema_update_({teacher}, {student}, 0.9);  // teacher <- 0.9 teacher + 0.1 student
  const int64_t batch = 2, views = 4, dim = 16;      // 2 global + 2 local views, 16 prototypes
  auto [loss, student_lse, teacher_lse] =
      dino_opt::dino_loss(at::randn({views * batch, dim}), at::randn({2 * batch, dim}),
                          at::zeros({1, dim}), 0.1, 0.04, views);
  std::vector<dino_opt::loader::Sample> samples;
  for (int i = 1; i < argc; ++i) samples.push_back({argv[i], 0});
  dino_opt::loader::LoaderOptions options;
  options.batch_size = batch;
  options.pipeline.augment = {.global_size = 64, .local_size = 32, .n_local = 2};
  dino_opt::loader::MultiCropLoader loader(samples, options);
  loader.start_epoch(0);
  const auto crops = loader.next();
  std::printf("teacher after EMA %.4f, loss %.4f, %zu crop groups: global %s, local %s\n",
              teacher[0].item<float>(), loss.item<float>(), crops->groups.size(),
              c10::str(crops->groups[0].sizes()).c_str(),
              c10::str(crops->groups[1].sizes()).c_str());
  const bool ok =
      std::abs(teacher[0].item<float>() - 0.1f) < 1e-6f && std::isfinite(loss.item<float>());
  return ok && crops->groups[0].size(0) == 2 * batch ? 0 : 1;
}
