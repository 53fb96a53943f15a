"""Timing Relax VM functions on a shared CPU: a pause until the process is quiet before each
timing, and timers that average enough calls to last a given time. Used by the benchmark and by
tuning-log export, which times whole modules with and without their records."""

from __future__ import annotations

import resource
import time

import tvm
from tvm import relax

__all__ = ["QUIET_MS", "SETTLE_MAX_MS", "SETTLE_MS", "calibrated_timer", "process_cpu_seconds", "settle", "vm_runner"]

# Pause before each timing. PyTorch's OpenMP workers and TVM's thread pool keep spinning for a while
# after a parallel call; on 2 cores a kernel timed right after the other runtime shares the CPUs
# with them (group norm backward: 1.7-2.0 ms right after torch, 0.9-1.0 ms after a 50 ms pause).
# The order is shuffled per round as well (seeded), so that no variant always follows the same one.
SETTLE_MS = 100.0
# The pause lasts at least SETTLE_MS and until the process has used no CPU for QUIET_MS (at most
# SETTLE_MAX_MS): TVM's pool keeps a core busy for 150-180 ms after its last call (its workers
# yield in a loop for TVM_THREAD_POOL_SPIN_COUNT rounds), PyTorch's OpenMP for about 10 ms. With a
# fixed 100 ms pause a PyTorch timing after a TVM one ran beside the spinning worker: PyTorch's
# cumsum backward took 17-33 ms per call 100 ms after TVM calls and 0.6-1.2 ms 10 or 500 ms after,
# and read 23 ms in two full runs (0.26-0.29 ms with the pause lasting until the process is quiet).
QUIET_MS = 20.0
SETTLE_MAX_MS = 1000.0


def process_cpu_seconds() -> float:
    """CPU time used by every thread of this process so far."""
    u = resource.getrusage(resource.RUSAGE_SELF)
    return u.ru_utime + u.ru_stime


def settle(min_ms: float = SETTLE_MS, quiet_ms: float = QUIET_MS, max_ms: float = SETTLE_MAX_MS, *,
           clock=time.perf_counter, cpu_seconds=process_cpu_seconds, sleep=time.sleep) -> float:
    """Sleep at least ``min_ms``, then until this process's threads have used (almost) no CPU time
    for ``quiet_ms`` (no more than ``max_ms`` in all); returns the milliseconds slept. ``clock``,
    ``cpu_seconds`` and ``sleep`` are where the time comes from (seconds each)."""
    start = clock()
    sleep(min_ms / 1e3)
    step = quiet_ms / 4e3
    quiet_since, last = clock(), cpu_seconds()
    while (now := clock()) - start < max_ms / 1e3:
        if now - quiet_since >= quiet_ms / 1e3:
            break
        sleep(step)
        used = cpu_seconds()
        if used - last > 0.1 * step:  # busy for more than a tenth of the step: not quiet yet
            quiet_since = clock()
        last = used
    return (clock() - start) * 1e3


def calibrated_timer(run, min_ms: float):
    """A timer of ``run``: calls per timing chosen once so that one timing lasts >= ``min_ms``,
    from the fastest of a few calls (a single call could be a slow outlier: then a timing made
    of too few calls, each paying the wake-up after the pause before it; the kernel calibrated
    first read 1.2-2x slower than the same kernel built twice, on the 0.06 ms ones)."""
    run()  # warm up (first-call allocations, thread pool start)
    calls = []
    for _ in range(3):
        t0 = time.perf_counter()
        run()
        calls.append(time.perf_counter() - t0)
    number = max(1, int(min_ms / 1e3 / max(min(calls), 1e-9)))

    def timer() -> float:
        if number > 1:  # one untimed call first: it pays for waking the thread pool after the pause
            run()
        t = time.perf_counter()
        for _ in range(number):
            run()
        return (time.perf_counter() - t) / number * 1e3

    return timer


def vm_runner(ex, args):
    main = relax.VirtualMachine(ex, tvm.cpu())["main"]
    return lambda: main(*args)
