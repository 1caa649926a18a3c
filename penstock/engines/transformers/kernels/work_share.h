// A kernel's loop shared between the calling thread and helper threads that take chunks of
// it from one counter, as they get a core.
//
// at::parallel_for splits a loop into one part per thread and its OpenMP team then waits
// at a barrier for every part. A decode step calls ~200 kernels of 10 us to 1 ms, and on a
// machine whose other core is busy (the server's event loop, a client, another process) the
// part given to a thread the OS has not scheduled waits a whole time slice: two threads were
// 2.8x slower than one. Here the caller never waits for a helper that has not started: it
// takes every chunk left, and waits only for chunks a helper is already running (chunks are
// sized to tens of microseconds). A helper spins briefly between calls, so the kernels of a
// step find it awake, then sleeps, so it costs nothing between steps.
//
// The helpers are as many as torch's intra-op threads less one (``--cpu-threads``), started
// at first use. A call made while another is running (a second engine thread) runs alone on
// its caller, as does a loop of one chunk.
#pragma once

#include <ATen/Parallel.h>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define PENSTOCK_SPIN_PAUSE() _mm_pause()
#else
#define PENSTOCK_SPIN_PAUSE() std::this_thread::yield()
#endif

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <new>
#include <thread>

#include <pthread.h>

namespace penstock {

class WorkShare {
 public:
  static WorkShare& instance() {
    // Never destroyed: helper threads may still be spinning when the process exits.
    static WorkShare* pool = [] {
      auto* created = new WorkShare();
      pthread_atfork(nullptr, nullptr, [] { instance().forget_helpers(); });
      return created;
    }();
    return *pool;
  }

  // body(begin, end) over [0, n) in chunks of ``grain``, the last one shorter.
  template <typename Body>
  void run(int64_t n, int64_t grain, const Body& body) {
    const int64_t chunks = (n + grain - 1) / grain;
    const int64_t threads = std::min<int64_t>(at::get_num_threads(), chunks);
    std::unique_lock<std::mutex> running(run_mutex_, std::try_to_lock);
    if (threads <= 1 || !running.owns_lock()) {
      if (n > 0) body(0, n);
      return;
    }
    start_helpers(static_cast<int>(threads - 1));
    const uint64_t generation = (ticket_.load(std::memory_order_relaxed) >> 32) + 1;
    Job& job = jobs_[generation & 1];
    job.call.store(&call<Body>, std::memory_order_relaxed);
    job.body.store(&body, std::memory_order_relaxed);
    job.n.store(n, std::memory_order_relaxed);
    job.grain.store(grain, std::memory_order_relaxed);
    job.chunks.store(chunks, std::memory_order_relaxed);
    job.done.store(0, std::memory_order_relaxed);
    ticket_.store(generation << 32, std::memory_order_seq_cst);
    // One wake-up a sleep: the helpers woken are not counted again until they sleep again.
    if (sleepers_.exchange(0, std::memory_order_seq_cst) > 0) {
      { std::lock_guard<std::mutex> lock(sleep_mutex_); }
      wake_.notify_all();
    }
    work(generation);
    while (job.done.load(std::memory_order_acquire) < chunks) PENSTOCK_SPIN_PAUSE();
  }

 private:
  using Call = void (*)(const void* body, int64_t begin, int64_t end);

  struct Job {
    std::atomic<Call> call{nullptr};
    std::atomic<const void*> body{nullptr};
    std::atomic<int64_t> n{0}, grain{1}, chunks{0}, done{0};
  };

  template <typename Body>
  static void call(const void* body, int64_t begin, int64_t end) {
    (*static_cast<const Body*>(body))(begin, end);
  }

  // Takes chunks of job ``generation`` until none is left or a newer job replaced it. A
  // job's fields are read before the chunk is claimed, and the claim succeeds only while
  // the ticket still names that job, so a stale read is never acted on.
  void work(uint64_t generation) {
    uint64_t ticket = ticket_.load(std::memory_order_acquire);
    for (;;) {
      if ((ticket >> 32) != generation) return;
      Job& job = jobs_[generation & 1];
      const int64_t chunk = static_cast<int64_t>(ticket & 0xffffffffu);
      if (chunk >= job.chunks.load(std::memory_order_relaxed)) return;
      const Call fn = job.call.load(std::memory_order_relaxed);
      const void* body = job.body.load(std::memory_order_relaxed);
      const int64_t n = job.n.load(std::memory_order_relaxed);
      const int64_t grain = job.grain.load(std::memory_order_relaxed);
      if (!ticket_.compare_exchange_weak(ticket, ticket + 1, std::memory_order_acq_rel)) continue;
      fn(body, chunk * grain, std::min(n, (chunk + 1) * grain));
      job.done.fetch_add(1, std::memory_order_release);
      ticket = ticket_.load(std::memory_order_acquire);
    }
  }

  // In a forked child: the helpers were not copied, and a lock one of them held would
  // never be released. Fresh locks and no helpers; the first call starts new ones.
  void forget_helpers() {
    new (&run_mutex_) std::mutex();
    new (&sleep_mutex_) std::mutex();
    new (&wake_) std::condition_variable();
    sleepers_.store(0);
    helpers_ = 0;
  }

  void start_helpers(int wanted) {
    while (helpers_ < wanted) {
      std::thread([this] { helper(); }).detach();
      ++helpers_;
    }
  }

  void helper() {
    uint64_t seen = ticket_.load(std::memory_order_acquire) >> 32;
    for (;;) {
      uint64_t generation = ticket_.load(std::memory_order_acquire) >> 32;
      const auto spin_until = std::chrono::steady_clock::now() + kSpin;
      while (generation == seen) {
        for (int i = 0; i < 64 && generation == seen; ++i) {
          PENSTOCK_SPIN_PAUSE();
          generation = ticket_.load(std::memory_order_acquire) >> 32;
        }
        if (generation == seen && std::chrono::steady_clock::now() > spin_until) {
          std::unique_lock<std::mutex> lock(sleep_mutex_);
          while ((ticket_.load(std::memory_order_seq_cst) >> 32) == seen) {
            sleepers_.fetch_add(1, std::memory_order_seq_cst);
            if ((ticket_.load(std::memory_order_seq_cst) >> 32) != seen) break;
            wake_.wait(lock);
          }
          generation = ticket_.load(std::memory_order_acquire) >> 32;
        }
      }
      seen = generation;
      work(generation);
    }
  }

  // Long enough to span the Python between two kernels of a step, short beside a step.
  static constexpr std::chrono::microseconds kSpin{100};

  Job jobs_[2];
  // The current job's generation (high 32 bits) and its next unclaimed chunk (low 32).
  std::atomic<uint64_t> ticket_{0};
  std::atomic<int> sleepers_{0};
  std::mutex run_mutex_, sleep_mutex_;
  std::condition_variable wake_;
  int helpers_ = 0;
};

// Columns of a linear layer per chunk: ~128k multiply-adds, a multiple of 12 (the tiles
// take 3 or 4 columns at a time).
inline int64_t column_grain(int64_t rows, int64_t width) {
  const int64_t columns = (int64_t{1} << 17) / std::max<int64_t>(1, rows * width);
  return std::max<int64_t>(12, (columns + 11) / 12 * 12);
}

}  // namespace penstock
