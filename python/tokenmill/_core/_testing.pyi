"""Typed stub of tokenmill._core._testing: entry points only tests use (forced kernels, fault
injection, introspection of the thread pool and the CPU dispatch)."""

import numpy as np
import numpy.typing as npt

def build_sample_index(
    sizes: npt.NDArray[np.int32],
    document_index: npt.NDArray[np.int32],
    sequence_length: int,
    extra_token: int,
    sample_index: npt.NDArray[np.integer],
    num_threads: int = 1,
) -> None: ...
def build_blending_indices(
    weights: npt.NDArray[np.float64],
    dataset_index: npt.NDArray[np.integer],
    dataset_sample_index: npt.NDArray[np.int64],
    *,
    path: str = "auto",
    window: int = 0,
    margin: float = -1.0,
    block: int = 0,
    threads: int = 0,
    guess_zero: bool = False,
) -> None: ...
def build_exhaustive_blending_indices(
    sizes: npt.NDArray[np.int64],
    dataset_index: npt.NDArray[np.integer],
    dataset_sample_index: npt.NDArray[np.int64],
    *,
    path: str = "auto",
    window: int = 0,
    margin: float = -1.0,
    block: int = 0,
    threads: int = 0,
    guess_zero: bool = False,
) -> None: ...
def active_set_isa(path: str = "auto") -> str: ...
def philox_block(
    counter: tuple[int, int, int, int] | list[int], key: tuple[int, int] | list[int]
) -> tuple[int, int, int, int]: ...
def available_cpus() -> int: ...
def usable_threads(requested: int) -> int: ...
def pool_workers() -> int: ...
def fail_thread_creation(fail: bool) -> None: ...
def cgroup_cpu_limit(root: str) -> float | None: ...
def run_parts(parts: int, threads: int) -> list[int]: ...
def throw_in_worker(kind: str) -> None: ...
