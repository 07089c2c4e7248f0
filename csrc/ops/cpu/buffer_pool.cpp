// The pool of large CPU output buffers (see buffer_pool.h).
#include "ops/cpu/buffer_pool.h"

#include <ATen/ops/empty.h>
#include <c10/core/Storage.h>
#include <torch/library.h>

#include <algorithm>
#include <mutex>
#include <vector>

namespace dino_opt::cpu {
namespace {

// A few storages: a step holds one gradient per loss (DINO, iBOT), and a
// second of each may still be alive while the next is made.
constexpr size_t kMaxPooled = 4;

struct Pool {
  std::mutex mutex;
  std::vector<c10::Storage> storages;
};

Pool& pool() {
  static Pool* p = new Pool();  // never destroyed: outputs may outlive static destruction
  return *p;
}

bool is_free(const c10::Storage& s) { return s.use_count() == 1; }

}  // namespace

at::Tensor pooled_empty_like(const at::Tensor& like) {
  const auto options = like.options().memory_format(at::MemoryFormat::Contiguous);
  const int64_t nbytes = like.numel() * static_cast<int64_t>(like.element_size());
  if (nbytes < kPooledMinBytes || !like.device().is_cpu()) return at::empty(like.sizes(), options);
  Pool& p = pool();
  std::lock_guard<std::mutex> lock(p.mutex);
  for (const c10::Storage& s : p.storages) {
    if (is_free(s) && static_cast<int64_t>(s.nbytes()) == nbytes) {
      return at::empty({0}, options).set_(s, 0, like.sizes());
    }
  }
  // None free of this size: a new one, kept in place of the oldest free
  // storage when the pool is full (sizes in turn, such as the DINO and the
  // iBOT gradients of a step, each keep theirs).
  at::Tensor out = at::empty(like.sizes(), options);
  if (p.storages.size() == kMaxPooled) {
    const auto oldest_free = std::find_if(p.storages.begin(), p.storages.end(), is_free);
    if (oldest_free != p.storages.end()) p.storages.erase(oldest_free);
  }
  if (p.storages.size() < kMaxPooled) p.storages.push_back(out.storage());
  return out;
}

int64_t release_pooled_buffers() {
  Pool& p = pool();
  std::lock_guard<std::mutex> lock(p.mutex);
  int64_t released = 0;
  std::erase_if(p.storages, [&](const c10::Storage& s) {
    if (!is_free(s)) return false;
    released += static_cast<int64_t>(s.nbytes());
    return true;
  });
  return released;
}

int64_t pooled_bytes() {
  Pool& p = pool();
  std::lock_guard<std::mutex> lock(p.mutex);
  int64_t total = 0;
  for (const c10::Storage& s : p.storages) total += static_cast<int64_t>(s.nbytes());
  return total;
}

TORCH_LIBRARY_FRAGMENT(dino_opt, m) {
  m.def("release_cpu_buffers() -> (int, int)", []() -> std::tuple<int64_t, int64_t> {
    const int64_t released = release_pooled_buffers();
    return {released, pooled_bytes()};
  });
}

}  // namespace dino_opt::cpu
