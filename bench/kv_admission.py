"""What a larger running batch does to a saturated run when the KV cache is bounded, on the CPU.

The engine's own Scheduler is replayed over a dataset's prompt and output lengths (every request waiting at
once, as `lorad bench serve --request-rate inf`; each request generates its output length, as the random-weight
daemon does) against a KV cache of the capacity the daemon reports (`kv_capacity_tokens` in /v1/status), in
blocks of one position (the 7B shape's). For each running cap, with and without the growth reserve
(`--kv-growth-reserve`, scheduler/batching.py) and each KV headroom (`--headroom`): the steps by kind, the mean
decode rows a step, the preemptions and the prompt tokens computed again, and the summed step floor from the
engine's account (step_cost.py: bytes over the HBM bandwidth or FLOPs over the GEMM rate, the rates the H100
measured at start-up). The floor is not the served time, but it moves with it: on the H100 the served busy time
has been 1.24-1.27x the decode steps' floor and 2.1x the mixed steps' (BENCHMARKS.md, figure 21.1), and
`estimated_busy_s` applies those factors. The base model alone (the adapters' bytes are a few percent of a decode
step's).

    python3 bench/kv_admission.py [--num-prompts 400] [--kv-tokens 104584] [--running 64,96,128] [--out OUT.json]
"""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path

import numpy as np
from lorad.daemon.bench.serve import choose_models
from lorad.daemon.engine.engine import PREPARE_DEPTH
from lorad.daemon.engine.step_cost import DeviceRates, SequenceInStep, StepCostModel
from lorad.daemon.model.checkpoint import MODEL_CONFIGS, ModelSpec
from lorad.scheduler.batching import PASS_STAGING, GrowthReserve, Scheduler
from step_padding import add_dataset_arguments, advance, dataset_lengths, enqueue, step_kind  # bench/, beside this script

# The H100's rates as the daemon measured them at start-up for figure 21.1 (7f7418f), and the served busy time
# over the floor by step kind in that run.
H100 = DeviceRates(2978.4e9, 783.15e12)
BUSY_OVER_FLOOR = {"decode": 1.27, "mixed": 2.09, "prefill": 2.09}


class BoundedKV:
    """KV blocks of one position out of `capacity` (the scheduler's Memory and Reservable)."""

    def __init__(self, capacity: int):
        self.free = capacity

    def grow(self, blocks: list, num_tokens: int) -> bool:
        missing = num_tokens - len(blocks)
        if missing <= 0:
            return True
        if missing > self.free:
            return False
        self.free -= missing
        blocks.extend([0] * missing)
        return True

    def release(self, blocks: list) -> None:
        self.free += len(blocks)
        blocks.clear()

    def free_tokens(self) -> int:
        return self.free

    reclaimable_tokens = free_tokens

    def missing_tokens(self, blocks: list, num_tokens: int) -> int:
        return max(0, num_tokens - len(blocks))


class Staged:
    """Adapters that stage in the background: the first request for one waits `steps` steps before it is ready,
    as a cold adapter's admission waits ~100-250 ms for the stager on the GPU while other rows run (0: every
    adapter at hand); with nothing running it is staged at once, as the engine does. `step` and `running` (whether
    any sequence runs) are the replay's."""

    def __init__(self, steps: int):
        self.steps, self.step, self.ready = steps, 0, {}
        self.running = lambda: False

    def acquire(self, name, tokens=None) -> bool:
        if name is None or not self.steps:
            return True
        if not self.running():
            self.ready.setdefault(name, self.step)
        return self.step >= self.ready.setdefault(name, self.step + self.steps)

    def release(self, name) -> None:
        pass

    def staging(self, name) -> bool:
        return name is not None and self.step < self.ready.get(name, 0)


class QueuedStaging(Staged):
    """Adapters staged as the engine's Stager does (daemon/engine/adapter_residency.py): `threads` workers, each
    adapter on one for `steps` steps, in the order they were asked for; asked for the adapters of the first
    `depth` queued requests every step (the engine's prepare) and at an admission that has to wait for one. With
    nothing running an adapter is staged at once (the engine thread stages it itself)."""

    def __init__(self, steps: int, threads: int, depth: int = PREPARE_DEPTH):
        super().__init__(steps)
        self.threads, self.depth = threads, depth
        self.asked: list[str] = []  # not started yet, first asked first
        self.working: list[int] = []  # the steps at which the busy workers finish

    def prepare(self, waiting) -> None:
        """A new step: the first queued requests' adapters are asked for, and free workers take the oldest asks."""
        for seq in itertools.islice(waiting, self.depth):
            self._ask(seq.adapter)
        self.working = [done for done in self.working if done > self.step]
        while self.asked and len(self.working) < self.threads:
            name = self.asked.pop(0)
            self.ready[name] = self.step + self.steps
            self.working.append(self.ready[name])

    def _ask(self, name) -> None:
        if name is not None and name not in self.ready and name not in self.asked:
            self.asked.append(name)

    def acquire(self, name, tokens=None) -> bool:
        if name is None or not self.steps or self.ready.get(name, self.step + 1) <= self.step:
            return True
        if not self.running():
            if name in self.asked:
                self.asked.remove(name)
            self.ready[name] = self.step
            return True
        self._ask(name)
        return False

    def staging(self, name) -> bool:
        return name is not None and (name in self.asked or self.step < self.ready.get(name, 0))


def replay(lengths: list[tuple[int, int]], kv_tokens: int, max_running: int, max_batch_tokens: int, reserve: bool,
           cost: StepCostModel, rates: DeviceRates, adapters: list[str | None] | None = None, staging_steps: int = 0,
           pass_staging: int = PASS_STAGING, stager_threads: int = 0, prepare_depth: int = PREPARE_DEPTH,
           headroom: int = 0) -> dict:
    """adapters: each request's adapter (`enqueue`). stager_threads: adapters staged by that many workers in turn
    (`QueuedStaging`), each taking staging_steps, asked for those of the first prepare_depth queued requests each
    step; 0: each adapter's first request waits staging_steps, whatever else stages (`Staged`)."""
    memory = BoundedKV(kv_tokens)
    staged = QueuedStaging(staging_steps, stager_threads, prepare_depth) if stager_threads else Staged(staging_steps)
    scheduler = Scheduler(max_running, max_batch_tokens, memory, staged, reserve=GrowthReserve() if reserve else None,
                          pass_staging=pass_staging, headroom=headroom)
    staged.running = lambda: bool(scheduler.running)
    enqueue(scheduler, lengths, adapters)
    steps = {kind: {"steps": 0, "rows": 0, "floor_s": 0.0} for kind in ("decode", "mixed", "prefill")}
    empty_slots: dict[str, int] = {}
    decode_rows = []
    prompt_rows = 0
    most_running = 0
    while scheduler.has_work():
        staged.step += 1
        if stager_threads:
            staged.prepare(scheduler.waiting)
        batch = scheduler.schedule()
        if not batch:
            raise RuntimeError("the scheduler planned an empty step with work left")
        if len(batch) < max_running:  # as the engine's account counts them (step_account.py)
            empty_slots[scheduler.stopped] = empty_slots.get(scheduler.stopped, 0) + max_running - len(batch)
        most_running = max(most_running, len(scheduler.running))
        kind = step_kind(batch)
        step_cost = cost.cost([SequenceInStep(count, seq.num_computed + count, seq.num_computed + count >= seq.num_tokens, None)
                               for seq, count in batch])
        entry = steps[kind]
        entry["steps"] += 1
        entry["rows"] += sum(count for _, count in batch)
        entry["floor_s"] += step_cost.floor_s(rates.bandwidth_bytes_per_s, rates.flops_per_s)
        decode_rows.append(sum(seq.num_computed >= seq.prompt_len for seq, _ in batch))
        prompt_rows += sum(min(count, max(0, seq.prompt_len - seq.num_computed)) for seq, count in batch)
        advance(scheduler, batch)
    floor = sum(entry["floor_s"] for entry in steps.values())
    busy = sum(BUSY_OVER_FLOOR[kind] * entry["floor_s"] for kind, entry in steps.items())
    return {"max_running_requests": max_running, "kv_growth_reserve": reserve, "headroom": headroom,
            "staging_steps": staging_steps,
            "stager_threads": stager_threads, "prepare_depth": prepare_depth if stager_threads else None,
            "pass_staging": pass_staging, "admitted_past_staging": scheduler.past_staging,
            "empty_slots_by_cause": empty_slots, "steps": steps,
            "mean_decode_rows": round(float(np.mean(decode_rows)), 1), "most_running": most_running,
            "preemptions": scheduler.preemptions, "prompt_tokens_again": prompt_rows - sum(p for p, _ in lengths),
            "floor_s": floor, "estimated_busy_s": busy, "estimated_output_tok_s": sum(o for _, o in lengths) / busy}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_dataset_arguments(parser)
    parser.add_argument("--model-config", default="llama-2-7b")
    parser.add_argument("--kv-tokens", type=int, default=104584,
                        help="the KV cache's positions (default: the 7B daemon's on the H100 in bf16; FP8 KV: 231990)")
    parser.add_argument("--kv-bytes", type=int, default=2, help="bytes of a KV element (FP8: 1)")
    parser.add_argument("--weight-bytes", type=int, default=2, help="bytes of a projection weight (FP8: 1)")
    parser.add_argument("--running", default="64,96,128", help="running caps, comma-separated")
    parser.add_argument("--max-batch-tokens", type=int, default=2048)
    parser.add_argument("--adapters", type=int, default=100, help="requests spread over N adapters (0: the base model)")
    parser.add_argument("--alpha", type=float, default=1.0, help="Zipf exponent of adapter popularity, as bench serve")
    parser.add_argument("--staging-steps", default="8",
                        help="steps an adapter's first request waits for its staging (default 8: ~140 ms of the "
                             "H100's ~17 ms decode steps; 0: adapters always at hand), comma-separated")
    parser.add_argument("--stager-threads", default="0",
                        help="adapters staged by this many workers in turn, each adapter taking --staging-steps "
                             "(0: each waits --staging-steps whatever else stages), comma-separated")
    parser.add_argument("--prepare-depth", default=str(PREPARE_DEPTH),
                        help="with a stager: the queued requests whose adapters it is asked for each step (the "
                             f"engine's PREPARE_DEPTH, {PREPARE_DEPTH}), comma-separated")
    parser.add_argument("--pass-staging", default=f"0,{PASS_STAGING}",
                        help="where adapters stage: the waiting requests an admission may pass over while theirs stage "
                             f"(0: the queue waits behind the first; the scheduler's PASS_STAGING, {PASS_STAGING}), "
                             "comma-separated")
    parser.add_argument("--reserve", choices=("both", "off", "on"), default="both", help="the growth reserve")
    parser.add_argument("--headroom", default="0",
                        help="KV positions an admission leaves free for each running sequence (the engine's "
                             "--kv-admission-headroom, 16 by default there; 0 here, as the replays in BENCHMARKS.md "
                             "were made), comma-separated")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    lengths = dataset_lengths(args)
    spec = ModelSpec.from_hf_config(MODEL_CONFIGS[args.model_config])
    cost = StepCostModel(spec, dtype_bytes=2, adapter_ranks=lambda name: {}, weight_bytes=args.weight_bytes,
                         kv_bytes=args.kv_bytes)
    listed = [{"id": "base"}] + [{"id": f"adapter-{index:04d}", "kind": "lora"} for index in range(args.adapters)]
    adapters = (None if args.adapters == 0 else
                choose_models(listed, args.adapters, args.alpha, len(lengths), np.random.default_rng(0))[0])
    staging_steps = [int(steps) for steps in args.staging_steps.split(",")]
    passing = ([int(count) for count in args.pass_staging.split(",")] if any(staging_steps) and args.adapters
               else (PASS_STAGING,))
    reserves = {"both": (False, True), "off": (False,), "on": (True,)}[args.reserve]
    runs = [replay(lengths, args.kv_tokens, int(running), args.max_batch_tokens, reserve, cost, H100, adapters,
                   steps, pass_staging, int(threads), int(depth), int(headroom))
            for running in args.running.split(",") for reserve in reserves for headroom in args.headroom.split(",")
            for pass_staging in passing
            for threads in args.stager_threads.split(",") for steps in staging_steps
            for depth in (args.prepare_depth.split(",") if int(threads) else (PREPARE_DEPTH,))]
    print(f"{args.dataset}: {len(lengths)} prompts, {args.kv_tokens} KV positions, {args.model_config}, "
          f"{args.adapters} adapters")
    print(f"{'running':>7} {'reserve':>7} {'headroom':>8} {'pass':>4} {'stager':>6} {'depth':>5} {'staging':>7} {'decode':>6} {'mixed':>5} "
          f"{'rows/decode':>11} {'most':>4} {'preempted':>9} {'prompt again':>12} {'empty: staging':>14} "
          f"{'no request':>10} {'floor s':>7} {'est. busy s':>11} {'est. tok/s':>10}")
    for run in runs:
        empty = run["empty_slots_by_cause"]
        print(f"{run['max_running_requests']:>7} {'on' if run['kv_growth_reserve'] else 'off':>7} {run['headroom']:>8} "
              f"{run['pass_staging']:>4} "
              f"{run['stager_threads'] or '-':>6} {run['prepare_depth'] or '-':>5} {run['staging_steps']:>7} "
              f"{run['steps']['decode']['steps']:>6} {run['steps']['mixed']['steps']:>5} {run['mean_decode_rows']:>11} "
              f"{run['most_running']:>4} {run['preemptions']:>9} {run['prompt_tokens_again']:>12} "
              f"{empty.get('adapter_staging', 0):>14} {empty.get('no_request_waiting', 0):>10} {run['floor_s']:>7.2f} "
              f"{run['estimated_busy_s']:>11.2f} {run['estimated_output_tok_s']:>10.0f}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"dataset": args.dataset, "prompts": len(lengths), "kv_tokens": args.kv_tokens,
                                        "kv_bytes": args.kv_bytes, "weight_bytes": args.weight_bytes,
                                        "model_config": args.model_config, "adapters": args.adapters, "alpha": args.alpha,
                                        "runs": runs}, indent=1) + "\n")


if __name__ == "__main__":
    main()
