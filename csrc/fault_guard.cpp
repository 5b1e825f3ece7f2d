#include "fault_guard.hpp"

#include <pthread.h>
#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <mutex>

namespace tokenmill::fault_guard_detail {
namespace {

// The default (dynamic) TLS model, not initial-exec: a module loaded late (after torch and
// others) may find no static TLS left. The handler's read allocates nothing on a thread that set
// a guard (its block exists from guard_mapped_reads); on another thread the SIGBUS is fatal anyway.
thread_local GuardState guard_state;

struct sigaction previous_action {};
std::atomic<bool> installed{false};
std::mutex install_mutex;

void forward(int signal_number, siginfo_t* info, void* context) {
  const struct sigaction& next = previous_action;
  if ((next.sa_flags & SA_SIGINFO) != 0 && next.sa_sigaction != nullptr) {
    next.sa_sigaction(signal_number, info, context);
    return;
  }
  if (next.sa_handler == SIG_DFL || next.sa_handler == SIG_IGN) {
    // the default action: returning re-runs the faulting access, which now kills the process
    signal(signal_number, SIG_DFL);
    return;
  }
  next.sa_handler(signal_number);
}

void on_sigbus(int signal_number, siginfo_t* info, void* context) {
  GuardState& guard = guard_state;
  if (guard.jump != nullptr) {
    guard.address = reinterpret_cast<uintptr_t>(info->si_addr);
    siglongjmp(*guard.jump, 1);
  }
  forward(signal_number, info, context);
}

void forked_child() { installed.store(false); }

}  // namespace

GuardState& state() { return guard_state; }

size_t page_size() {
  static const size_t size = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  return size;
}

void install_handler() {
  if (installed.load(std::memory_order_acquire)) return;
  std::lock_guard<std::mutex> lock(install_mutex);
  if (installed.load(std::memory_order_relaxed)) return;
  static std::once_flag atfork;
  std::call_once(atfork, [] { pthread_atfork(nullptr, nullptr, &forked_child); });
  struct sigaction action {};
  action.sa_sigaction = &on_sigbus;
  // SA_NODEFER: the handler leaves by siglongjmp without restoring the signal mask (sigsetjmp
  // saves none, which keeps a guard cheap), so SIGBUS must not be blocked while it runs
  action.sa_flags = SA_SIGINFO | SA_NODEFER | SA_ONSTACK;
  sigemptyset(&action.sa_mask);
  struct sigaction current {};
  if (sigaction(SIGBUS, nullptr, &current) == 0 && current.sa_sigaction == &on_sigbus) {
    installed.store(true, std::memory_order_release);  // a fork's child inherits ours
    return;
  }
  if (sigaction(SIGBUS, &action, &previous_action) == 0) {
    installed.store(true, std::memory_order_release);
  }
}

void throw_fault(uintptr_t address) {
  char text[96];
  std::snprintf(text, sizeof text, "SIGBUS reading mapped memory at 0x%llx",
                static_cast<unsigned long long>(address));
  throw MappedReadFault(text);
}

}  // namespace tokenmill::fault_guard_detail
