// The one thread pool every kernel uses (gather, blending, packing, token scan, index build).
//
// parallel_for(parts, threads, task) runs task(0), ..., task(parts - 1) and returns when every
// part has finished. The caller takes parts itself; up to `threads - 1` pool workers join it.
// Parts are claimed one at a time from a shared counter, so a worker that wakes late only takes
// what is left, and a region whose workers never come (thread creation failed, every worker
// busy) is finished by the caller alone: the result never depends on how many threads ran.
//
// Guarantees:
//  * Exceptions cross back: every part runs inside try/catch; after all parts finished, the
//    exception of the lowest-numbered failing part is rethrown on the caller (std::bad_alloc in
//    a worker becomes a MemoryError in Python, never std::terminate).
//  * Thread-creation failure degrades to fewer threads, down to the caller alone (serial).
//  * The thread count honours the request, the process's CPU affinity (sched_getaffinity) and
//    its cgroup CPU quota (v2 cpu.max, v1 cpu.cfs_quota_us / cpu.cfs_period_us): see
//    usable_threads().
//  * Nested regions are safe (a part may call parallel_for): a caller never waits for a part
//    nobody has started, so no region can wait on itself.
//  * Idle workers sleep on a condition variable. Spinning before sleeping is opt-in and bounded:
//    TOKENMILL_POOL_SPIN_US (microseconds, at most 1000; default 0) read once per process.
//  * fork(): the child forgets the parent's pool (its workers do not exist there) and starts its
//    own on first use.
//
// Workers start on demand, at most usable_threads(...) - 1, and live until the process exits
// (they are detached: joining them at exit could deadlock with a still-running region).
// Cost: a region without workers is a plain loop; with workers, one mutex round trip per part
// plus one wake-up per worker (a futex syscall, tens of microseconds on a VM when it sleeps).
#pragma once

#include <cstddef>
#include <functional>
#include <optional>
#include <string>

namespace tokenmill {

// Runs task(0..parts-1) on at most `threads` threads (the caller included); see above.
void parallel_for(size_t parts, int threads, const std::function<void(size_t)>& task);

// The CPUs this process may use: the size of its affinity mask, capped by its cgroup CPU quota
// (rounded up), at least 1.
int available_cpus();

// Threads a region asking for `requested` gets: min(requested, available_cpus()), at least 1.
// requested <= 0 means "as many as available".
int usable_threads(int requested);

// The cgroup CPU limit in CPUs (quota / period, the smallest along the cgroup's ancestors), or
// nothing when there is none. `root` prefixes every path read (/proc/self/cgroup,
// /proc/self/mountinfo and the cgroup files); "" for the real system, a directory for tests.
std::optional<double> cgroup_cpu_limit(const std::string& root);

// Introspection and fault injection for tests (tokenmill._core._testing).
namespace pool_testing {
// Worker threads this process's pool has started.
int workers();
// While true, starting a worker thread fails as if the system refused (std::system_error).
void fail_thread_creation(bool fail);
}  // namespace pool_testing

}  // namespace tokenmill
