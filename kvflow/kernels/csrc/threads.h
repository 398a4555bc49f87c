// Work on a team of threads: OpenMP where the compiler has it (sharing PyTorch's libgomp pool), else a
// pool of std::threads (Apple's clang ships without OpenMP; build with -DKVFLOW_NO_OPENMP).
//
//   kvflow::parallel(threads, [&](kvflow::Team& team) {
//     team.for_dynamic(n, [&](int i) { ... });   // each i once, on any thread, then a barrier
//     team.for_static(m, [&](int i) { ... });    // contiguous blocks of i per thread, then a barrier
//   });
//
// The caller is thread 0. Which thread runs an item never changes a result: the kernels split work so
// that each output is computed the same way wherever it runs.
#pragma once

#if !defined(KVFLOW_NO_OPENMP) && defined(_OPENMP)
#include <omp.h>
#define KVFLOW_OPENMP 1
#else
#include <atomic>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>
#endif

namespace kvflow {

#if defined(KVFLOW_OPENMP)

class Team {
 public:
  int thread() const { return omp_get_thread_num(); }
  int threads() const { return omp_get_num_threads(); }
  template <typename F>
  void for_dynamic(int n, F&& f) {
#pragma omp for schedule(dynamic, 1)
    for (int i = 0; i < n; ++i) f(i);
  }
  template <typename F>
  void for_static(int n, F&& f) {
#pragma omp for schedule(static)
    for (int i = 0; i < n; ++i) f(i);
  }
};

template <typename F>
void parallel(int threads, F&& f) {
  Team team;
  if (threads <= 1) {
    f(team);  // the worksharing loops then run on this thread alone
    return;
  }
#pragma omp parallel num_threads(threads)
  f(team);
}

#else

namespace detail {

// A sense-reversing barrier for the team of one parallel() call.
class Barrier {
 public:
  explicit Barrier(int count) : count_(count), waiting_(count) {}
  void wait() {
    const bool sense = sense_.load(std::memory_order_relaxed);
    if (waiting_.fetch_sub(1, std::memory_order_acq_rel) == 1) {
      waiting_.store(count_, std::memory_order_relaxed);
      sense_.store(!sense, std::memory_order_release);
      return;
    }
    while (sense_.load(std::memory_order_acquire) == sense) std::this_thread::yield();
  }

 private:
  const int count_;
  std::atomic<int> waiting_;
  std::atomic<bool> sense_{false};
};

// Worker threads that stay alive between calls, started as more are first needed.
class Pool {
 public:
  static Pool& get() {
    static Pool pool;
    return pool;
  }
  // job(i) for i in [1, workers], on the pool; returns at once (the caller waits on its own barrier).
  void start(int workers, const std::function<void(int)>& job) {
    std::unique_lock<std::mutex> lock(mutex_);
    while (static_cast<int>(threads_.size()) < workers) {
      const int index = static_cast<int>(threads_.size()) + 1;
      threads_.emplace_back([this, index] { loop(index); });
    }
    job_ = job;
    active_ = workers;
    ++generation_;
    wake_.notify_all();
  }
  ~Pool() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stop_ = true;
    }
    wake_.notify_all();
    for (auto& t : threads_) t.join();
  }

 private:
  void loop(int index) {
    long seen = 0;
    for (;;) {
      std::function<void(int)> job;
      {
        std::unique_lock<std::mutex> lock(mutex_);
        wake_.wait(lock, [&] { return stop_ || generation_ != seen; });
        if (stop_) return;
        seen = generation_;
        if (index > active_) continue;
        job = job_;
      }
      job(index);
    }
  }
  std::mutex mutex_;
  std::condition_variable wake_;
  std::vector<std::thread> threads_;
  std::function<void(int)> job_;
  long generation_ = 0;
  int active_ = 0;
  bool stop_ = false;
};

}  // namespace detail

class Team {
 public:
  Team(int thread, int threads, detail::Barrier* barrier, std::atomic<int>* counters)
      : thread_(thread), threads_(threads), barrier_(barrier), counters_(counters) {}
  int thread() const { return thread_; }
  int threads() const { return threads_; }
  template <typename F>
  void for_dynamic(int n, F&& f) {
    std::atomic<int>& next = counters_[loop_ % 4];
    for (int i = next.fetch_add(1); i < n; i = next.fetch_add(1)) f(i);
    end_loop();
  }
  template <typename F>
  void for_static(int n, F&& f) {
    const int lo = static_cast<int>(static_cast<long long>(n) * thread_ / threads_);
    const int hi = static_cast<int>(static_cast<long long>(n) * (thread_ + 1) / threads_);
    for (int i = lo; i < hi; ++i) f(i);
    end_loop();
  }

 private:
  void end_loop() {
    if (barrier_) barrier_->wait();
    // Every thread is past loop_ - 1 now, so the counter that loop_ + 2 will use (last used by loop_ - 2)
    // is free to reset.
    if (thread_ == 0) counters_[(loop_ + 2) % 4].store(0, std::memory_order_relaxed);
    if (barrier_) barrier_->wait();
    ++loop_;
  }
  int thread_, threads_;
  detail::Barrier* barrier_;
  std::atomic<int>* counters_;
  int loop_ = 0;
};

template <typename F>
void parallel(int threads, F&& f) {
  std::atomic<int> counters[4] = {{0}, {0}, {0}, {0}};
  if (threads <= 1) {
    Team team(0, 1, nullptr, counters);
    f(team);
    return;
  }
  detail::Barrier barrier(threads);
  std::atomic<int> running(threads - 1);
  auto body = [&](int index) {
    Team team(index, threads, &barrier, counters);
    f(team);
    if (index != 0) running.fetch_sub(1, std::memory_order_release);  // its last touch of this frame
  };
  detail::Pool::get().start(threads - 1, body);
  body(0);
  while (running.load(std::memory_order_acquire) != 0) std::this_thread::yield();
}

#endif

}  // namespace kvflow
