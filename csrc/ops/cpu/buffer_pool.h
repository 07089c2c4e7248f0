#pragma once
// Large CPU outputs (the loss gradients, [rows, K] each step) kept across
// calls. A fresh buffer of that size comes from mmap under glibc's default
// allocator and is returned to the system when freed, so every step would
// fault its pages in again (one fault per 4 KiB page without transparent huge
// pages): that cost more than the kernels' arithmetic. The pool keeps the
// storage of a recent output and hands it out again once no tensor refers to
// it any more (its storage's use count is the pool's own), which is the case
// after autograd has passed the gradient on and the caller has dropped it.
#include <ATen/core/Tensor.h>

#include <cstdint>

namespace dino_opt::cpu {

// Below this many bytes a request is served by at::empty (glibc's heap reuses
// such blocks without page faults).
constexpr int64_t kPooledMinBytes = int64_t{1} << 20;

// An uninitialised contiguous tensor of `sizes` like `like` (its dtype and
// device, a CPU tensor), from a pooled storage of the same size when one is
// free. Thread-safe.
at::Tensor pooled_empty_like(const at::Tensor& like);

// Frees the pool's free storages; returns the bytes released. Storages still
// in use stay until a later call finds them free.
int64_t release_pooled_buffers();

// Bytes the pool holds now (in use or free).
int64_t pooled_bytes();

}  // namespace dino_opt::cpu
