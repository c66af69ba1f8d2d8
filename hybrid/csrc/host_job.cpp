#include "host_job.h"

#include <exception>
#include <utility>

#include "clock.h"

namespace hybrid {

HostJob::HostJob(MoELayer* layer_, View x_, View ids_, View weights_, View out_, std::string isa_, uintptr_t signal_)
    : layer(layer_), x(std::move(x_)), ids(std::move(ids_)), weights(std::move(weights_)), out(std::move(out_)),
      isa(std::move(isa_)), signal(reinterpret_cast<uint32_t*>(signal_)) {}

namespace {
void raise_signal(HostJob* job, uint32_t v) {
  if (job->signal) __atomic_store_n(job->signal, v, __ATOMIC_RELEASE);
}
}  // namespace

extern "C" void hybrid_host_submit(void* p) {
  auto* job = static_cast<HostJob*>(p);
  job->layer->wait();  // the previous call (complete already where the stream waited for its signal)
  job->t_submit_ns = now_ns();
  raise_signal(job, 0);
  if (!job->error.empty()) return raise_signal(job, 1);  // a failed job stays failed until Python has seen it
  try {
    job->layer->submit(job->x, job->ids, job->weights, job->out, job->isa, [job] {
      const int64_t t = now_ns();
      job->cpu_s += (t - job->t_submit_ns) * 1e-9;
      ++job->calls;
      if (job->tracing && job->spans.size() < 2 * HostJob::kMaxSpans) {
        job->spans.push_back(job->t_submit_ns);
        job->spans.push_back(t);
      }
      raise_signal(job, 1);
    });
  } catch (const std::exception& e) {
    job->error = e.what();
    raise_signal(job, 1);  // nothing runs: the stream must not wait for it
  }
}

extern "C" void hybrid_host_wait(void* p) {
  auto* job = static_cast<HostJob*>(p);
  try {
    job->layer->wait();
  } catch (const std::exception& e) {
    if (job->error.empty()) job->error = e.what();
  }
}

}  // namespace hybrid
