// Worker threads kept for the life of the process, for primitives that split one product
// over cores. Starting a thread per call costs tens of microseconds, as much as a verify
// row's whole product on a small model; kept workers make a split pay from products of a
// few rows up. A worker that finished a job spins on the job counter for a short while
// before it sleeps, so the next product of the same forward starts at once (yielding its
// core on each turn of the spin); a sleeping worker wakes through a condition variable. One
// job runs at a time: a caller that finds the pool busy (another thread's product) runs every
// part itself, which gives the same results.

#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <system_error>
#include <thread>
#include <vector>

namespace mtp_native {

class WorkerPool {
 public:
  // Runs part(0) .. part(parts - 1): part 0 and any part no worker takes on the calling
  // thread, the others on the pool's workers; returns once every part ran.
  template <typename F>
  void run(int64_t parts, F&& part) {
    if (parts <= 1) {
      if (parts == 1) part(0);
      return;
    }
    std::unique_lock<std::mutex> busy(busy_, std::try_to_lock);
    if (!busy.owns_lock() || !ensure_workers(parts - 1)) {
      for (int64_t t = 0; t < parts; ++t) part(t);
      return;
    }
    std::function<void(int64_t)> job = [&part](int64_t t) { part(t); };
    {
      std::lock_guard<std::mutex> lock(m_);
      job_ = &job;
      parts_ = parts;
      next_.store(1, std::memory_order_relaxed);
      done_.store(0, std::memory_order_relaxed);
      generation_.fetch_add(1, std::memory_order_release);
    }
    wake_.notify_all();
    part(0);
    int64_t ran = 1;
    for (int64_t t; (t = next_.fetch_add(1, std::memory_order_acq_rel)) < parts;) {
      part(t); // parts the workers have not claimed yet
      ++ran;
    }
    done_.fetch_add(ran, std::memory_order_acq_rel);
    while (done_.load(std::memory_order_acquire) < parts) std::this_thread::yield();
    // No worker may still hold this job (its function lives on this frame) once it returns:
    // workers take the job under the lock and count themselves active until they let go.
    for (;;) {
      std::lock_guard<std::mutex> lock(m_);
      if (active_ == 0) {
        job_ = nullptr;
        return;
      }
    }
  }

  static WorkerPool& instance() {
    static WorkerPool* pool = new WorkerPool(); // never destroyed: workers outlive exit paths
    return *pool;
  }

 private:
  static constexpr auto kSpin = std::chrono::microseconds(200);

  bool ensure_workers(int64_t wanted) {
    while (static_cast<int64_t>(workers_.size()) < wanted) {
      try {
        workers_.emplace_back([this] { work(); });
        workers_.back().detach();
      } catch (const std::system_error&) {
        return !workers_.empty() || wanted == 0;
      }
    }
    return true;
  }

  void work() {
    uint64_t seen = generation_.load(std::memory_order_acquire);
    for (;;) {
      // Spin a while for the next job, yielding the core on each turn (to the thread that
      // builds the next graph, where it waits for one: on a machine with as many threads
      // as cores a spin that holds the core delays that graph), then sleep until one is
      // posted.
      const auto until = std::chrono::steady_clock::now() + kSpin;
      while (generation_.load(std::memory_order_acquire) == seen &&
             std::chrono::steady_clock::now() < until) {
        std::this_thread::yield();
      }
      if (generation_.load(std::memory_order_acquire) == seen) {
        std::unique_lock<std::mutex> lock(m_);
        wake_.wait(lock, [&] { return generation_.load(std::memory_order_acquire) != seen; });
      }
      seen = generation_.load(std::memory_order_acquire);
      std::function<void(int64_t)>* job;
      int64_t parts;
      {
        std::lock_guard<std::mutex> lock(m_);
        job = job_;
        parts = parts_;
        if (job == nullptr) continue; // the job already finished without this worker
        ++active_;
      }
      int64_t ran = 0;
      for (int64_t t; (t = next_.fetch_add(1, std::memory_order_acq_rel)) < parts;) {
        (*job)(t);
        ++ran;
      }
      if (ran) done_.fetch_add(ran, std::memory_order_acq_rel);
      std::lock_guard<std::mutex> lock(m_);
      --active_;
    }
  }

  std::mutex busy_; // one job at a time
  std::mutex m_;
  std::condition_variable wake_;
  std::vector<std::thread> workers_;
  std::function<void(int64_t)>* job_ = nullptr;
  int64_t parts_ = 0;
  int active_ = 0; // workers holding job_ (under m_)
  std::atomic<int64_t> next_{0};
  std::atomic<int64_t> done_{0};
  std::atomic<uint64_t> generation_{0};
};

} // namespace mtp_native
