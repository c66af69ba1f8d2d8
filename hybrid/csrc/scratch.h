// 64-byte-aligned scratch memory that grows on demand and is reused across calls.
#pragma once
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <new>

namespace hybrid {

template <class T>
class Scratch {
 public:
  Scratch() = default;
  Scratch(const Scratch&) = delete;
  Scratch& operator=(const Scratch&) = delete;
  ~Scratch() { std::free(p_); }

  // At least n elements; contents are unspecified unless `zero`.
  T* get(int64_t n, bool zero = false) {
    if (n > cap_) {
      std::free(p_);
      const size_t bytes = (size_t(n) * sizeof(T) + 63) / 64 * 64;
      p_ = static_cast<T*>(std::aligned_alloc(64, bytes));
      if (!p_) throw std::bad_alloc();
      cap_ = n;
    }
    if (zero) std::memset(p_, 0, size_t(n) * sizeof(T));
    return p_;
  }
  T* data() const { return p_; }

 private:
  T* p_ = nullptr;
  int64_t cap_ = 0;
};

// The calling thread's tile buffer for the AVX-512 prefill path.
uint16_t* thread_tile(int64_t elems);

}  // namespace hybrid
