"""MetaSchedule tuning: the search (:mod:`.search`), rounds measured on a device without TVM's
compiler (:mod:`.device_round`), the export of a work database to the tuning log that
:func:`rlx_tvm.compile` applies (:mod:`.export`), and the record kept beside a log
(:mod:`.report`). Not imported by ``import rlx_tvm``: only tuning needs MetaSchedule's search."""

from .device_round import commit_round, device_defaults, make_round
from .export import MIN_SPEEDUP, Export, ExportRow, ExportTimer, ModuleCheck, export_log
from .search import HAND_SCHEDULED, SKIPPED, TaskResult, rpc_runner, tune, tuning_target

__all__ = ["HAND_SCHEDULED", "MIN_SPEEDUP", "SKIPPED", "Export", "ExportRow", "ExportTimer", "ModuleCheck",
           "TaskResult", "commit_round", "device_defaults", "export_log", "make_round", "rpc_runner", "tune",
           "tuning_target"]
