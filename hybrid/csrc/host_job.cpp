#include "host_job.h"

#include <chrono>
#include <exception>
#include <utility>

namespace hybrid {

namespace {
int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch()).count();
}
}  // namespace

HostJob::HostJob(MoELayer* layer_, View x_, View ids_, View weights_, View out_, std::string isa_)
    : layer(layer_), x(std::move(x_)), ids(std::move(ids_)), weights(std::move(weights_)), out(std::move(out_)),
      isa(std::move(isa_)) {}

extern "C" void hybrid_host_submit(void* p) {
  auto* job = static_cast<HostJob*>(p);
  job->t_submit_ns = now_ns();
  if (!job->error.empty()) return;  // a failed job stays failed until Python has seen it
  try {
    job->layer->submit(job->x, job->ids, job->weights, job->out, job->isa);
  } catch (const std::exception& e) {
    job->error = e.what();
  }
}

extern "C" void hybrid_host_wait(void* p) {
  auto* job = static_cast<HostJob*>(p);
  try {
    job->layer->wait();
  } catch (const std::exception& e) {
    if (job->error.empty()) job->error = e.what();
  }
  job->cpu_s += (now_ns() - job->t_submit_ns) * 1e-9;
  ++job->calls;
}

}  // namespace hybrid
