"""How many threads the CPU kernels that rlx_tvm builds run on.

TVM's CPU thread pool, unless ``TVM_NUM_THREADS`` or ``OMP_NUM_THREADS`` says otherwise, runs half
of the hardware threads on x86, assuming two hyper-threads per core: on the 2-vCPU machines this
project is measured on (one thread per core) every parallel kernel ran on one core, half the speed
the benchmark reports. ``import rlx_tvm`` sets ``TVM_NUM_THREADS`` to the CPUs this process may run
on when neither variable is set; the pool reads it when it starts, at the first parallel kernel
(a process that ran one before importing rlx_tvm keeps TVM's count).
"""

from __future__ import annotations

import functools
import os

__all__ = ["cpu_threads", "default_tvm_threads"]


@functools.cache
def cpu_threads() -> int:
    """The CPUs this process may run on (its affinity mask: taskset, cgroup cpusets), else the CPU
    count. Taken once, at ``import rlx_tvm``: a TVM thread pool of one thread pins the thread that
    starts it to one CPU (seen with TVM's default on 2 vCPUs), after which the mask says 1."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):  # no affinity masks on this OS
        return os.cpu_count() or 1


def default_tvm_threads() -> None:
    """``TVM_NUM_THREADS`` = :func:`cpu_threads`, unless it or ``OMP_NUM_THREADS`` is set."""
    if "TVM_NUM_THREADS" not in os.environ and "OMP_NUM_THREADS" not in os.environ:
        os.environ["TVM_NUM_THREADS"] = str(cpu_threads())
