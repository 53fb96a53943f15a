"""Benchmarks: the backward-kernel suite (:mod:`.suite`, PyTorch counterparts in
:mod:`.suite_torch`), ``rlx-tvm bench``'s harness (:mod:`.harness`), and device packs that time
the suite on a machine without TVM's compiler (:mod:`.device_pack`, whose timer
:mod:`.device_time` runs there with TVM's runtime alone)."""

from .harness import VARIANTS, KernelResult, format_markdown, format_table, run_bench, write_json
from .suite import SUITE, SuiteKernel, suite_ir_module, suite_kernel, suite_kernels, suite_module, suite_reference

__all__ = ["SUITE", "VARIANTS", "KernelResult", "SuiteKernel", "format_markdown", "format_table", "run_bench",
           "suite_ir_module", "suite_kernel", "suite_kernels", "suite_module", "suite_reference", "write_json"]
