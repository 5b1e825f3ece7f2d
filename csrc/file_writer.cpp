#include "file_writer.hpp"

#include <fcntl.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>
#ifdef __linux__
#include <linux/fs.h>
#endif

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <new>
#include <stdexcept>
#include <system_error>

namespace tokenmill {

namespace {

// Queued jobs that wake a sleeping worker (FileWriter::submit_all): a cold build of a
// 1,000-source blend hands over four files per entry, so a worker wakes about every fourth
// entry, where it woke twice per entry before.
constexpr size_t kWakeBacklog = 16;

// -- fault injection (tests only; one relaxed check per step otherwise) --------------------------

std::atomic<int> fault_step{0};
std::atomic<int> fault_countdown{0};
std::atomic<int> fault_error{0};
std::atomic<bool> fault_pause{false};

std::atomic<bool> recording_syncs{false};
std::atomic<bool> failing_threads{false};
std::mutex synced_mutex;
std::vector<std::string> synced_log;

enum class Fault { none, fail, pause };

Fault injected(FileStep step) {
  if (fault_step.load(std::memory_order_relaxed) != static_cast<int>(step)) return Fault::none;
  if (fault_countdown.fetch_sub(1) != 1) return Fault::none;
  return fault_pause.load() ? Fault::pause : Fault::fail;
}

[[noreturn]] void pause_forever() {
  static const char message[] = "PAUSED\n";
  ssize_t ignored = ::write(STDOUT_FILENO, message, sizeof message - 1);
  (void)ignored;
  for (;;) std::this_thread::sleep_for(std::chrono::seconds(60));
}

void log_sync(const std::string& path) noexcept {
  if (!recording_syncs.load(std::memory_order_relaxed)) return;
  try {
    std::lock_guard<std::mutex> lock(synced_mutex);
    synced_log.push_back(path);
  } catch (...) {  // tests only: a lost log line fails the test that reads it
  }
}

int64_t nanoseconds(const struct timespec& time) {
  return static_cast<int64_t>(time.tv_sec) * 1000000000 + time.tv_nsec;
}

FileWriteOutcome failed(FileStep step, int error) {
  FileWriteOutcome outcome;
  outcome.error = error;
  outcome.step = step;
  return outcome;
}

// write(2) until every byte is written (short writes and EINTR retried); 0 or errno.
int write_all(int descriptor, const unsigned char* data, size_t size) {
  if (size > 0) {
    Fault fault = injected(FileStep::write);
    if (fault == Fault::fail) return fault_error.load();
    if (fault == Fault::pause) {
      size_t half = size / 2;
      while (half > 0) {
        ssize_t written = ::write(descriptor, data, half);
        if (written <= 0) break;
        data += written;
        size -= static_cast<size_t>(written);
        half -= static_cast<size_t>(written);
      }
      pause_forever();
    }
  }
  while (size > 0) {
    ssize_t written = ::write(descriptor, data, size);
    if (written < 0) {
      if (errno == EINTR) continue;
      return errno;
    }
    if (written == 0) return EIO;
    data += written;
    size -= static_cast<size_t>(written);
  }
  return 0;
}

}  // namespace

int64_t inode_generation(int descriptor) noexcept {
#if defined(__linux__) && defined(FS_IOC_GETVERSION)
  // the ioctl is declared with a long, but filesystems store an int at its start (ext4, btrfs,
  // xfs, f2fs): a zeroed long-sized buffer, read back as its first four bytes
  unsigned char buffer[sizeof(long)] = {};
  if (::ioctl(descriptor, FS_IOC_GETVERSION, buffer) == 0) {
    uint32_t generation = 0;
    std::memcpy(&generation, buffer, sizeof generation);
    return static_cast<int64_t>(generation);
  }
#else
  (void)descriptor;
#endif
  return -1;
}

OpenedForRead open_for_read(const std::string& path, bool want_generation) noexcept {
  OpenedForRead opened;
  do {
    // O_NONBLOCK: opening a FIFO planted at a data file's name returns at once (fstat below
    // refuses it) instead of waiting for a writer; reads of a regular file ignore the flag
    opened.descriptor = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  } while (opened.descriptor < 0 && errno == EINTR);
  if (opened.descriptor < 0) {
    opened.error = errno;
    opened.step = FileStep::open;
    return opened;
  }
  struct stat status;
  if (::fstat(opened.descriptor, &status) != 0) {
    opened.error = errno;
    opened.step = FileStep::status;
    close_read(opened.descriptor);
    opened.descriptor = -1;
    return opened;
  }
  if (!S_ISREG(status.st_mode)) {
    opened.error = S_ISDIR(status.st_mode) ? EISDIR : EINVAL;
    opened.step = FileStep::not_regular;
    close_read(opened.descriptor);
    opened.descriptor = -1;
    return opened;
  }
  opened.size = static_cast<uint64_t>(status.st_size);
  opened.inode = static_cast<uint64_t>(status.st_ino);
  opened.mtime_ns =
      static_cast<int64_t>(status.st_mtim.tv_sec) * 1000000000LL + status.st_mtim.tv_nsec;
  opened.ctime_ns =
      static_cast<int64_t>(status.st_ctim.tv_sec) * 1000000000LL + status.st_ctim.tv_nsec;
  if (want_generation) opened.generation = inode_generation(opened.descriptor);
  return opened;
}

ReadOutcome read_and_close(int descriptor, char* buffer, size_t capacity) noexcept {
  ReadOutcome outcome;
  while (outcome.done < capacity) {
    ssize_t got = ::pread(descriptor, buffer + outcome.done, capacity - outcome.done,
                          static_cast<off_t>(outcome.done));
    if (got < 0 && errno == EINTR) continue;
    if (got < 0) {
      outcome.error = errno;
      break;
    }
    if (got == 0) break;
    const size_t asked = capacity - outcome.done;
    outcome.done += static_cast<size_t>(got);
    // a short read that reached the size fstat reported is the end of the file: asking again
    // only to be told so would be one more system call per file (a short read before that
    // size, which some network filesystems return, is continued)
    if (static_cast<size_t>(got) < asked && outcome.done + 1 >= capacity) break;
  }
  close_read(descriptor);
  return outcome;
}

void close_read(int descriptor) noexcept {
  ::close(descriptor);  // read-only: close reports nothing deferred
}

MappedRegion map_region(int descriptor, size_t length) noexcept {
  MappedRegion region;
  if (length == 0) {
    region.error = EINVAL;  // mmap refuses an empty map too; said here so no call is made
    return region;
  }
  void* address = ::mmap(nullptr, length, PROT_READ, MAP_SHARED, descriptor, 0);
  if (address == MAP_FAILED) {
    region.error = errno;
    return region;
  }
  region.address = address;
  region.length = length;
  return region;
}

void unmap_region(void* address, size_t length) noexcept {
  if (address != nullptr) ::munmap(address, length);
}

FileWriteOutcome write_file(const std::string& path, const std::vector<FileChunk>& chunks,
                            bool sync) noexcept {
  Fault fault = injected(FileStep::create);
  if (fault == Fault::fail) return failed(FileStep::create, fault_error.load());
  int descriptor;
  do {
    descriptor = ::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC | O_NOFOLLOW, 0666);
  } while (descriptor < 0 && errno == EINTR);
  if (descriptor < 0) return failed(FileStep::create, errno);
  FileWriteOutcome outcome;
  for (const FileChunk& chunk : chunks) {
    int error = write_all(descriptor, static_cast<const unsigned char*>(chunk.data), chunk.size);
    if (error != 0) {
      outcome = failed(FileStep::write, error);
      break;
    }
  }
  if (outcome.error == 0 && sync && ::fsync(descriptor) != 0) {
    outcome = failed(FileStep::sync, errno);
  } else if (outcome.error == 0 && sync) {
    log_sync(path);
  }
  if (outcome.error == 0) {
    struct stat status {};
    if (::fstat(descriptor, &status) != 0) {
      outcome = failed(FileStep::status, errno);
    } else {
      outcome.size = static_cast<uint64_t>(status.st_size);
      outcome.inode = static_cast<uint64_t>(status.st_ino);
      outcome.mtime_ns = nanoseconds(status.st_mtim);
      outcome.ctime_ns = nanoseconds(status.st_ctim);
      outcome.generation = inode_generation(descriptor);
    }
  }
  // close(2) reports deferred write errors on some filesystems (NFS: EIO, EDQUOT, ENOSPC)
  if (::close(descriptor) != 0 && outcome.error == 0 && errno != EINTR) {
    outcome = failed(FileStep::write, errno);
  }
  return outcome;
}

FileWriteOutcome sync_file(const std::string& path) noexcept {
  int descriptor;
  do {
    descriptor = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  } while (descriptor < 0 && errno == EINTR);
  if (descriptor < 0) return failed(FileStep::open, errno);
  FileWriteOutcome outcome;
  if (::fsync(descriptor) != 0) outcome = failed(FileStep::sync, errno);
  ::close(descriptor);
  if (outcome.error == 0) log_sync(path);
  return outcome;
}

int sync_filesystem(int descriptor, const std::string& label) noexcept {
#if defined(__linux__)
  if (::syncfs(descriptor) != 0) return errno;
  try {
    log_sync("filesystem:" + label);
  } catch (...) {  // the log is for tests only
  }
  return 0;
#else
  (void)descriptor;
  (void)label;
  return ENOSYS;
#endif
}

FileWriter::FileWriter(int threads)
    : max_threads_(threads < 0 ? 0 : threads), owner_pid_(static_cast<long>(::getpid())) {}

FileWriter::~FileWriter() {
  if (static_cast<long>(::getpid()) != owner_pid_) {
    // A forked child: the parent's workers do not exist here, the mutex may have been held by
    // one of them at the fork (locking it would wait forever), and joining or destroying their
    // handles would wait forever or terminate. Leave the handles (a few bytes) alone.
    new std::vector<std::thread>(std::move(workers_));
    return;
  }
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
  }
  work_ready_.notify_all();
  for (std::thread& worker : workers_) worker.join();
}

FileWriteOutcome FileWriter::run(const Job& job) noexcept {
  try {
    return job.write ? write_file(job.path, job.chunks, job.sync) : sync_file(job.path);
  } catch (...) {  // nothing above throws today; a future allocation might
    return failed(job.write ? FileStep::create : FileStep::open, ENOMEM);
  }
}

uint64_t FileWriter::submit_write(std::string path, std::vector<FileChunk> chunks, bool sync) {
  return submit(Job{0, true, sync, std::move(path), std::move(chunks)});
}

uint64_t FileWriter::submit_sync(std::string path) {
  return submit(Job{0, false, true, std::move(path), {}});
}

std::vector<uint64_t> FileWriter::submit_writes(
    std::vector<std::pair<std::string, std::vector<FileChunk>>> files, bool sync) {
  std::vector<Job> jobs;
  jobs.reserve(files.size());
  for (auto& [path, chunks] : files) {
    jobs.push_back(Job{0, true, sync, std::move(path), std::move(chunks)});
  }
  return submit_all(std::move(jobs));
}

uint64_t FileWriter::submit(Job job) {
  std::vector<Job> jobs;
  jobs.push_back(std::move(job));
  return submit_all(std::move(jobs)).front();
}

std::vector<uint64_t> FileWriter::submit_all(std::vector<Job> jobs) {
  bool syncing = false;
  for (const Job& job : jobs) syncing = syncing || job.sync;
  std::vector<uint64_t> tickets;
  tickets.reserve(jobs.size());  // allocated before anything is queued
  std::unique_lock<std::mutex> lock(mutex_);
  bool inline_only = static_cast<long>(::getpid()) != owner_pid_ || max_threads_ == 0;
  // a thread per job that no idle worker will take, up to the limit
  size_t started = 0;
  while (!inline_only && idle_ + started < jobs.size() &&
         workers_.size() < static_cast<size_t>(max_threads_)) {
    try {
      if (failing_threads.load()) {
        throw std::system_error(std::make_error_code(std::errc::resource_unavailable_try_again));
      }
      workers_.emplace_back([this] { run_worker(); });
      ++started;
    } catch (const std::system_error&) {  // no thread could start: the workers we have, or none
      break;
    }
  }
  try {
    for (Job& job : jobs) {
      job.ticket = next_ticket_++;
      outcomes_.emplace(job.ticket, Pending{});  // allocated here, where a failure can throw
      tickets.push_back(job.ticket);
    }
  } catch (...) {
    for (uint64_t ticket : tickets) outcomes_.erase(ticket);
    throw;
  }
  if (inline_only || workers_.empty()) {
    for (Job& job : jobs) {
      lock.unlock();
      FileWriteOutcome outcome = run(job);
      lock.lock();
      outcomes_.find(job.ticket)->second.outcome = outcome;
    }
    return tickets;
  }
  size_t queued = 0;
  try {
    for (Job& job : jobs) {
      queue_.push_back(std::move(job));
      ++queued;
    }
  } catch (...) {  // no worker took any of them: the lock is still held
    for (; queued > 0; --queued) queue_.pop_back();
    for (uint64_t ticket : tickets) outcomes_.erase(ticket);
    throw;
  }
  // A sleeping worker is woken only for a backlog (kWakeBacklog jobs queued) or for fsyncs
  // (each waits on the disk: many in flight pay): a wake-up per small file costs a context
  // switch, and on a busy machine the woken worker preempts the submitter. A job left queued
  // still runs: the worker drains the queue once awake, and wait() runs queued jobs itself.
  const size_t wake = syncing || queue_.size() >= kWakeBacklog
                          ? std::min(idle_, jobs.size())  // busy workers take the rest when free
                          : 0;
  lock.unlock();
  for (size_t k = 0; k < wake; ++k) work_ready_.notify_one();
  return tickets;
}

void FileWriter::run_worker() {
  std::unique_lock<std::mutex> lock(mutex_);
  for (;;) {
    ++idle_;
    work_ready_.wait(lock, [this] { return stopping_ || !queue_.empty(); });
    --idle_;
    if (queue_.empty()) return;  // stopping, and every job has run
    Job job = std::move(queue_.front());
    queue_.pop_front();
    lock.unlock();
    FileWriteOutcome outcome = run(job);
    lock.lock();
    outcomes_.find(job.ticket)->second.outcome = outcome;  // no allocation: a worker cannot fail here
    job_done_.notify_all();
  }
}

FileWriteOutcome FileWriter::wait(uint64_t ticket) {
  std::unique_lock<std::mutex> lock(mutex_);
  auto found = outcomes_.find(ticket);
  if (found == outcomes_.end()) {
    throw std::invalid_argument("unknown or already waited-for ticket");
  }
  // One waiter per ticket: a second thread waiting on it would find the entry gone once the
  // first has taken the outcome (a dereferenced end()), so it is refused here, under the lock.
  if (found->second.waited) throw std::invalid_argument("ticket already being waited for");
  found->second.waited = true;
  // While the job has not run, the waiter runs queued jobs itself (oldest first, as a worker
  // would) instead of sleeping: a builder that waits for the writer has nothing else to do, and
  // on a busy machine (or one whose other core is taken) a woken worker only gets the CPU by
  // preempting it. Measured on a 1,000-source cold build: 40-80 ms less CPU in all and ~50 ms
  // less on the builder's thread than sleeping (benchmarks/SCALE.md, 2026-11-28, issue 32).
  // `found` is looked up again after every step: a submit may have rehashed the map meanwhile
  // (only this waiter erases the entry, so it is still there).
  for (;;) {
    found = outcomes_.find(ticket);
    if (found->second.outcome.has_value()) break;
    if (!queue_.empty()) {
      Job job = std::move(queue_.front());
      queue_.pop_front();
      lock.unlock();
      FileWriteOutcome done = run(job);
      lock.lock();
      outcomes_.find(job.ticket)->second.outcome = done;
      job_done_.notify_all();
      continue;
    }
    job_done_.wait(lock);
  }
  FileWriteOutcome outcome = *found->second.outcome;
  outcomes_.erase(found);
  return outcome;
}

namespace file_writer_testing {
void inject(FileStep step, int count, int error, bool pause) {
  fault_countdown.store(0);
  fault_error.store(error);
  fault_pause.store(pause);
  fault_step.store(count > 0 ? static_cast<int>(step) : 0);
  fault_countdown.store(count > 0 ? count : 0);
}
void record_syncs(bool on) { recording_syncs.store(on); }
void fail_thread_creation(bool fail) { failing_threads.store(fail); }
std::vector<std::string> take_synced() {
  std::lock_guard<std::mutex> lock(synced_mutex);
  std::vector<std::string> taken;
  taken.swap(synced_log);
  return taken;
}
}  // namespace file_writer_testing

}  // namespace tokenmill
