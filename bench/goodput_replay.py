"""Goodput of a rate sweep replayed on the CPU: the engine's Scheduler over Poisson arrivals, on a clock of modelled
step times.

`lorad bench serve --sweep request-rate=...` sends a dataset's requests as a Poisson process (the same seed, so the
same arrival times as here) and counts those that meet the objectives (TTFT and TPOT); goodput is the highest rate
at which a share of them (90%) do (figure 21.3). This replays it without a GPU: the requests join the engine's
Scheduler when they arrive, against a KV cache of the daemon's capacity (kv_admission.py's BoundedKV), their
adapters staged by the engine's stager as kv_admission.py models it (`--stager-threads`, each adapter taking
`--staging-s`), and each step lasts its floor from the engine's cost model (step_cost.py, the H100's measured
rates) times the served busy-over-floor factor of its kind (1.27 decode, 2.09 mixed: figure 21.1). A request's first
token comes at the end of the step that computes its prompt's last row, the others one a step after it. What it
gives is an estimate of where the queue starts to grow and what the running cap and the growth reserve do to it,
not a served figure; `--running` and `--reserve` are the daemon's `--max-running-requests` and `--kv-growth-reserve`.

    python3 bench/goodput_replay.py [--num-prompts 250] [--rates 5,7,9,11,12,13,16] [--running 64,128] [--out OUT.json]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
from kv_admission import BUSY_OVER_FLOOR, H100, BoundedKV, QueuedStaging, Staged  # bench/, beside this script
from lorad.daemon.bench.serve import choose_models, send_times
from lorad.daemon.engine.step_cost import DeviceRates, SequenceInStep, StepCostModel
from lorad.daemon.model.checkpoint import MODEL_CONFIGS, ModelSpec
from lorad.scheduler.batching import PASS_STAGING, GrowthReserve, Scheduler, Sequence
from step_padding import add_dataset_arguments, advance, dataset_lengths, step_kind

TICK_S = 0.0175  # the staging models count in steps: one is this long (a saturated 7B decode step on the H100)


def arrivals(count: int, rate: float, seed: int = 0) -> list[float]:
    """Seconds after the start at which each request goes: bench serve's own Poisson draw for `seed`."""
    return send_times([None] * count, rate, 1.0, np.random.default_rng(seed))


def replay(lengths: list[tuple[int, int]], at: list[float], adapters: list[str | None] | None, kv_tokens: int,
           max_running: int, max_batch_tokens: int, reserve: bool, cost: StepCostModel, staging_s: float = 0.0,
           stager_threads: int = 0, pass_staging: int = PASS_STAGING, rates: DeviceRates = H100) -> list[dict]:
    """Each request's arrival, first token and end on the replay's clock (seconds), in the order given."""
    steps = round(staging_s / TICK_S)
    staged = QueuedStaging(steps, stager_threads) if stager_threads else Staged(steps)
    scheduler = Scheduler(max_running, max_batch_tokens, BoundedKV(kv_tokens), staged,
                          reserve=GrowthReserve() if reserve else None, pass_staging=pass_staging)
    staged.running = lambda: bool(scheduler.running)
    timeline = [{"arrival_s": when, "output_tokens": output, "first_s": None, "end_s": None}
                for when, (_, output) in zip(at, lengths)]
    clock, joined = 0.0, 0
    while joined < len(lengths) or scheduler.has_work():
        while joined < len(lengths) and at[joined] <= clock:
            prompt_len, output_len = lengths[joined]
            adapter = None if adapters is None else adapters[joined]
            scheduler.add(Sequence(str(joined), [0] * prompt_len, prompt_len, adapter, max_new_tokens=output_len))
            joined += 1
        if not scheduler.has_work():
            clock = at[joined]
            continue
        staged.step = int(clock / TICK_S)
        if stager_threads:
            staged.prepare(scheduler.waiting)
        batch = scheduler.schedule()
        if not batch:  # every waiting request's adapter is staging and nothing runs: the next tick
            clock = (staged.step + 1) * TICK_S
            continue
        step = cost.cost([SequenceInStep(count, seq.num_computed + count, seq.num_computed + count >= seq.num_tokens, None)
                          for seq, count in batch])
        clock += BUSY_OVER_FLOOR[step_kind(batch)] * step.floor_s(rates.bandwidth_bytes_per_s, rates.flops_per_s)
        generated = {seq.request_id: seq.num_generated for seq, _ in batch}
        advance(scheduler, batch)
        for seq, _ in batch:
            request = timeline[int(seq.request_id)]
            if seq.num_generated > generated[seq.request_id] and request["first_s"] is None:
                request["first_s"] = clock
            if seq.num_generated >= seq.max_new_tokens and request["end_s"] is None:
                request["end_s"] = clock
    return timeline


def summarize(timeline: list[dict], ttft_s: float, tpot_s: float) -> dict:
    ttft = np.array([r["first_s"] - r["arrival_s"] for r in timeline])
    tpot = np.array([(r["end_s"] - r["first_s"]) / (r["output_tokens"] - 1) if r["output_tokens"] > 1 else 0.0
                     for r in timeline])
    met = int(np.sum((ttft <= ttft_s) & (tpot <= tpot_s)))
    duration = max(r["end_s"] for r in timeline)
    return {"met": met, "share_met": met / len(timeline), "duration_s": duration,
            "output_tok_s": sum(r["output_tokens"] for r in timeline) / duration,
            "ttft_ms": {"p50": 1e3 * float(np.percentile(ttft, 50)), "p99": 1e3 * float(np.percentile(ttft, 99))},
            "tpot_ms": {"p50": 1e3 * float(np.percentile(tpot, 50)), "p99": 1e3 * float(np.percentile(tpot, 99))}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_dataset_arguments(parser)
    parser.set_defaults(num_prompts=250)
    parser.add_argument("--model-config", default="llama-2-7b")
    parser.add_argument("--kv-tokens", type=int, default=104584, help="the KV cache's positions (the 7B daemon's in bf16)")
    parser.add_argument("--rates", default="5,7,9,11,12,13,16", help="request rates, comma-separated")
    parser.add_argument("--running", default="64,128", help="running caps, comma-separated")
    parser.add_argument("--reserve", choices=("both", "off", "on"), default="both", help="the growth reserve")
    parser.add_argument("--max-batch-tokens", type=int, default=2048)
    parser.add_argument("--adapters", type=int, default=100, help="requests spread over N adapters (0: the base model)")
    parser.add_argument("--alpha", type=float, default=1.0)
    parser.add_argument("--stager-threads", type=int, default=4, help="0: each adapter's first request waits --staging-s")
    parser.add_argument("--staging-s", type=float, default=0.68,
                        help="seconds to read and stage one adapter (0.68: what the served daemon's took with four threads)")
    parser.add_argument("--pass-staging", type=int, default=PASS_STAGING,
                        help="waiting requests admitted past one whose adapter stages (0: the queue waits behind it)")
    parser.add_argument("--goodput", default="ttft:2000,tpot:100", help="objectives in ms, as bench serve's --goodput")
    parser.add_argument("--share", type=float, default=0.9, help="the share of requests that must meet them")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    objectives = dict(item.split(":") for item in args.goodput.split(","))
    ttft_s, tpot_s = float(objectives["ttft"]) / 1e3, float(objectives["tpot"]) / 1e3
    lengths = dataset_lengths(args)
    spec = ModelSpec.from_hf_config(MODEL_CONFIGS[args.model_config])
    cost = StepCostModel(spec, dtype_bytes=2, adapter_ranks=lambda name: {})
    listed = [{"id": "base"}] + [{"id": f"adapter-{index:04d}", "kind": "lora"} for index in range(args.adapters)]
    adapters = (None if args.adapters == 0 else
                choose_models(listed, args.adapters, args.alpha, len(lengths), np.random.default_rng(args.seed))[0])
    reserves = {"both": (False, True), "off": (False,), "on": (True,)}[args.reserve]
    rates = [float(rate) for rate in args.rates.split(",")]
    configs = []
    print(f"{args.dataset}: {len(lengths)} prompts, {args.kv_tokens} KV positions, {args.adapters} adapters, "
          f"stager {args.stager_threads} x {args.staging_s} s, objectives TTFT {ttft_s} s TPOT {tpot_s * 1e3:g} ms")
    print(f"{'running':>7} {'reserve':>7} {'rate':>5} {'met':>6} {'tok/s':>6} {'TTFT p50':>9} {'p99':>8} {'TPOT p50':>9}")
    for running in [int(value) for value in args.running.split(",")]:
        for reserve in reserves:
            points = []
            for rate in rates:
                timeline = replay(lengths, arrivals(len(lengths), rate, args.seed), adapters, args.kv_tokens, running,
                                  args.max_batch_tokens, reserve, cost, args.staging_s, args.stager_threads,
                                  args.pass_staging)
                point = {"request_rate": rate, **summarize(timeline, ttft_s, tpot_s)}
                points.append(point)
                print(f"{running:>7} {'on' if reserve else 'off':>7} {rate:>5g} {point['share_met']:>6.1%} "
                      f"{point['output_tok_s']:>6.0f} {point['ttft_ms']['p50']:>7.0f}ms {point['ttft_ms']['p99']:>6.0f}ms "
                      f"{point['tpot_ms']['p50']:>7.1f}ms")
            good = [p["request_rate"] for p in points if p["share_met"] >= args.share]
            goodput = max(good) if good else None
            print(f"{'':>7} goodput: {goodput} req/s")
            configs.append({"max_running_requests": running, "kv_growth_reserve": reserve, "goodput_rate": goodput,
                            "points": points})
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"dataset": args.dataset, "prompts": len(lengths), "kv_tokens": args.kv_tokens,
                                        "model_config": args.model_config, "adapters": args.adapters,
                                        "stager_threads": args.stager_threads, "staging_s": args.staging_s,
                                        "pass_staging": args.pass_staging, "objectives_s": [ttft_s, tpot_s],
                                        "share": args.share, "configs": configs}, indent=1) + "\n")


if __name__ == "__main__":
    main()
