// Parallel parts on persistent helper threads: a large batch gather split over the cores without
// paying a thread start per call (tens of microseconds here, as much as gathering 1 MiB).
#pragma once

#include <cstddef>
#include <functional>

namespace tokenmill {

// Runs task(0), ..., task(parts - 1) and returns when all are done. The caller runs parts too;
// the others go to helper threads started on first use and kept for the life of the process (at
// most the CPU count minus one). One parallel region runs at a time: a caller that finds another
// region running, or a process forked after the helpers started, runs every part itself (the
// cores are busy anyway, and a fork has no helpers). The first exception a part throws is
// rethrown here after every part finished.
void run_parts(size_t parts, const std::function<void(size_t)>& task);

}  // namespace tokenmill
