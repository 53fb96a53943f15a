"""Scheduling: default schedules for untuned kernels (and, later, tuning)."""

from .cpu import ParallelFallback, default_cpu_rules

__all__ = ["ParallelFallback", "default_cpu_rules"]
