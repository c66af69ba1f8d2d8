// Python bindings: one line per function; checks and logic live in the sources.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "cpu_features.h"

PYBIND11_MODULE(_native, m) {
  m.doc() = "hybrid native CPU code";
  m.def("cpu_features", &hybrid::cpu_features, "ISA features from cpuid/xgetbv");
  m.def("cpu_brand", &hybrid::cpu_brand, "processor brand string");
}
