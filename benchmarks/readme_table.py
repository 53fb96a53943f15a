"""The benchmark tables, made from the results of ``rlx-tvm bench --json`` (the kernel suite) and
``rlx-tvm bench --steps --json`` (training steps) in ``benchmarks/results/*.json``.

    python benchmarks/readme_table.py                    # print the tables
    python benchmarks/readme_table.py --write README.md  # replace them between a file's markers

The training-step table goes between ``<!-- steps:begin -->`` and ``<!-- steps:end -->``: one row
per model and CPU, rlx_tvm's step, PyTorch eager's, their ratio, rlx_tvm's GFLOP/s and the
slowest kernel of the step with its share. The kernel table goes between the ``results`` markers:

One row per kernel; for each results file (one per CPU), rlx_tvm's time (the ``tuned`` build:
``rlx_tvm.compile`` with the committed tuning log of that CPU, default schedules where it has no
record), PyTorch eager's, their ratio (below 1: rlx_tvm is faster) and the kernel's rate
(GB/s with its share of the copy bandwidth measured in the same rounds, or GFLOP/s). A file this
script does not recognise is skipped with a message on stderr. Standard library only.
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import sys

BEGIN = "<!-- results:begin -->"
END = "<!-- results:end -->"
STEPS_BEGIN = "<!-- steps:begin -->"
STEPS_END = "<!-- steps:end -->"
RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


class ResultsError(ValueError):
    """A results file without the structure ``rlx-tvm bench --json`` writes."""


def load_results(path: str) -> dict:
    """The parsed results file at ``path``; :class:`ResultsError` when it is not a bench result."""
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError) as err:
        raise ResultsError(f"cannot read it as JSON ({err})") from err
    if not isinstance(data, dict) or not isinstance(data.get("kernels"), list):
        raise ResultsError("expected an object with a 'kernels' list")
    kernels = [k for k in data["kernels"] if isinstance(k, dict) and isinstance(k.get("name"), str)
               and isinstance(k.get("ms"), dict)]
    if not kernels:
        raise ResultsError("no kernel entry with a 'name' and an 'ms' object")
    return {**data, "kernels": kernels}


def cpu_label(path: str, data: dict) -> str:
    """A short name for the CPU of a results file: the target's ``mcpu``, else the file's name."""
    try:
        mcpu = json.loads(data.get("target", "")).get("mcpu")
    except (ValueError, AttributeError):
        mcpu = None
    return str(mcpu) if mcpu else os.path.splitext(os.path.basename(path))[0]


def _number(value) -> float | None:
    return float(value) if isinstance(value, (int, float)) and math.isfinite(value) and value > 0 else None


def _ms(kernel: dict, variant: str) -> float | None:
    return _number(kernel["ms"].get(variant))


def _rate(kernel: dict) -> str:
    rate = kernel.get("rate")
    if not (isinstance(rate, list) and len(rate) == 2 and _number(rate[0])):
        return "-"
    value, unit = float(rate[0]), str(rate[1])
    copy = _number(kernel.get("copy_gbps"))
    if unit == "GB/s" and copy:
        return f"{value:.1f} GB/s ({100 * value / copy:.0f}%)"
    return f"{value:.1f} {unit}"


def _cells(kernel: dict | None) -> list[str]:
    if kernel is None:
        return ["-"] * 4
    ours, torch = _ms(kernel, "tuned") or _ms(kernel, "default"), _ms(kernel, "torch")
    ratio = f"{ours / torch:.2f}" if ours and torch else "-"
    return [f"{ours:.2f}" if ours else "-", f"{torch:.2f}" if torch else "-", ratio, _rate(kernel)]


def _geomean_ratio(data: dict) -> str:
    ratios = []
    for kernel in data["kernels"]:
        ours, torch = _ms(kernel, "tuned") or _ms(kernel, "default"), _ms(kernel, "torch")
        if ours and torch:
            ratios.append(ours / torch)
    return f"**{math.exp(sum(map(math.log, ratios)) / len(ratios)):.2f}**" if ratios else "-"


def table(results: list[tuple[str, dict]]) -> str:
    """One Markdown table over every results file: (label, data) pairs, in the given order."""
    head, align = ["kernel"], ["---"]
    for label, _ in results:
        head += [f"{label} rlx_tvm ms", f"{label} PyTorch ms", f"{label} ratio", f"{label} rate"]
        align += ["---:", "---:", "---:", "---:"]
    names: list[str] = []
    for _, data in results:
        names += [k["name"] for k in data["kernels"] if k["name"] not in names]
    by_name = [{k["name"]: k for k in data["kernels"]} for _, data in results]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join(align) + "|"]
    for name in names:
        cells = [f"`{name}`"]
        for kernels in by_name:
            cells += _cells(kernels.get(name))
        lines.append("| " + " | ".join(cells) + " |")
    footer = ["geomean"]
    for _, data in results:
        footer += ["", "", _geomean_ratio(data), ""]
    lines.append("| " + " | ".join(footer) + " |")
    return "\n".join(lines)


def collect(directory: str, out=sys.stderr) -> tuple[list[tuple[str, dict]], list[dict]]:
    """Every recognised results file under ``directory``: kernel-suite results labelled by CPU, and
    training-step results; others are reported on ``out``."""
    results, steps = [], []
    for path in sorted(glob.glob(os.path.join(directory, "*.json")), reverse=True):  # newest CPU first by name
        try:
            with open(path) as f:
                raw = json.load(f)
        except (OSError, ValueError):
            raw = None
        if isinstance(raw, dict) and raw.get("kind") == "training_steps" and isinstance(raw.get("models"), list):
            steps.append(raw)
            continue
        try:
            data = load_results(path)
        except ResultsError as err:
            print(f"readme_table: skipping {path}: {err}", file=out)
            continue
        results.append((cpu_label(path, data), data))
    return results, steps


def steps_table(steps: list[dict]) -> str:
    """The training-step table of ``rlx-tvm bench --steps --json`` results."""
    lines = ["| model | CPU | rlx_tvm ms | PyTorch ms | ratio | rlx_tvm GFLOP/s | slowest kernel (share of the step) |",
             "|---|---|---:|---:|---:|---:|---|"]
    for data in steps:
        cpu = str(data.get("target", "?"))
        ratios = []
        for m in data["models"]:
            if not isinstance(m, dict) or "error" in m or not _number(m.get("rlx_tvm")) or not _number(m.get("torch")):
                lines.append(f"| {m.get('model', '?') if isinstance(m, dict) else '?'} | {cpu} | failed |  |  |  |  |")
                continue
            ratio = m["rlx_tvm"] / m["torch"]
            ratios.append(ratio)
            gflops = f"{m['gflop'] / m['rlx_tvm'] * 1e3:.1f}" if _number(m.get("gflop")) else ""
            kernels = [k for k in m.get("kernels", []) if isinstance(k, dict) and _number(k.get("ms"))]
            top = max(kernels, key=lambda k: k["ms"], default=None)
            slowest = f"`{top['kernel']}` ({top['ms'] / m['rlx_tvm']:.0%})" if top else ""
            lines.append(f"| {m['model']} | {cpu} | {m['rlx_tvm']:.1f} | {m['torch']:.1f} | {ratio:.2f} | {gflops} "
                         f"| {slowest} |")
        if ratios:
            geomean = math.exp(sum(math.log(r) for r in ratios) / len(ratios))
            lines.append(f"| geomean | {cpu} |  |  | **{geomean:.2f}** |  |  |")
    return "\n".join(lines)


def replace_between_markers(text: str, body: str, begin: str = BEGIN, end: str = END) -> str:
    """``text`` with everything between the markers ``begin`` and ``end`` replaced by ``body``."""
    start, stop = text.find(begin), text.find(end)
    if start < 0 or stop < start:
        raise ValueError(f"readme_table: expected the markers {begin} and {end}, in that order")
    return text[:start + len(begin)] + "\n" + body + "\n" + text[stop:]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--results", default=RESULTS, help="directory of rlx-tvm bench --json files")
    parser.add_argument("--write", metavar="FILE", action="append",
                        help="replace the tables between this file's markers (repeatable)")
    args = parser.parse_args(argv)
    results, steps = collect(args.results)
    if not results and not steps:
        print(f"readme_table: no results file under {args.results}", file=sys.stderr)
        return 1
    bodies = {}
    if steps:
        bodies[(STEPS_BEGIN, STEPS_END)] = steps_table(steps)
    if results:
        bodies[(BEGIN, END)] = table(results)
    if not args.write:
        print("\n\n".join(bodies.values()))
        return 0
    for path in args.write:
        with open(path) as f:
            text = f.read()
        found = [(markers, body) for markers, body in bodies.items() if markers[0] in text]
        if not found:
            print(f"readme_table: {path} has none of the markers {STEPS_BEGIN}, {BEGIN}", file=sys.stderr)
            return 1
        for (begin, end), body in found:
            try:
                text = replace_between_markers(text, body, begin, end)
            except ValueError as err:
                print(err, file=sys.stderr)
                return 1
        with open(path, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
