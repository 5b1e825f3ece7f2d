#include "parallel.hpp"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <mutex>
#include <thread>
#include <vector>

namespace tokenmill {
namespace {

class HelperPool {
 public:
  void run(size_t parts, const std::function<void(size_t)>& task) {
    std::unique_lock<std::mutex> region(region_, std::try_to_lock);
    if (parts <= 1 || !region.owns_lock() || !ready()) {
      run_serially(parts, task);
      return;
    }
    {
      std::lock_guard<std::mutex> lock(mutex_);
      task_ = &task;
      parts_ = parts;
      next_ = 0;
      unfinished_ = parts;
      errors_.assign(parts, nullptr);
      generation_.fetch_add(1, std::memory_order_release);
    }
    wake_.notify_all();
    work();  // the caller takes parts like any helper
    std::unique_lock<std::mutex> lock(mutex_);
    done_.wait(lock, [&] { return unfinished_ == 0; });
    task_ = nullptr;
    for (const std::exception_ptr& error : errors_) {
      if (error) std::rethrow_exception(error);
    }
  }

 private:
  static void run_serially(size_t parts, const std::function<void(size_t)>& task) {
    for (size_t part = 0; part < parts; ++part) task(part);
  }

  // Starts the helpers once, in the process that will use them.
  bool ready() {
    const pid_t pid = getpid();
    if (started_) return pid == owner_;
    started_ = true;
    owner_ = pid;
    const unsigned cores = std::max(2U, std::thread::hardware_concurrency());
    // Detached: the pool is never destroyed (it would have to outlive every helper at exit).
    for (unsigned k = 0; k + 1 < std::min(cores, 8U); ++k) std::thread([this] { serve(); }).detach();
    return true;
  }

  // Takes parts of the current region until none is left.
  void work() {
    std::unique_lock<std::mutex> lock(mutex_);
    while (task_ != nullptr && next_ < parts_) {
      const size_t part = next_++;
      const std::function<void(size_t)>& task = *task_;
      lock.unlock();
      std::exception_ptr error;
      try {
        task(part);
      } catch (...) {
        error = std::current_exception();
      }
      lock.lock();
      errors_[part] = error;
      if (--unfinished_ == 0) done_.notify_all();
    }
  }

  void serve() {
    uint64_t seen = 0;
    for (;;) {
      // Spin briefly before sleeping: batches come back to back, and waking a sleeping thread
      // costs tens of microseconds on a VM, as long as a small batch's whole gather.
      const auto spin_until = std::chrono::steady_clock::now() + kSpin;
      while (generation_.load(std::memory_order_acquire) == seen &&
             std::chrono::steady_clock::now() < spin_until) {
        std::this_thread::yield();
      }
      {
        std::unique_lock<std::mutex> lock(mutex_);
        wake_.wait(lock, [&] { return generation_.load(std::memory_order_relaxed) != seen; });
        seen = generation_.load(std::memory_order_relaxed);
      }
      work();
    }
  }

  static constexpr std::chrono::microseconds kSpin{200};

  std::mutex region_;
  std::mutex mutex_;
  std::condition_variable wake_;
  std::condition_variable done_;
  const std::function<void(size_t)>* task_ = nullptr;
  size_t parts_ = 0;
  size_t next_ = 0;
  size_t unfinished_ = 0;
  std::atomic<uint64_t> generation_{0};
  std::vector<std::exception_ptr> errors_;
  bool started_ = false;
  pid_t owner_ = 0;
};

}  // namespace

void run_parts(size_t parts, const std::function<void(size_t)>& task) {
  static HelperPool* const pool = new HelperPool();  // never destroyed: helpers are detached
  pool->run(parts, task);
}

}  // namespace tokenmill
