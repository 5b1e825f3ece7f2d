// Reads of a mapped file that survive the file shrinking underneath them.
//
// A page of a MAP_SHARED file mapping that lies wholly past the file's end (another process
// truncated the .bin while a dataset had it mapped) raises SIGBUS when touched, which kills the
// process. Inside guard_mapped_reads(body), a SIGBUS on the calling thread instead abandons
// `body` (siglongjmp back to the guard) and throws MappedReadFault; the bindings turn it into a
// Python exception that the dataset names the shrunk file in. Outside a guard the handler passes
// the signal on to whatever handler was installed before (faulthandler, torch's DataLoader
// worker handler, or the default action), so other faults behave as before.
//
// Rules for a body (a siglongjmp must not skip a non-trivial destructor): every automatic
// object in the frames it runs must be trivially destructible. Keep allocating scratch state
// outside the guard. Exceptions thrown by the body pass through the guard normally.
//
// Cost: one sigsetjmp without saving the signal mask (a few ns) per guarded call; the handler
// is installed on the first guard of each process (after a fork too, so a DataLoader worker,
// whose start-up installs torch's handler, chains to that one).
//
// A shrink that leaves a partial last page is not a SIGBUS: the bytes of that page past the new
// end read as zeros. probe_next_page touches the page after a read, which faults if the read
// ended in such a partial page, unless that page is the last one of the mapping (the cut lies in
// the file's last page): that one case reads zeros undetected.
#pragma once

#include <csetjmp>
#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>

namespace tokenmill {

class MappedReadFault : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

namespace fault_guard_detail {

struct GuardState {
  sigjmp_buf* jump = nullptr;
  uintptr_t address = 0;  // the faulting address of the last abandoned body
};

GuardState& state();
void install_handler();  // idempotent per process
size_t page_size();
[[noreturn]] void throw_fault(uintptr_t address);

}  // namespace fault_guard_detail

template <typename Body>
void guard_mapped_reads(Body&& body) {
  using namespace fault_guard_detail;
  install_handler();
  GuardState& guard = state();
  sigjmp_buf* const previous = guard.jump;
  sigjmp_buf jump;
  if (sigsetjmp(jump, 0) != 0) {  // the handler jumped back: the body was abandoned
    guard.jump = previous;
    throw_fault(guard.address);
  }
  guard.jump = &jump;
  try {
    body();
  } catch (...) {
    guard.jump = previous;
    throw;
  }
  guard.jump = previous;
}

// Touch the first byte of the page after the one holding `last` if that page lies before `end`
// (both inside one mapping): a read that ended in the partial page of a shrunk file then faults
// instead of having read zeros. Call inside a guard.
inline void probe_next_page(const void* last, const void* end) {
  const size_t page = fault_guard_detail::page_size();
  const uintptr_t next = (reinterpret_cast<uintptr_t>(last) & ~(uintptr_t{page} - 1)) + page;
  if (next < reinterpret_cast<uintptr_t>(end)) {
    (void)*reinterpret_cast<const volatile unsigned char*>(next);
  }
}

}  // namespace tokenmill
