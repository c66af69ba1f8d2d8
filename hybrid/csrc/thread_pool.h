// A pool of pinned threads. run(fn) runs fn(i) for i in [0, size()): the caller takes i = 0 and threads-1
// workers the rest, so the caller never sits on a core a worker needs. submit(fn) is asynchronous: the workers
// alone run fn(i) for i in [0, async_size()) while the caller goes on with its own work until wait(); with no
// workers it runs fn(0) at once. Workers spin briefly between jobs (decode issues one job per layer, so wake-up
// latency matters), then sleep.
// Jobs queue: every worker runs the posted jobs in the order they were posted, so a worker done with its part of
// one job goes on to the next at once (a submitted job's tail overlaps the next one's start: two decode lanes'
// MoE calls keep the cores busy across their hand-offs). Up to kQueued jobs are in flight; a post beyond that
// waits for the oldest. run() first waits for every job before it (its caller works on the job too), submit()
// does not. submit() and run() may be called from several threads (two decode lanes' host functions).
// submit() returns the job's ticket; wait(ticket) joins that job only, wait() every job posted so far.
// set_active(n) narrows or widens the pool between jobs without making or ending threads: the workers beyond the
// first n - 1 park (asleep on a condition, no spinning on their cores) until it is widened again, so a process can
// hand cores to other work for a while (a prefill beside decode) and take them back for the cost of a wake-up.
// Node groups (NUMA): each participant has a seat, a CPU and a group (a node's threads). A grouped pool seats its
// groups' threads interleaved (group 0, 1, ..., 0, 1, ...), so that narrowing it keeps each group's share; each
// worker is pinned to its seat's CPU, and the caller takes the seat of the group whose CPUs it runs on at the call.
// A job reads its thread's group (worker_group, worker_rank) to take only that group's work (moe.cpp).
#pragma once
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace hybrid {

class ThreadPool {
 public:
  struct Seat {
    int cpu, group;
  };
  explicit ThreadPool(int threads);
  // group_threads[g] participants pinned to group_cpus[g] (round-robin over them), the caller counted in group 0
  ThreadPool(const std::vector<std::vector<int>>& group_cpus, const std::vector<int>& group_threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int size() const { return active() + 1; }
  int async_size() const { return active() == 0 ? 1 : active(); }
  int capacity() const { return int(workers_.size()) + 1; }
  void set_active(int threads);  // 1 <= threads <= capacity(); waits for the jobs in flight first
  void run(const std::function<void(int)>& fn);
  uint64_t submit(std::function<void(int)> fn);
  void wait();
  void wait(uint64_t ticket);

  int groups() const { return int(group_cpus_.size()); }
  bool grouped() const { return grouped_; }
  const std::vector<std::vector<int>>& group_cpus() const { return group_cpus_; }
  // The active participants' seats: the caller's (index 0), then the active workers'.
  std::vector<Seat> seats() const;
  // The group whose CPUs the calling thread runs on now (0 where none holds it).
  int caller_group() const;
  // Per group, the threads a job posted now runs on: the active workers, plus the caller in caller_group when it
  // works too (run(), or submit() on a pool without active workers; caller_group < 0: it does not).
  std::vector<int> participants(int caller_group) const;
  // The calling thread's group, and its index among its group's workers, if it is a worker of a pool; else -1.
  static int worker_group();
  static int worker_rank();
  static int worker_index();

 private:
  static constexpr int kQueued = 4;
  struct Slot {
    std::function<void(int)> fn;
    int first_index = 0;
    std::atomic<int> pending{0};     // workers yet to finish it
    std::atomic<uint64_t> ticket{0};  // the job in this slot (ticket % kQueued == the slot)
  };
  void start(std::vector<Seat> seats);
  uint64_t post(std::function<void(int)> fn, int first_index);
  bool done(uint64_t ticket) const;
  void loop(int index);
  int active() const { return active_.load(std::memory_order_acquire); }

  std::vector<std::thread> workers_;
  std::vector<Seat> seats_;                    // per participant: the caller's, then each worker's
  std::vector<std::vector<int>> group_cpus_;  // per group, its CPUs (one group of every allowed CPU when plain)
  bool grouped_ = false;
  Slot slots_[kQueued];
  std::atomic<uint64_t> generation_{0};  // the latest job's ticket (tickets count from 1)
  std::atomic<bool> stop_{false};
  std::atomic<int> active_{0};        // workers taking part in the jobs (the first ones); the others park
  std::atomic<uint64_t> epoch_{0};    // counts set_active calls: a worker that sees it move re-reads its part
  uint64_t resume_ = 1;               // the first ticket of the current epoch (guarded by mu_)
  std::mutex mu_, post_mu_;
  std::condition_variable wake_, done_, park_;  // park_: the parked workers' own (no wake-up at each job)
};

// The process-wide pool the kernels use; sized by set_num_threads (0 = every CPU this process may use): narrowed
// and widened in place up to the most threads it has had, made anew only to grow past that (a plain pool then).
// set_thread_groups makes it anew in node groups (threads[g] pinned to cpus[g]) unless it has that layout already;
// with no groups, a grouped pool is made anew plain, as many threads as it had.
ThreadPool& pool();
void set_num_threads(int threads);
int num_threads();
void set_thread_groups(const std::vector<std::vector<int>>& cpus, const std::vector<int>& threads);

}  // namespace hybrid
