#include "thread_pool.h"

#include <immintrin.h>
#include <pthread.h>
#include <sched.h>

#include <algorithm>
#include <chrono>
#include <memory>
#include <stdexcept>
#include <string>

namespace hybrid {
namespace {

constexpr auto kSpin = std::chrono::microseconds(200);
thread_local int t_group = -1, t_rank = -1, t_index = -1;  // a worker's group, rank in it, index in its pool

std::vector<int> allowed_cpus() {
  cpu_set_t set;
  CPU_ZERO(&set);
  std::vector<int> cpus;
  if (sched_getaffinity(0, sizeof(set), &set) == 0)
    for (int c = 0; c < CPU_SETSIZE; ++c)
      if (CPU_ISSET(c, &set)) cpus.push_back(c);
  return cpus;
}

void pin(std::thread& t, int cpu) {
  cpu_set_t set;
  CPU_ZERO(&set);
  CPU_SET(cpu, &set);
  pthread_setaffinity_np(t.native_handle(), sizeof(set), &set);
}

template <class Pred>
bool spin_until(Pred pred) {
  const auto end = std::chrono::steady_clock::now() + kSpin;
  while (!pred()) {
    _mm_pause();
    if (std::chrono::steady_clock::now() > end) return false;
  }
  return true;
}

}  // namespace

ThreadPool::ThreadPool(int threads) {
  if (threads < 1) throw std::invalid_argument("thread pool needs at least one thread");
  const std::vector<int> cpus = allowed_cpus();
  group_cpus_ = {cpus};
  std::vector<Seat> seats;  // seat i on the i-th allowed CPU; the caller keeps the first
  for (int i = 0; i < threads; ++i) seats.push_back({cpus.empty() ? -1 : cpus[i % cpus.size()], 0});
  start(std::move(seats));
}

ThreadPool::ThreadPool(const std::vector<std::vector<int>>& group_cpus, const std::vector<int>& group_threads)
    : group_cpus_(group_cpus), grouped_(true) {
  const size_t G = group_cpus.size();
  if (G == 0 || group_threads.size() != G)
    throw std::invalid_argument("thread groups: one list of CPUs and one thread count per group");
  for (size_t g = 0; g < G; ++g)
    if (group_cpus[g].empty() || group_threads[g] < 1)
      throw std::invalid_argument("thread group " + std::to_string(g) + ": needs CPUs and at least one thread");
  std::vector<Seat> seats;  // interleaved: narrowing keeps each group's share
  std::vector<int> left = group_threads, next(G, 0);
  for (bool more = true; more;) {
    more = false;
    for (size_t g = 0; g < G; ++g)
      if (left[g] > 0) {
        const auto& cpus = group_cpus[g];
        seats.push_back({cpus[next[g]++ % cpus.size()], int(g)});
        more = --left[g] > 0 || more;
      }
  }
  start(std::move(seats));
}

void ThreadPool::start(std::vector<Seat> seats) {
  seats_ = std::move(seats);
  const int threads = int(seats_.size());
  active_.store(threads - 1, std::memory_order_release);
  std::vector<int> rank(group_cpus_.size(), 0);
  for (int i = 1; i < threads; ++i) {  // worker i - 1 on seat i; the caller keeps seat 0
    const Seat seat = seats_[i];
    const int r = rank[seat.group]++;
    workers_.emplace_back([this, i, seat, r] {
      t_group = seat.group, t_rank = r, t_index = i - 1;
      loop(i - 1);
    });
    if (seat.cpu >= 0) pin(workers_.back(), seat.cpu);
  }
}

std::vector<ThreadPool::Seat> ThreadPool::seats() const {
  return std::vector<Seat>(seats_.begin(), seats_.begin() + active() + 1);
}

int ThreadPool::caller_group() const {
  if (!grouped_) return 0;
  const int cpu = sched_getcpu();
  for (size_t g = 0; g < group_cpus_.size(); ++g)
    if (std::find(group_cpus_[g].begin(), group_cpus_[g].end(), cpu) != group_cpus_[g].end()) return int(g);
  return 0;
}

std::vector<int> ThreadPool::participants(int caller_group) const {
  std::vector<int> n(group_cpus_.size(), 0);
  const int a = active();
  for (int i = 1; i <= a; ++i) ++n[seats_[i].group];
  if (caller_group >= 0) ++n[caller_group];
  return n;
}

int ThreadPool::worker_group() { return t_group; }
int ThreadPool::worker_rank() { return t_rank; }
int ThreadPool::worker_index() { return t_index; }

ThreadPool::~ThreadPool() {
  wait();  // a posted job runs to completion: a worker that sees stop_ first would drop it unrun
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  wake_.notify_all();
  park_.notify_all();
  for (auto& t : workers_) t.join();
}

uint64_t ThreadPool::post(std::function<void(int)> fn, int first_index) {
  std::lock_guard<std::mutex> posting(post_mu_);  // one poster at a time: tickets in posting order
  const uint64_t ticket = generation_.load(std::memory_order_relaxed) + 1;
  Slot& slot = slots_[ticket % kQueued];
  wait(slot.ticket.load(std::memory_order_acquire));  // the job kQueued before: its slot is reused
  {
    std::lock_guard<std::mutex> lock(mu_);
    slot.fn = std::move(fn);
    slot.first_index = first_index;
    slot.pending.store(active(), std::memory_order_relaxed);
    slot.ticket.store(ticket, std::memory_order_release);
    generation_.store(ticket, std::memory_order_release);
  }
  wake_.notify_all();
  return ticket;
}

void ThreadPool::run(const std::function<void(int)>& fn) {
  if (active() == 0) return fn(0);
  wait();  // the caller's part must not start before the jobs posted earlier are done
  const uint64_t ticket = post(fn, 1);
  fn(0);
  wait(ticket);
}

uint64_t ThreadPool::submit(std::function<void(int)> fn) {
  if (active() == 0) {
    fn(0);
    return 0;  // done already: wait(0) returns at once
  }
  return post(std::move(fn), 0);
}

void ThreadPool::wait() { wait(generation_.load(std::memory_order_acquire)); }

// Job `ticket` is done once its workers are, or its slot holds a later job (a post waits for the job it replaces).
// Workers run jobs in ticket order, so a job done means every earlier one is too.
bool ThreadPool::done(uint64_t ticket) const {
  const Slot& slot = slots_[ticket % kQueued];
  return ticket == 0 || slot.ticket.load(std::memory_order_acquire) != ticket ||
         slot.pending.load(std::memory_order_acquire) == 0;
}

void ThreadPool::wait(uint64_t ticket) {
  if (spin_until([&] { return done(ticket); })) return;
  std::unique_lock<std::mutex> lock(mu_);
  done_.wait(lock, [&] { return done(ticket); });
}

void ThreadPool::set_active(int threads) {
  if (threads < 1 || threads > capacity())
    throw std::invalid_argument("a pool of " + std::to_string(capacity()) + " threads cannot run " +
                                std::to_string(threads));
  std::lock_guard<std::mutex> posting(post_mu_);  // no job posted meanwhile
  wait();  // every job in flight done: each worker taking part has run every ticket so far
  {
    std::lock_guard<std::mutex> lock(mu_);
    active_.store(threads - 1, std::memory_order_release);
    resume_ = generation_.load(std::memory_order_acquire) + 1;
    epoch_.fetch_add(1, std::memory_order_acq_rel);
  }
  wake_.notify_all();
  park_.notify_all();
}

void ThreadPool::loop(int index) {
  uint64_t epoch = 0, next = 1;  // the ticket this worker runs next
  bool parked = false;
  // A worker's part in the current epoch, read under mu_ (set_active writes it there before any job of the new
  // epoch is posted, so a worker that sees such a job's ticket sees the epoch move too).
  const auto resync = [&] {
    epoch = epoch_.load(std::memory_order_acquire);
    next = resume_;
    parked = index >= active();
  };
  {
    std::lock_guard<std::mutex> lock(mu_);  // a worker may start after the pool was narrowed
    resync();
  }
  for (;;) {
    if (parked) {  // asleep until the pool is widened to it, or stopped
      std::unique_lock<std::mutex> lock(mu_);
      park_.wait(lock, [&] { return epoch_.load(std::memory_order_acquire) != epoch || stop_.load(); });
      if (epoch_.load(std::memory_order_acquire) == epoch) return;  // stopped while parked
      resync();
      continue;
    }
    const auto ready = [&] {
      return generation_.load(std::memory_order_acquire) >= next ||
             epoch_.load(std::memory_order_acquire) != epoch || stop_.load();
    };
    if (!spin_until(ready)) {
      std::unique_lock<std::mutex> lock(mu_);
      wake_.wait(lock, ready);
    }
    if (epoch_.load(std::memory_order_acquire) != epoch) {
      std::lock_guard<std::mutex> lock(mu_);
      resync();
      continue;
    }
    if (generation_.load(std::memory_order_acquire) < next) return;  // stopped with nothing left to run
    Slot& slot = slots_[next % kQueued];
    slot.fn(index + slot.first_index);
    if (slot.pending.fetch_sub(1, std::memory_order_acq_rel) == 1) {
      std::lock_guard<std::mutex> lock(mu_);
      done_.notify_all();
    }
    ++next;
  }
}

namespace {
std::unique_ptr<ThreadPool>& global() {
  static std::unique_ptr<ThreadPool> p;
  return p;
}
int default_threads() {
  const auto cpus = allowed_cpus();
  return cpus.empty() ? int(std::thread::hardware_concurrency()) : int(cpus.size());
}
}  // namespace

ThreadPool& pool() {
  if (!global()) global() = std::make_unique<ThreadPool>(default_threads());
  return *global();
}

void set_num_threads(int threads) {
  if (threads < 0) throw std::invalid_argument("threads must be >= 0 (0 = every CPU available)");
  const int n = threads == 0 ? default_threads() : threads;
  if (global() && global()->size() == n) return;
  if (global() && n <= global()->capacity()) return global()->set_active(n);
  global().reset();
  global() = std::make_unique<ThreadPool>(n);
}

int num_threads() { return pool().size(); }

void set_thread_groups(const std::vector<std::vector<int>>& cpus, const std::vector<int>& threads) {
  if (cpus.empty()) {
    if (global() && global()->grouped()) {
      const int n = global()->capacity();
      global().reset();
      global() = std::make_unique<ThreadPool>(n);
    }
    return;
  }
  if (global() && global()->grouped() && global()->group_cpus() == cpus) {
    global()->set_active(global()->capacity());
    std::vector<int> have(cpus.size(), 0);
    for (const auto& seat : global()->seats()) ++have[seat.group];
    if (have == threads) return;
  }
  global().reset();
  global() = std::make_unique<ThreadPool>(cpus, threads);
}

}  // namespace hybrid
