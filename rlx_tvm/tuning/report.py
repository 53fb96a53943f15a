"""The record of the run that wrote a tuning log, kept beside it: ``TUNING.json`` holds it, and
``TUNING.md`` is rendered from it for people. Per task the records in the work database (every
trial of every run that tuned it), per kernel whether the log keeps its best record, and per
module the build with and without its records. A run that tunes some kernels only keeps the task
rows of the others from the record an earlier run left."""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field

__all__ = ["EARLIER", "EXPORT_HEAD", "MODULE_HEAD", "REPORT_JSON", "REPORT_MARKDOWN", "TASK_HEAD", "TuningReport",
           "read_report", "render_markdown", "with_earlier_tasks", "write_report"]

REPORT_JSON = "TUNING.json"
REPORT_MARKDOWN = "TUNING.md"
TASK_HEAD = ["suite kernel", "task", "records", "best us", "status"]
EXPORT_HEAD = ["kernel stages", "tuned us", "default us", "in the log"]
MODULE_HEAD = ["suite kernel", "records", "with them ms", "without ms", "records kept"]
EARLIER = "earlier run: "  # status prefix of a task row carried over from an earlier run's record


@dataclass
class TuningReport:
    key: str  # the target key the log is for
    target: str
    date: str  # ISO date of the run
    method: str  # how the records were found (search budget, or a round measured on a device)
    faster: str  # what export asked of a record to keep it, e.g. "5% faster"
    keep_all: bool = False  # export kept every best record without timing it
    time_budget: float | None = None  # seconds, when the run had a budget
    note: str | None = None  # a remark shown above the tables
    tasks: list[list] = field(default_factory=list)  # rows of TASK_HEAD
    export: list[list] = field(default_factory=list)  # rows of EXPORT_HEAD
    modules: list[list] = field(default_factory=list)  # rows of MODULE_HEAD


def read_report(log_dir: str) -> TuningReport | None:
    """The record beside the log in ``log_dir``, or None when there is none."""
    path = os.path.join(log_dir, REPORT_JSON)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return TuningReport(**json.load(f))


def write_report(log_dir: str, report: TuningReport) -> None:
    """``report`` into ``log_dir`` as ``TUNING.json`` and, rendered, ``TUNING.md``."""
    os.makedirs(log_dir, exist_ok=True)
    with open(os.path.join(log_dir, REPORT_JSON), "w") as f:
        json.dump(asdict(report), f, indent=1)
        f.write("\n")
    with open(os.path.join(log_dir, REPORT_MARKDOWN), "w") as f:
        f.write(render_markdown(report))


def with_earlier_tasks(rows: list, earlier: TuningReport | None, tuned_now: list[str], order: list[str]) -> list:
    """This run's task rows, plus the rows of ``earlier`` (if any) for kernels of ``order`` (the
    suite's kernel names) that this run did not take, marked as from an earlier run; in the order
    of ``order``. (The log keeps every kernel's records; its record of them should too.)"""
    kept = [] if earlier is None else [
        [*row[:4], row[4] if row[4].startswith(EARLIER) else EARLIER + row[4]]
        for row in earlier.tasks if row[0] not in tuned_now and row[0] in order]
    position = {name: i for i, name in enumerate(order)}
    return sorted([list(r) for r in rows] + kept, key=lambda r: position.get(r[0], len(position)))


def _table(head: list[str], rows: list) -> list[str]:
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    return lines + ["| " + " | ".join(str(c).replace("|", "/") for c in r) + " |" for r in rows]


def render_markdown(report: TuningReport) -> str:
    """``TUNING.md``: the run's budget, then the task, export and module tables."""
    r = report
    lines = [f"# Tuning log for {r.key}", ""]
    if r.note:
        lines += [*(f"> {line}".rstrip() for line in r.note.splitlines()), ""]
    lines += [f"Written by `rlx-tvm tune` on {r.date}, target `{r.target}`: {r.method}"
              " Records: those in the work database for the task (every run that tuned it; fewer than asked where "
              "the search ran out of distinct candidates)."
              + ("" if r.time_budget is None else
                 f" This run's time budget: {r.time_budget:g} s; a task it did not start says so, and its "
                 "records come from earlier runs.")
              + (f" Rows marked `{EARLIER.strip()}` are kernels this run did not take (`--kernels`), as an "
                 "earlier run left them." if any(str(t[4]).startswith(EARLIER) for t in r.tasks) else ""), "",
              *_table(TASK_HEAD, r.tasks), "",
              "Each kernel's best record, kept without comparing it with the default schedule (--keep-all):"
              if r.keep_all else "Each kernel's best record, against its default schedule (re-measured at export "
              "on a CPU; on a GPU, as timed beside it on the device) "
              f"(kept only when at least {r.faster}):", "", *_table(EXPORT_HEAD, r.export), ""]
    if r.modules:
        lines += ["Each suite kernel that kept records, built with them and without them and timed as a whole "
                  f"(median of 7 interleaved rounds); where it was not {r.faster} with them, they were dropped:", "",
                  *_table(MODULE_HEAD, r.modules), ""]
    return "\n".join(lines)
