#include "read_ahead.hpp"

#include <unistd.h>

#include <cerrno>
#include <new>
#include <system_error>
#include <utility>

namespace tokenmill {
namespace {

// `size` bytes at `offset`, fewer only at the end of the file (it shrank since the fstat)
int read_at(int descriptor, char* buffer, size_t size, uint64_t offset, size_t& done) noexcept {
  done = 0;
  while (done < size) {
    const off_t at = static_cast<off_t>(offset + done);
    ssize_t got = ::pread(descriptor, buffer + done, size - done, at);
    if (got < 0 && errno == EINTR) continue;
    if (got < 0) return errno;
    if (got == 0) break;
    done += static_cast<size_t>(got);
  }
  return 0;
}

}  // namespace

ReadAheadResult read_ahead_one(const ReadAheadRequest& request) noexcept {
  ReadAheadResult result;
  result.opened = open_for_read(request.path, false);
  const int descriptor = result.opened.descriptor;
  result.opened.descriptor = -1;
  if (result.opened.error != 0) return result;
  const uint64_t size = result.opened.size;
  if (request.whole) {
    if (size > request.limit) {
      close_read(descriptor);
      return result;  // not read: the caller maps it
    }
    const size_t capacity = static_cast<size_t>(size) + 1;
    result.contents.reset(new (std::nothrow) char[capacity]);
    if (!result.contents) {
      close_read(descriptor);
      result.read_error = ENOMEM;
      return result;
    }
    ReadOutcome outcome = read_and_close(descriptor, result.contents.get(), capacity);
    result.read_error = outcome.error;
    result.read = outcome.error == 0;
    result.length = result.read ? outcome.done : 0;
    return result;
  }
  const size_t head = static_cast<size_t>(size < request.sample ? size : request.sample);
  const uint64_t tail_start = size > request.sample ? (size - request.sample > request.sample
                                                           ? size - request.sample
                                                           : request.sample)
                                                     : size;
  const size_t tail = static_cast<size_t>(size - tail_start);
  result.contents.reset(new (std::nothrow) char[head + tail + 1]);
  if (!result.contents) {
    close_read(descriptor);
    result.read_error = ENOMEM;
    return result;
  }
  size_t got_head = 0;
  size_t got_tail = 0;
  int error = read_at(descriptor, result.contents.get(), head, 0, got_head);
  if (error == 0 && tail > 0) {
    error = read_at(descriptor, result.contents.get() + got_head, tail, tail_start, got_tail);
  }
  close_read(descriptor);
  result.read_error = error;
  result.read = error == 0;
  result.head = got_head;
  result.length = result.read ? got_head + got_tail : 0;
  return result;
}

ReadAhead::ReadAhead(std::vector<ReadAheadRequest> requests, size_t max_pending,
                     size_t max_pending_bytes)
    : requests_(std::move(requests)),
      max_pending_(max_pending == 0 ? 1 : max_pending),
      max_pending_bytes_(max_pending_bytes),
      owner_pid_(static_cast<long>(::getpid())),
      states_(requests_.size(), State::pending),
      results_(requests_.size()) {
  if (requests_.empty()) return;
  try {
    worker_ = std::thread([this] { run(); });
  } catch (const std::system_error&) {
    // no thread (a process at its thread limit): every take reads on the caller's thread
  }
}

ReadAhead::~ReadAhead() {
  if (static_cast<long>(::getpid()) != owner_pid_) {
    // a forked child's copy: its worker and the state of its mutex are the parent's; leak the
    // thread object rather than touch them (std::thread's destructor would terminate)
    if (worker_.joinable()) new (std::nothrow) std::thread(std::move(worker_));
    return;
  }
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
  }
  room_.notify_all();
  if (worker_.joinable()) worker_.join();
}

void ReadAhead::run() noexcept {
  for (;;) {
    size_t index;
    {
      std::unique_lock<std::mutex> lock(mutex_);
      if (!stopping_ && (pending_ >= max_pending_ || pending_bytes_ >= max_pending_bytes_)) {
        // full: sleep until the takes have emptied half of it (a wake-up per take cost the
        // taker ~14 us of its own CPU, more than the read it saved)
        asleep_ = true;
        room_.wait(lock, [this] { return stopping_ || half_empty(); });
        asleep_ = false;
      }
      while (next_ < requests_.size() && states_[next_] != State::pending) ++next_;
      if (stopping_ || next_ >= requests_.size()) return;
      index = next_++;
      states_[index] = State::reading;
    }
    ReadAheadResult result = read_ahead_one(requests_[index]);
    {
      std::lock_guard<std::mutex> lock(mutex_);
      read_by_worker_ += 1;
      if (index < passed_) {
        states_[index] = State::taken;  // passed over while it was read: the result is freed
      } else {
        pending_ += 1;
        pending_bytes_ += result.length;
        results_[index] = std::move(result);
        states_[index] = State::done;
      }
    }
    done_.notify_all();
  }
}

std::optional<ReadAheadResult> ReadAhead::take(size_t index) {
  if (index >= requests_.size() || static_cast<long>(::getpid()) != owner_pid_) {
    return std::nullopt;
  }
  std::optional<ReadAheadResult> taken;
  bool read_here = false;
  bool wake = false;
  {
    std::unique_lock<std::mutex> lock(mutex_);
    pass_over(index);
    if (states_[index] == State::pending) {
      states_[index] = State::taken;  // not started: read here, the worker skips it
      read_here = true;
    } else if (states_[index] != State::taken) {
      done_.wait(lock, [&] { return states_[index] != State::reading; });
      if (states_[index] == State::done) {  // (taken: passed over by another take meanwhile)
        taken = std::move(results_[index]);
        states_[index] = State::taken;
        pending_ -= 1;
        pending_bytes_ -= taken->length;
      }
    }
    wake = asleep_ && half_empty();
  }
  if (wake) room_.notify_one();
  if (read_here) taken = read_ahead_one(requests_[index]);
  return taken;
}

void ReadAhead::pass_over(size_t index) {
  for (; passed_ + kPassedOver < index; ++passed_) {
    State& state = states_[passed_];
    if (state == State::done) {
      pending_ -= 1;
      pending_bytes_ -= results_[passed_].length;
      results_[passed_] = ReadAheadResult();  // freed
    }
    if (state != State::reading) state = State::taken;  // (one being read: the worker drops it)
  }
}

}  // namespace tokenmill
