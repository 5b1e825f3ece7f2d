// Small files written in the background: the I/O half of tokenmill's cache writes.
//
// Not a kernel (kernels do no I/O): this and read_ahead.hpp are the places in csrc that touch the
// filesystem, and they know nothing of Python either. Why it is C++: a cold build of a 1,000-source
// blend writes 5,000 small files, and each Python-level open/write/close waits for the GIL while
// the builder thread computes the next member's indices, so writes from Python threads ran slower
// than writes in line. A worker here never needs the GIL: the files of one member are written while
// the caller builds the next (benchmarks/bench_scale.py measures the cold build).
//
// A FileWriter owns a queue and up to `threads` worker threads (started on demand).
//  * submit_write(path, chunks, sync): create `path` with O_CREAT | O_EXCL (mode 0666 minus the
//    umask, applied by the kernel), write the chunks in order, fsync if `sync`, fstat, close.
//    The caller keeps the chunks' bytes alive and unchanged until wait() returns for the ticket.
//  * submit_writes(files, sync): the same for several files at once (one ticket each).
//  * submit_sync(path): open `path` read-only, fsync, close (a commit's durability step for
//    files written elsewhere). Many fsyncs in flight share the filesystem's journal commits, so
//    a writer for synced files wants many threads.
//  * wait(ticket): block until that job has run and return its outcome; each ticket is waited
//    for once. Until then the waiting thread runs queued jobs itself, oldest first (it would
//    only sleep, and a woken worker would preempt it on a busy machine). Errors are returned, never thrown: errno and the step that failed.
// Guarantees: jobs run in any order and concurrently (callers order what must be ordered:
// renames happen after wait); a job's failure affects no other job; an exception inside a job
// (std::bad_alloc) is its ENOMEM; if no worker thread can start, or in a forked child (where
// the parent's workers do not exist), jobs run in the submitting thread; the destructor runs
// every queued job and joins the workers (in a forked child it touches neither the mutex nor
// the parent's threads). Idle workers sleep on a condition variable.
#pragma once

#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <mutex>
#include <string>
#include <thread>
#include <optional>
#include <unordered_map>
#include <utility>
#include <vector>

namespace tokenmill {

// Which step of a job failed (FileWriteOutcome::step).
// not_regular: a read refused a file that is not a regular file (a FIFO, device, socket or
// directory planted where a data or cache file is expected), seen by fstat after an O_NONBLOCK
// open, so the open never blocks on a FIFO
enum class FileStep : int {
  none = 0,
  create = 1,
  write = 2,
  status = 3,
  open = 4,
  sync = 5,
  not_regular = 6
};

struct FileWriteOutcome {
  int error = 0;                 // errno of the failed step, 0 on success
  FileStep step = FileStep::none;
  // fstat of the written file (writes only): what survives the rename
  uint64_t size = 0;
  uint64_t inode = 0;
  int64_t mtime_ns = 0;
  int64_t ctime_ns = 0;
  // the inode's generation (FS_IOC_GETVERSION: ext4, btrfs, xfs, f2fs, Lustre), which changes
  // when an inode number is reused; -1 where the filesystem does not report one (tmpfs, NFS)
  int64_t generation = -1;
};

struct FileChunk {
  const void* data;
  size_t size;
};

class FileWriter {
 public:
  explicit FileWriter(int threads);
  ~FileWriter();
  FileWriter(const FileWriter&) = delete;
  FileWriter& operator=(const FileWriter&) = delete;

  uint64_t submit_write(std::string path, std::vector<FileChunk> chunks, bool sync);
  // Several writes submitted at once, one ticket each, in order: one lock and at most one
  // wake-up per idle worker, where a submit per file wakes a sleeping worker per file.
  std::vector<uint64_t> submit_writes(
      std::vector<std::pair<std::string, std::vector<FileChunk>>> files, bool sync);
  uint64_t submit_sync(std::string path);
  // The job's outcome, once it has run; std::invalid_argument for a ticket that is unknown,
  // already waited for, or being waited for by another thread.
  FileWriteOutcome wait(uint64_t ticket);

 private:
  struct Job {
    uint64_t ticket;
    bool write;  // false: only fsync an existing file
    bool sync;
    std::string path;
    std::vector<FileChunk> chunks;
  };
  uint64_t submit(Job job);
  std::vector<uint64_t> submit_all(std::vector<Job> jobs);
  void run_worker();
  static FileWriteOutcome run(const Job& job) noexcept;

  const int max_threads_;
  const long owner_pid_;
  std::mutex mutex_;
  std::condition_variable work_ready_;
  std::condition_variable job_done_;
  std::deque<Job> queue_;
  struct Pending {
    std::optional<FileWriteOutcome> outcome;  // once the job has run
    bool waited = false;                      // a thread is in wait() for it
  };
  // every ticket submitted and not yet waited for
  std::unordered_map<uint64_t, Pending> outcomes_;
  std::vector<std::thread> workers_;
  uint64_t next_ticket_ = 1;
  size_t idle_ = 0;
  bool stopping_ = false;
};

// The single steps, also what a worker runs (exposed for tests and serial callers).
FileWriteOutcome write_file(const std::string& path, const std::vector<FileChunk>& chunks,
                            bool sync) noexcept;
FileWriteOutcome sync_file(const std::string& path) noexcept;

// The generation of the open file's inode (FileWriteOutcome::generation), -1 if unknown:
// with the inode number, it names one file even where the number was freed and reused.
int64_t inode_generation(int descriptor) noexcept;

// A small file read whole, in two steps so the caller can allocate the buffer in between
// (the bindings: a Python bytes object of the file's size, read into directly, one copy and one
// allocation): what a warm start does for each of the five or so small files behind every cache
// entry (three arrays, the description, the data fingerprint) and each source's .idx.
struct OpenedForRead {
  int error = 0;                   // errno of the failed step, 0 on success
  FileStep step = FileStep::none;  // open or status
  int descriptor = -1;             // open (close it with read_and_close or close_read)
  uint64_t size = 0;
  uint64_t inode = 0;
  int64_t mtime_ns = 0;
  int64_t ctime_ns = 0;
  int64_t generation = -1;  // only with want_generation
};
OpenedForRead open_for_read(const std::string& path, bool want_generation) noexcept;

struct ReadOutcome {
  int error = 0;  // errno of the failed read
  size_t done = 0;
};
// Read from offset 0 until `capacity` bytes or end of file, then close. The caller asks for one
// byte more than the size fstat reported: a file that grew since shows as longer, and a short
// read that reaches that size is taken as the end of the file.
ReadOutcome read_and_close(int descriptor, char* buffer, size_t capacity) noexcept;
void close_read(int descriptor) noexcept;

// A read-only shared map of the first `length` bytes of the open `descriptor` (mmap(2)); the
// descriptor may be closed as soon as this returns, the map stays until unmap_region. Here
// rather than through Python's mmap module, which (before 3.13) keeps a duplicate descriptor
// per map, or ctypes, whose call and finalizer cost more than the mmap itself: a blend maps one
// .idx and up to three cached arrays per source.
struct MappedRegion {
  int error = 0;  // errno of the failed mmap (EINVAL for a zero length)
  void* address = nullptr;
  size_t length = 0;
};
MappedRegion map_region(int descriptor, size_t length) noexcept;
void unmap_region(void* address, size_t length) noexcept;

// Flush every file of the filesystem that holds the open `descriptor` (Linux syncfs(2)): the
// durability step of a large batch, one call where a fsync per file would each wait for a
// journal commit. Returns 0 or errno (ENOSYS where the system has no syncfs). From Linux 5.8 on,
// it also reports a writeback error of that filesystem since `descriptor` was opened, so callers
// open it before writing the files it must cover. `label` names it in the test log.
int sync_filesystem(int descriptor, const std::string& label) noexcept;

namespace file_writer_testing {
// Fault injection for tests (tokenmill._core._testing): the `count`-th write(2) (or create, for
// step == create) from now fails with `error` (count <= 0 disables). With pause set instead of
// an error, that write stores half its bytes, prints "PAUSED" to stdout and sleeps, for crash
// tests that SIGKILL a process mid-file.
void inject(FileStep step, int count, int error, bool pause);
// While recording, every successful fsync appends its path to a log, and every successful
// sync_filesystem "filesystem:" and its label; take_synced() returns the log and empties it.
void record_syncs(bool on);
// While set, starting a worker thread fails as if the system refused (std::system_error).
void fail_thread_creation(bool fail);
std::vector<std::string> take_synced();
}  // namespace file_writer_testing

}  // namespace tokenmill
