#include "thread_pool.hpp"

#include <pthread.h>
#include <sched.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdlib>
#include <exception>
#include <fstream>
#include <iterator>
#include <mutex>
#include <sstream>
#include <system_error>
#include <thread>
#include <vector>

namespace tokenmill {
namespace {

std::atomic<bool> g_fail_thread_creation{false};

// One parallel_for call, on its caller's stack. Every field is guarded by the pool's mutex.
struct Region {
  const std::function<void(size_t)>* task = nullptr;
  size_t parts = 0;
  size_t next = 0;        // the first part nobody has claimed
  size_t unfinished = 0;  // parts claimed or not, not yet finished
  int seats = 0;          // workers that may still join
  bool listed = false;    // in Pool::open_ (workers may join)
  size_t failed_part = 0;  // the lowest part that threw (`parts`: none)
  std::exception_ptr error;
  std::condition_variable finished;
};

// Microseconds an idle worker polls for new work before it sleeps (TOKENMILL_POOL_SPIN_US,
// default 0, at most 1000).
std::chrono::microseconds spin_from_environment() {
  const char* text = std::getenv("TOKENMILL_POOL_SPIN_US");
  if (text == nullptr) return std::chrono::microseconds{0};
  char* end = nullptr;
  const long value = std::strtol(text, &end, 10);
  if (end == text || value <= 0) return std::chrono::microseconds{0};
  return std::chrono::microseconds{std::min(value, 1000L)};
}

class Pool {
 public:
  Pool() : spin_(spin_from_environment()) {}

  void run(size_t parts, int threads, const std::function<void(size_t)>& task) {
    Region region;
    region.task = &task;
    region.parts = parts;
    region.unfinished = parts;
    region.failed_part = parts;
    std::unique_lock<std::mutex> lock(mutex_);
    region.seats = start_workers(threads - 1);
    if (region.seats > 0) {
      open_.push_back(&region);
      region.listed = true;
      listed_.fetch_add(1, std::memory_order_release);
      lock.unlock();
      for (int k = 0; k < region.seats; ++k) wake_.notify_one();
      lock.lock();
    }
    work_on(region, lock);
    region.finished.wait(lock, [&] { return region.unfinished == 0; });
    lock.unlock();
    if (region.error) std::rethrow_exception(region.error);
  }

  int workers() {
    std::lock_guard<std::mutex> lock(mutex_);
    return workers_;
  }

 private:
  // Starts workers until `wanted` exist (or starting one fails: then fewer, maybe none).
  // Returns how many may join a region. Called with the lock held.
  int start_workers(int wanted) {
    while (workers_ < wanted) {
      try {
        if (g_fail_thread_creation.load(std::memory_order_relaxed)) {
          throw std::system_error(EAGAIN, std::generic_category(),
                                  "thread creation disabled by a test");
        }
        std::thread([this] { serve(); }).detach();
        ++workers_;
      } catch (...) {
        break;  // e.g. EAGAIN at the thread limit: this region runs with the workers there are
      }
    }
    return std::min(workers_, wanted);
  }

  // Claims and runs parts of `region` until none is left unclaimed. Called with the lock held;
  // returns with it held.
  void work_on(Region& region, std::unique_lock<std::mutex>& lock) {
    while (region.next < region.parts) {
      const size_t part = region.next++;
      if (region.next == region.parts) unlist(region);
      lock.unlock();
      std::exception_ptr error;
      try {
        (*region.task)(part);
      } catch (...) {
        error = std::current_exception();
      }
      lock.lock();
      if (error && part < region.failed_part) {
        region.failed_part = part;
        region.error = error;
      }
      // Once this reaches 0 the caller may return and destroy `region`: it is not touched again
      // after the lock is released (the loop test below still holds the lock).
      if (--region.unfinished == 0) region.finished.notify_all();
    }
  }

  void unlist(Region& region) {
    if (!region.listed) return;
    region.listed = false;
    open_.erase(std::find(open_.begin(), open_.end(), &region));
    listed_.fetch_sub(1, std::memory_order_release);
  }

  void serve() {
    std::unique_lock<std::mutex> lock(mutex_);
    for (;;) {
      if (open_.empty() && spin_.count() > 0) {
        lock.unlock();
        const auto until = std::chrono::steady_clock::now() + spin_;
        while (listed_.load(std::memory_order_acquire) == 0 &&
               std::chrono::steady_clock::now() < until) {
          std::this_thread::yield();
        }
        lock.lock();
      }
      wake_.wait(lock, [&] { return !open_.empty(); });
      Region& region = *open_.front();
      if (--region.seats == 0) unlist(region);
      work_on(region, lock);
    }
  }

  const std::chrono::microseconds spin_;
  std::mutex mutex_;
  std::condition_variable wake_;
  std::vector<Region*> open_;   // regions workers may join, oldest first
  std::atomic<int> listed_{0};  // open_.size(), readable without the lock (spinning workers)
  int workers_ = 0;
};

// The process's pool, created on first use. A forked child has none of the parent's workers, so
// the child forgets the parent's pool (leaked: its mutex may be held by a thread that does not
// exist in the child) and creates its own when it needs one.
std::atomic<Pool*> g_pool{nullptr};
std::mutex g_pool_creation;

void before_fork() { g_pool_creation.lock(); }
void after_fork_in_parent() { g_pool_creation.unlock(); }
void after_fork_in_child() {
  g_pool.store(nullptr, std::memory_order_relaxed);
  g_pool_creation.unlock();
}

Pool& pool() {
  Pool* existing = g_pool.load(std::memory_order_acquire);
  if (existing != nullptr) return *existing;
  std::lock_guard<std::mutex> lock(g_pool_creation);
  existing = g_pool.load(std::memory_order_relaxed);
  if (existing == nullptr) {
    static const int registered =
        pthread_atfork(before_fork, after_fork_in_parent, after_fork_in_child);
    (void)registered;  // without the handlers a forked child would wait on absent workers
    existing = new Pool();  // never destroyed: detached workers use it until the process exits
    g_pool.store(existing, std::memory_order_release);
  }
  return *existing;
}

int affinity_cpus() {
#ifdef __linux__
  // A CPU set large enough for the machine (EINVAL: too small for the kernel's mask).
  for (int count = 1024; count <= (1 << 22); count *= 4) {
    cpu_set_t* set = CPU_ALLOC(static_cast<size_t>(count));
    if (set == nullptr) break;
    const size_t size = CPU_ALLOC_SIZE(static_cast<size_t>(count));
    const int status = sched_getaffinity(0, size, set);
    const int cpus = status == 0 ? CPU_COUNT_S(size, set) : 0;
    const int error = errno;
    CPU_FREE(set);
    if (status == 0) return std::max(cpus, 1);
    if (error != EINVAL) break;
  }
#endif
  return static_cast<int>(std::max(1U, std::thread::hardware_concurrency()));
}

std::optional<std::string> read_text(const std::string& path) {
  std::ifstream in(path);
  if (!in) return std::nullopt;
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

std::vector<std::string> split(const std::string& text, char separator) {
  std::vector<std::string> fields;
  std::string field;
  std::istringstream stream(text);
  while (std::getline(stream, field, separator)) fields.push_back(field);
  return fields;
}

// The directory of this process's cgroup in the hierarchy that holds the cpu controller, and
// that hierarchy's mount point (both under `root`), or nothing. v1 wins when the cpu controller
// is mounted there (hybrid systems also list a v2 "0::" line).
struct CgroupDirectory {
  std::string leaf;
  std::string mount;
  bool v2 = false;
};

std::optional<CgroupDirectory> find_cgroup(const std::string& root) {
  const auto cgroups = read_text(root + "/proc/self/cgroup");
  const auto mounts = read_text(root + "/proc/self/mountinfo");
  if (!cgroups || !mounts) return std::nullopt;
  std::optional<std::string> v1_path, v2_path;
  for (const std::string& line : split(*cgroups, '\n')) {
    // hierarchy-id:controller-list:path
    const size_t first = line.find(':');
    const size_t second = first == std::string::npos ? first : line.find(':', first + 1);
    if (second == std::string::npos) continue;
    const std::string controllers = line.substr(first + 1, second - first - 1);
    const std::string path = line.substr(second + 1);
    if (line.compare(0, first, "0") == 0 && controllers.empty()) {
      v2_path = path;
    } else {
      for (const std::string& controller : split(controllers, ',')) {
        if (controller == "cpu") v1_path = path;
      }
    }
  }
  for (const bool v2 : {false, true}) {
    const std::optional<std::string>& path = v2 ? v2_path : v1_path;
    if (!path) continue;
    // mountinfo: id parent major:minor root mount-point options [optional...] - fstype source
    // super-options
    for (const std::string& line : split(*mounts, '\n')) {
      const std::vector<std::string> fields = split(line, ' ');
      const auto dash = std::find(fields.begin(), fields.end(), "-");
      if (fields.size() < 5 || dash == fields.end() || fields.end() - dash < 4) continue;
      const std::string& type = *(dash + 1);
      bool matches = v2 ? type == "cgroup2" : false;
      if (!v2 && type == "cgroup") {
        for (const std::string& option : split(*(dash + 3), ',')) matches |= option == "cpu";
      }
      if (!matches) continue;
      const std::string& mount_root = fields[3];
      std::string relative = *path;
      if (mount_root != "/" && relative.compare(0, mount_root.size(), mount_root) == 0) {
        relative = relative.substr(mount_root.size());
      }
      if (relative == "/") relative.clear();
      const std::string mount = root + fields[4];
      return CgroupDirectory{mount + relative, mount, v2};
    }
  }
  return std::nullopt;
}

// The limit one cgroup directory sets, in CPUs, if any.
std::optional<double> directory_limit(const std::string& directory, bool v2) {
  if (v2) {
    const auto text = read_text(directory + "/cpu.max");  // "max 100000" or "150000 100000"
    if (!text) return std::nullopt;
    std::istringstream fields(*text);
    std::string quota;
    double period = 0;
    if (!(fields >> quota >> period) || quota == "max" || !(period > 0)) return std::nullopt;
    const double value = std::strtod(quota.c_str(), nullptr);
    if (!(value > 0)) return std::nullopt;
    return value / period;
  }
  const auto quota_text = read_text(directory + "/cpu.cfs_quota_us");  // -1: none
  const auto period_text = read_text(directory + "/cpu.cfs_period_us");
  if (!quota_text || !period_text) return std::nullopt;
  const double quota = std::strtod(quota_text->c_str(), nullptr);
  const double period = std::strtod(period_text->c_str(), nullptr);
  if (!(quota > 0) || !(period > 0)) return std::nullopt;
  return quota / period;
}

}  // namespace

std::optional<double> cgroup_cpu_limit(const std::string& root) {
  const auto cgroup = find_cgroup(root);
  if (!cgroup) return std::nullopt;
  // A cgroup is bound by its own quota and by every ancestor's, up to the mount point.
  std::optional<double> limit;
  std::string directory = cgroup->leaf;
  for (;;) {
    const auto own = directory_limit(directory, cgroup->v2);
    if (own && (!limit || *own < *limit)) limit = own;
    if (directory.size() <= cgroup->mount.size()) break;
    const size_t slash = directory.rfind('/');
    if (slash == std::string::npos || slash < cgroup->mount.size()) break;
    directory.resize(slash);
  }
  return limit;
}

int available_cpus() {
  // The quota of a process's cgroup does not change under it in practice: read once.
  static const std::optional<double> quota = cgroup_cpu_limit("");
  int cpus = affinity_cpus();
  if (quota) cpus = std::min(cpus, std::max(1, static_cast<int>(std::ceil(*quota))));
  return cpus;
}

int usable_threads(int requested) {
  const int available = available_cpus();
  if (requested <= 0) return available;
  return std::min(requested, available);
}

void parallel_for(size_t parts, int threads, const std::function<void(size_t)>& task) {
  if (parts == 0) return;
  int wanted = threads;
  if (wanted > 1 || wanted <= 0) {
    if (wanted <= 0 || static_cast<size_t>(wanted) > parts) {
      wanted = static_cast<int>(std::min<size_t>(parts, 1 << 16));
    }
    wanted = usable_threads(wanted);
  }
  if (wanted <= 1) {
    for (size_t part = 0; part < parts; ++part) task(part);
    return;
  }
  pool().run(parts, wanted, task);
}

namespace pool_testing {

int workers() {
  Pool* existing = g_pool.load(std::memory_order_acquire);
  return existing == nullptr ? 0 : existing->workers();
}

void fail_thread_creation(bool fail) { g_fail_thread_creation.store(fail); }

}  // namespace pool_testing

}  // namespace tokenmill
