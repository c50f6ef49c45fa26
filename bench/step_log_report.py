"""Where a served run's device waited for the host, step by step, from the engine's step log (`LORAD_STEP_LOG=FILE
lorad serve ...`, or `STEP_LOG=1 bash bench/serve_compare.sh ...`, which writes OUTDIR/NAME.steps.jsonl).

Each step's `wait_before_ms` (the device's time from the step before it to its forward, on the device's clock) is
put down to what kept the host (under 0.05 ms: `queued`, the step was on the device's queue): a step launched from the tokens in flight or planned ahead that still found the
device idle was launched late (the host's work for it, `host_ms` from its step() on, outlasted the step ahead of it);
a step launched after the host read the step before it waited for that reading, under the cause the step before it
was read at once (`read_at_once`: adapters streaming in, prompt chunks alone, ...) or, where that step was in flight,
because this one could not be planned ahead of it (`next_not_planned_ahead`). Printed and written (--out) by kind
with the steps' busy, forward and tokens times and their floors (the floor, and the serial floor with each step's
projections, attention and LoRA one after the other; 0 in a log from before the serial floor), so the waits can be
read against the rest; then where the host's time
before each launch went (the engine's `host_split_ms` parts, its CPU time, the collector's, the time between step()
calls and the landing of the step before), by how steps were launched and for those launched late.

    python3 bench/step_log_report.py OUTDIR/current.steps.jsonl [--out REPORT.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

LAUNCHED_LATE = "launched_late"  # a step launched before the one ahead of it landed, after the device had run out
QUEUED = "queued"  # the step was on the device's queue when the one before it ended: no wait but the events' own gap
QUEUED_MS = 0.05
UNTOLD = "after_landing_untold"  # the step before it was read at once for no cause the log names (overlap off)


def read_steps(path: Path) -> list[dict]:
    """The steps of a step log (the last run in it, when the file holds several: each begins with its header)."""
    steps: list[dict] = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            raise ValueError(f"{path}:{number}: not a JSON line ({error.msg})") from None
        if "step_log" in record:
            steps = []
        else:
            steps.append(record)
    return steps


def wait_cause(step: dict, before: dict | None) -> str:
    """Why the device waited before `step` (see the module's docstring)."""
    if step["wait_before_ms"] < QUEUED_MS:
        return QUEUED
    if step.get("origin") in ("tokens_in_flight", "planned_ahead"):
        return LAUNCHED_LATE
    if before is not None and before.get("read_at_once"):
        return before["read_at_once"]
    if step.get("origin") == "after_landing" and before is not None and before.get("origin") is not None:
        return "next_not_planned_ahead"
    return UNTOLD


HOST_KEYS = ("host_ms", "host_cpu_ms", "gc_ms", "pin_ms", "between_ms", "landing_wait_ms", "landing_take_ms")


def host_means(steps: list[dict]) -> dict:
    """The mean host times of `steps` (HOST_KEYS and each part of host_split_ms), over the steps that have each."""
    sums: dict[str, list[float]] = defaultdict(list)
    for step in steps:
        for key in HOST_KEYS:
            if step.get(key) is not None:
                sums[key].append(step[key])
        for part, value in (step.get("host_split_ms") or {}).items():
            sums[f"split.{part}"].append(value)
    return {"steps": len(steps), **{key: round(sum(values) / len(values), 3) for key, values in sums.items()}}


def report(steps: list[dict]) -> dict:
    by_kind: dict[str, dict] = defaultdict(lambda: defaultdict(float))
    waits: dict[str, dict] = defaultdict(lambda: {"steps": 0, "wait_ms": 0.0})
    by_origin: dict[str, list[dict]] = defaultdict(list)
    for index, step in enumerate(steps):
        if step.get("origin") is not None:
            by_origin[step["origin"]].append(step)
        if step.get("wait_before_ms") is not None and wait_cause(step, steps[index - 1] if index else None) == LAUNCHED_LATE:
            by_origin[LAUNCHED_LATE].append(step)
        kind = by_kind[step["kind"]]
        kind["steps"] += 1
        for key in ("busy_ms", "host_before_launch_ms", "forward_ms", "tokens_ms", "wait_before_ms", "floor_ms",
                    "serial_floor_ms"):
            kind[key] += step.get(key) or 0.0
        wait = step.get("wait_before_ms")
        if wait is None:
            continue
        cause = waits[wait_cause(step, steps[index - 1] if index else None)]
        cause["steps"] += 1
        cause["wait_ms"] += wait
    clock = any("forward_ms" in step for step in steps)
    return {"steps": len(steps), "device_clock": clock,
            "by_kind": {name: {key: round(value, 3) for key, value in totals.items()} for name, totals in by_kind.items()},
            "waits_by_cause": {cause: {"steps": entry["steps"], "wait_ms": round(entry["wait_ms"], 3),
                                       "mean_ms": round(entry["wait_ms"] / entry["steps"], 3)}
                               for cause, entry in sorted(waits.items(), key=lambda item: -item[1]["wait_ms"])},
            # where the host's time before each launch went, by how the step was launched and for those launched late
            "host_by_origin": {origin: host_means(group) for origin, group in by_origin.items()}}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("log", type=Path)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    try:
        steps = read_steps(args.log)
    except (OSError, ValueError) as error:
        print(f"step_log_report: {error}", file=sys.stderr)
        return 2
    result = report(steps)
    print(f"{args.log}: {result['steps']} steps" + ("" if result["device_clock"] else " (no device clock: no waits)"))
    print(f"{'kind':<8} {'steps':>6} {'busy s':>8} {'forward s':>9} {'tokens s':>8} {'waits s':>8} {'floor s':>8} "
          f"{'serial floor s':>14}")
    for name, totals in result["by_kind"].items():
        print(f"{name:<8} {int(totals['steps']):>6} {totals['busy_ms'] / 1e3:>8.2f} {totals['forward_ms'] / 1e3:>9.2f} "
              f"{totals['tokens_ms'] / 1e3:>8.2f} {totals['wait_before_ms'] / 1e3:>8.2f} {totals['floor_ms'] / 1e3:>8.2f} "
              f"{totals['serial_floor_ms'] / 1e3:>14.2f}")
    print("the device's waits before forwards, by what kept the host:")
    for cause, entry in result["waits_by_cause"].items():
        print(f"  {cause:<28} {entry['steps']:>6} steps {entry['wait_ms'] / 1e3:>8.3f} s  ({entry['mean_ms']:.2f} ms each)")
    if result["host_by_origin"]:
        print("the host's time before each launch, mean ms (split: from step()'s beginning, part by part):")
        for origin, means in result["host_by_origin"].items():
            print(f"  {origin:<17} {means['steps']:>6} steps " + " ".join(
                f"{key.removesuffix('_ms')}={value:.2f}" for key, value in means.items() if key != "steps"))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
