"""Hand-written TensorIR kernels and what kernels share with the schedules.

Below the op families: :mod:`.annotations` (block annotations the schedules honour), :mod:`.llvm`
(LLVM intrinsics for CPU kernels), :mod:`.strategy` (per-op choice of a kernel by target) and
``cpu/<family>.py`` (the CPU kernels the op families' legalizations pick through it).
"""
