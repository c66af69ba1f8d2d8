// A tensor as Python hands it over: address, dtype name, shape and strides (in elements). Entry points check
// every view they take and throw std::invalid_argument (a Python ValueError) with the argument named.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace hybrid {

struct View {
  uintptr_t ptr = 0;
  std::string dtype;  // torch's name: "bfloat16", "float8_e4m3fn", "float32", "int64", "int32"
  std::vector<int64_t> shape, strides;

  int64_t dim(int i) const { return shape.at(i); }
  template <class T>
  T* data() const { return reinterpret_cast<T*>(ptr); }
};

// Checks: dtype is one of `dtypes`, `ndim` dimensions, the last one contiguous, rows not overlapping.
void check_view(const View& v, const char* name, std::initializer_list<const char*> dtypes, int ndim);
void check_shape(const View& v, const char* name, std::initializer_list<int64_t> shape);

}  // namespace hybrid
