"""What the ``rlx-tvm`` commands share: target and kernel arguments, plain-text tables."""

from __future__ import annotations

import tvm

from ..bench.suite import suite_kernel
from ..target import cpu_target

__all__ = ["KERNELS_HELP", "TARGET_HELP", "host_target", "kernel_names", "print_table", "us"]

TARGET_HELP = ("TVM target; 'local' (default) is this machine's CPU with explicit mcpu and core count, "
               "which is what the committed tuning logs are keyed by")
KERNELS_HELP = "comma-separated suite kernels (default: all; see rlx_tvm/bench/suite.py)"


def host_target(arg: str | None) -> tvm.target.Target:
    """``--target``: ``local`` (or none) is this CPU, anything else a TVM target string or JSON."""
    return cpu_target() if arg in (None, "local") else tvm.target.Target(arg)


def kernel_names(arg: str | None) -> list[str] | None:
    """``--kernels a,b``: the names, each checked against the suite (None: all)."""
    if not arg:
        return None
    names = [n.strip() for n in arg.split(",") if n.strip()]
    for n in names:
        try:
            suite_kernel(n)
        except KeyError as err:
            raise SystemExit(f"rlx-tvm: {err.args[0]}") from None
    return names


def print_table(head, rows) -> None:
    widths = [max(len(str(r[i])) for r in [head, *rows]) for i in range(len(head))]
    for r in [head, ["-" * w for w in widths], *rows]:
        print("  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip())


def us(x: float | None) -> str:
    """Microseconds for a table cell (``-``: none)."""
    return "-" if x is None else f"{x:.1f}"
