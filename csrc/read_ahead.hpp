// Data files read ahead of their use, on one background thread: the other I/O half of a blend's
// start-up (file_writer.hpp writes its cache files).
//
// Why: a blend of S sources opens each source's .idx and, on a cold build, fingerprints its .bin,
// one source after the other on the builder's thread, between the Python work of each. For a
// small .idx (read whole into fresh memory) the open, the read and the page faults of that fresh
// memory were ~30 us of ~500 us per source, and the .bin's sampled fingerprint reads ~15 us:
// done here, on another core, while the builder works on the sources before. Plain C++ over
// POSIX: the worker never needs the GIL (a Python thread would have to take it per file, and
// take it from the builder).
//
// A ReadAhead is given its requests up front, in the order they will probably be taken:
//  * whole: open (O_NONBLOCK, refusing what is not a regular file), fstat and, for a file of at
//    most `limit` bytes, read it whole into a buffer of its own (size + 1 bytes asked, as
//    read_and_close), close;
//  * sampled: open, fstat, read the first `sample` bytes and the last `sample` bytes after
//    those (fewer for a smaller file), close.
// take(index) returns a request's result once, reading it on the calling thread if the worker has
// not started it (so no order of takes can wait on the worker's window), and nullopt for an index
// taken already or out of range, or in a forked child (which has no worker: the caller reads the
// file itself). A take passes over the requests more than kPassedOver before it: those not taken by
// then are not wanted (a cache hit fingerprints no .bin), so their results are freed and those not
// started are skipped, and results nobody takes never fill the window; a later take of one returns
// nullopt. The worker stays at most `max_pending` results or `max_pending_bytes` of buffers ahead
// of the takes, and once there sleeps until the takes have emptied half of that (one wake-up per
// half window, not per take). The destructor stops the worker and frees what was not taken.
#pragma once

#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "file_writer.hpp"

namespace tokenmill {

struct ReadAheadRequest {
  std::string path;
  bool whole = true;   // false: sampled
  uint64_t limit = 0;  // whole: read only a file of at most this many bytes
  uint64_t sample = 0; // sampled: bytes at each end
};

struct ReadAheadResult {
  OpenedForRead opened;       // error, failed step and the fstat (the descriptor is closed)
  int read_error = 0;         // errno of a failed read
  bool read = false;          // contents were read (whole: false for a file over the limit)
  std::unique_ptr<char[]> contents;  // whole: the file; sampled: the head, then the tail
  size_t length = 0;          // bytes in contents
  size_t head = 0;            // sampled: how many of them are the head
};

// One request, read on the calling thread (what the worker runs).
ReadAheadResult read_ahead_one(const ReadAheadRequest& request) noexcept;

class ReadAhead {
 public:
  static constexpr size_t kPassedOver = 16;

  ReadAhead(std::vector<ReadAheadRequest> requests, size_t max_pending, size_t max_pending_bytes);
  ~ReadAhead();
  ReadAhead(const ReadAhead&) = delete;
  ReadAhead& operator=(const ReadAhead&) = delete;

  std::optional<ReadAheadResult> take(size_t index);
  size_t size() const { return requests_.size(); }
  size_t read_by_worker() {
    std::lock_guard<std::mutex> lock(mutex_);
    return read_by_worker_;
  }

 private:
  enum class State : unsigned char { pending, reading, done, taken };
  void run() noexcept;
  void pass_over(size_t index);  // under the lock
  bool half_empty() const {
    return pending_ <= max_pending_ / 2 && pending_bytes_ <= max_pending_bytes_ / 2;
  }

  const std::vector<ReadAheadRequest> requests_;
  const size_t max_pending_;
  const size_t max_pending_bytes_;
  const long owner_pid_;
  std::mutex mutex_;
  std::condition_variable done_;  // a result is in
  std::condition_variable room_;  // a result was taken, or stop
  std::vector<State> states_;
  std::vector<ReadAheadResult> results_;
  size_t next_ = 0;           // the worker's next request
  size_t passed_ = 0;         // requests before it were passed over (or taken)
  size_t pending_ = 0;        // results done and not taken
  size_t pending_bytes_ = 0;  // their buffers' bytes
  bool stopping_ = false;
  bool asleep_ = false;       // the worker waits for room
  size_t read_by_worker_ = 0;
  std::thread worker_;
};

}  // namespace tokenmill
