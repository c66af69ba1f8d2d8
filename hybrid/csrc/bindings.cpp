// Python bindings: one line per function; checks and logic live in the sources.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "cpu_features.h"
#include "decode_attention.h"
#include "gemm_op.h"
#include "head_gemm.h"
#include "host_job.h"
#include "membw.h"
#include "moe.h"
#include "numa.h"
#include "scan.h"
#include "thread_pool.h"

namespace py = pybind11;
using namespace hybrid;
using nogil = py::call_guard<py::gil_scoped_release>;

PYBIND11_MODULE(_native, m) {
  m.doc() = "hybrid native CPU code";
  m.def("cpu_features", &cpu_features, "ISA features from cpuid/xgetbv");
  m.def("cpu_brand", &cpu_brand, "processor brand string");
  py::class_<View>(m, "View").def(py::init<uintptr_t, std::string, std::vector<int64_t>, std::vector<int64_t>>());
  m.def("gemm", &gemm, nogil(), "y = x · wᵀ (FP8 block-scaled or BF16 weights)");
  m.def("head_gemm", &head_gemm, nogil(), "per-head y[:, h] = x[:, h] · w[h] (by rows) or · w[h]ᵀ, BF16");
  m.def("decode_attention", &decode_attention, nogil(), "MLA decode attention over each sequence's cached positions "
        "(a paged cache: pools of blocks, a block table)");
  m.def("attention_code", &attention_code, "the decode attention's code a variant name runs here");
  m.def("set_attention_schedule", &set_attention_schedule, "decode attention: 0 by the batch, 1 split-K, 2 heads");
  m.def("head_isa", &head_isa, "the batched-head kernel's code a variant name runs here");
  m.def("set_tile_min_m", &set_tile_min_m, "tokens from which the FP8 GEMM converts each weight tile once");
  m.def("set_amx_min_m", &set_amx_min_m, "tokens from which variant amx runs an FP8 GEMM on AMX tiles");
  m.def("set_amx_prefetch", &set_amx_prefetch, "variant amx: bytes ahead of each FP8 load prefetched into L2 "
        "(-1: the next 32-row group's same spot, 0: none)");
  m.def("set_amx_overlap", &set_amx_overlap, "variant amx: the next weight slab converted while this one's tiles "
        "multiply (true, the default) or after them");
  m.def("set_batch_invariant", &set_batch_invariant, "every output by the same operations whatever its batch: "
        "avx512_bf16's converted tiles keep the streaming form's sums (off: the outer-product form)");
  m.def("set_moe_lag_rounds", &set_moe_lag_rounds, "MoE layer: rounds of tasks (one per thread) an expert's down "
        "tasks are queued behind its gate/up tasks (default 2)");
  m.def("set_moe_longest_first", &set_moe_longest_first, "MoE layer: experts' tasks queued by token count, most "
        "first (true, the default), or in expert order");
  m.def("set_avx2_stream", &set_avx2_stream, "the AVX2 kernel's conversion of streaming FP8 rows: fp16 or registers");
  m.def("avx2_stream", &avx2_stream, "the AVX2 kernel's conversion of streaming FP8 rows in use");
  m.def("selected_isa", &selected_isa, "the kernel variant a name resolves to on this CPU");
  m.def("set_num_threads", &set_num_threads, nogil(), "resize the kernel thread pool (0 = all CPUs)");
  m.def("num_threads", &num_threads, "threads in the kernel thread pool");
  m.def("set_thread_groups", &set_thread_groups, nogil(), "the kernel thread pool in node groups (threads[g] "
        "pinned to cpus[g]); no groups: a plain pool");
  m.def("thread_seats", [] {
    std::vector<std::pair<int, int>> out;
    for (const auto& s : pool().seats()) out.emplace_back(s.group, s.cpu);
    return out;
  }, "the pool's active seats, (group, cpu): the caller's, then each worker's");
  m.def("thread_groups", [] { return pool().grouped() ? pool().group_cpus() : std::vector<std::vector<int>>{}; },
        "each node group's CPUs (none: a plain pool)");
  m.def("bind_memory", &bind_memory, nogil(), "the whole pages of a range bound to a NUMA node (mbind): 0 or errno");
  m.def("page_nodes", &page_nodes, nogil(), "the NUMA node of pages sampled over a range (-errno where unknown)");
  m.def("read_bandwidth_node", &read_bandwidth_node, nogil(), "read roof of one thread group from memory on a node: "
        "(GB/s, share of its pages on the node)");
  m.def("read_bandwidth", &read_bandwidth, nogil(), "measured memory read roof, GB/s");
  m.def("silu_mul", &silu_mul, nogil(), "out = bf16(silu(g) * u), the MoE op's SiLU step");
  m.def("count_fp8_nan", &count_fp8_nan, nogil(), "FP8 E4M3 NaN codes (0x7F, 0xFF) in a contiguous run");
  py::class_<MoELayer>(m, "MoELayer")
      .def(py::init<const std::vector<View>&, const std::vector<View>&, const std::vector<View>&,
                    const std::vector<View>&, const std::vector<View>&, const std::vector<View>&>())
      .def("forward", &MoELayer::forward, nogil())
      .def(
          "submit",
          [](MoELayer& m, const View& x, const View& ids, const View& w, const View& out, const std::string& isa) {
            m.submit(x, ids, w, out, isa);
          },
          nogil())
      .def("wait", &MoELayer::wait, nogil())
      .def_property_readonly("global_syncs", &MoELayer::last_global_syncs)
      .def_property_readonly("wait_s", &MoELayer::last_wait_s)
      .def_property_readonly("tail_s", &MoELayer::last_tail_s)
      .def_property_readonly("stage_s", &MoELayer::last_stage_s)
      .def_property("nodes", &MoELayer::nodes, &MoELayer::set_nodes)
      .def_property_readonly("group_bytes", &MoELayer::last_group_bytes)
      .def("set_trace", &MoELayer::set_trace)
      .def("take_trace", [](MoELayer& m) {  // read after the call is joined
        std::vector<std::tuple<int, int, int64_t, int64_t, int, int, int>> out;
        for (const auto& t : m.last_trace()) out.emplace_back(t.expert, t.stage, t.r0, t.r1, t.group, t.worker, t.cpu);
        return out;
      }, "the last call's tasks while tracing: (expert, stage, r0, r1, group, worker, cpu)");
  py::class_<HostJob>(m, "HostJob")
      .def(py::init<MoELayer*, View, View, View, View, std::string, uintptr_t>(), py::arg("layer"), py::arg("x"),
           py::arg("ids"), py::arg("weights"), py::arg("out"), py::arg("isa"), py::arg("signal") = 0,
           py::keep_alive<1, 2>())
      .def_property_readonly("address", [](HostJob& j) { return reinterpret_cast<uintptr_t>(&j); })
      .def_readwrite("error", &HostJob::error)
      .def_readwrite("calls", &HostJob::calls)
      .def_readwrite("cpu_s", &HostJob::cpu_s)
      .def_readwrite("tracing", &HostJob::tracing)
      .def("take_spans", [](HostJob& j) {  // read after the job is joined (its workers write them)
        std::vector<std::pair<int64_t, int64_t>> out;
        for (size_t i = 0; i + 1 < j.spans.size(); i += 2) out.emplace_back(j.spans[i], j.spans[i + 1]);
        j.spans.clear();
        return out;
      }, "the calls' (submit, complete) times in ns (time.monotonic_ns's clock) since the last take; cleared");
  m.attr("host_submit_fn") = reinterpret_cast<uintptr_t>(&hybrid_host_submit);
  m.attr("host_wait_fn") = reinterpret_cast<uintptr_t>(&hybrid_host_wait);
}
