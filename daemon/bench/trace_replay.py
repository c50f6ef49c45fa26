"""`lorad bench trace`: a trace replayed against a running daemon, each request sent at its (scaled) arrival
time and streamed, its tokens timed as they come; the same table and report as `lorad simulate`.
"""

from __future__ import annotations

import argparse
import asyncio
import math

import numpy as np

from lorad.daemon.bench.trace_report import format_table, print_attribution, write_json
from lorad.daemon.bench.serve import PROMPT_TOKEN_RANGE, Outcome, fit_lengths, stream_request
from lorad.errors import BadRequest
from lorad.scheduler.workload import Trace


def run(args: argparse.Namespace) -> None:
    """`lorad bench trace`: replays the trace; prints the table, writes the report."""
    if args.time_scale <= 0 or args.max_prompt_tokens < 1 or args.max_output_tokens < 1:
        raise BadRequest("--time-scale, --max-prompt-tokens and --max-output-tokens must be positive")
    trace = Trace.load(args.trace)
    requests = trace.requests[: args.max_requests] if args.max_requests else trace.requests
    if not requests:
        raise BadRequest(f"the trace {args.trace} has no requests")
    report = asyncio.run(replay(args.socket, trace, requests, args))
    print(report["mapping"]["note"])
    print_attribution(trace)
    print(format_table([report["summary"]]))
    errors = report["summary"]["drop_reasons"]
    if errors:
        print("not served: " + ", ".join(f"{reason} x{count}" for reason, count in errors.items()))
    if args.out:
        write_json(args.out, report)
        print(f"wrote {args.out}")


async def replay(socket_path: str, trace, requests, args: argparse.Namespace) -> dict:
    """Sends each request at its (scaled) arrival time, streaming, and times its tokens as they come."""
    from lorad.client import AsyncClient
    from lorad.scheduler.simulator import distribution

    async with AsyncClient(socket_path, max_connections=0) as client:
        models = await client.models()
        status = await client.status()
        base = models[0]["id"]
        adapters = [entry["id"] for entry in models if entry.get("kind") == "lora"]
        trace_adapters = sorted({r.adapter for r in requests})
        index = {name: i for i, name in enumerate(trace_adapters)}
        target = {name: adapters[i % len(adapters)] if adapters else base for name, i in index.items()}
        note = (f"adapters: the trace's {len(trace_adapters)} (sorted by name) mapped onto the daemon's "
                f"{len(adapters)} by index modulo {len(adapters)}" if adapters else
                f"adapters: the daemon lists none; every request goes to the base model {base}")
        max_model_len = models[0].get("max_model_len")
        rng = np.random.default_rng(0)
        plans, clipped = [], 0
        for request in requests:
            prompt, output = fit_lengths(request.prompt_tokens, min(max(1, request.output_tokens), args.max_output_tokens),
                                         args.max_prompt_tokens, max_model_len)
            clipped += (prompt, output) != (request.prompt_tokens, max(1, request.output_tokens))
            plans.append((request.arrival_s * args.time_scale, target[request.adapter],
                          rng.integers(*PROMPT_TOKEN_RANGE, size=prompt).tolist(), output))

        loop = asyncio.get_running_loop()
        start = loop.time() + 0.05
        outcomes = await asyncio.gather(*(_send_one(client, loop, start, *plan) for plan in plans))

    count = len(plans)
    arrival = np.array([p[0] for p in plans])
    sent = np.array([o["sent"] for o in outcomes])
    first = np.array([o["first"] for o in outcomes])
    last = np.array([o["last"] for o in outcomes])
    tokens = np.array([o["tokens"] for o in outcomes])
    failed = np.array([o["error"] is not None for o in outcomes])
    ttft = first - sent
    with np.errstate(invalid="ignore", divide="ignore"):
        tpot = np.where(tokens > 1, (last - first) / (tokens - 1), math.nan)
    latency = last - sent
    served = ~failed
    makespan = float(np.nanmax(last[served]) - start) if served.any() else 0.0
    reasons: dict[str, int] = {}
    for outcome in outcomes:
        if outcome["error"]:
            reasons[outcome["error"]] = reasons.get(outcome["error"], 0) + 1
    objectives = {"ttft_s": args.slo_ttft_s, "tpot_s": args.slo_tpot_s}
    ttft_ok = served & (ttft <= args.slo_ttft_s) if args.slo_ttft_s else None
    tpot_ok = served & (np.isnan(tpot) | (tpot <= args.slo_tpot_s)) if args.slo_tpot_s else None
    both = None
    if ttft_ok is not None or tpot_ok is not None:
        both = served.copy()
        for ok in (ttft_ok, tpot_ok):
            if ok is not None:
                both &= ok
    summary = {
        "policy": "daemon",
        "admission": "daemon",
        "requests": count,
        "completed": int(served.sum()),
        "dropped": int(failed.sum()),
        "drop_reasons": reasons,
        "makespan_s": makespan,
        "throughput_rps": int(served.sum()) / makespan if makespan > 0 else 0.0,
        "throughput_tokens_per_s": float(tokens[served].sum()) / makespan if makespan > 0 else 0.0,
        "ttft_s": distribution(ttft[served]),
        "tpot_s": distribution(tpot[served]),
        "latency_s": distribution(latency[served]),
        "slo_ttft_s": args.slo_ttft_s,
        "slo_tpot_s": args.slo_tpot_s,
        "slo_ttft_attainment": float(ttft_ok.mean()) if ttft_ok is not None else None,
        "slo_tpot_attainment": float(tpot_ok.mean()) if tpot_ok is not None else None,
        "slo_attainment": float(both.mean()) if both is not None else None,
        "send_lag_s": distribution(sent - (start + arrival)),
    }
    return {
        "version": 1,
        "kind": "replay",
        "socket": socket_path,
        "trace": {"path": args.trace, "requests_replayed": count, "source": trace.source,
                  "time_scale": args.time_scale, "clipped_requests": clipped,
                  "max_prompt_tokens": args.max_prompt_tokens, "max_output_tokens": args.max_output_tokens},
        "daemon": {"base_model": base, "adapters": len(adapters), "status": status},
        "mapping": {"note": note, "adapters": target},
        "objectives": objectives,
        "summary": summary,
        "requests": [
            {"arrival_s": float(a), "model": p[1], "prompt_tokens": len(p[2]), "max_tokens": p[3],
             "output_tokens": int(o["tokens"]), "ttft_s": _finite(t), "tpot_s": _finite(tp), "latency_s": _finite(la),
             "error": o["error"]}
            for a, p, o, t, tp, la in zip(arrival, plans, outcomes, ttft, tpot, latency)
        ],
        **({"attribution": trace.source["attribution"]} if "attribution" in trace.source else {}),
    }


async def _send_one(client, loop, start: float, at: float, model: str, prompt: list[int], max_tokens: int) -> dict:
    delay = start + at - loop.time()
    if delay > 0:
        await asyncio.sleep(delay)
    outcome = await stream_request(client, model, prompt, max_tokens, Outcome(model, len(prompt), max_tokens), loop.time)
    first, last = (outcome.chunk_times[0], outcome.chunk_times[-1]) if outcome.ok else (math.nan, math.nan)
    return {"sent": outcome.sent, "first": first, "last": last, "tokens": outcome.tokens, "error": outcome.error}


def _finite(value) -> float | None:
    return float(value) if value is not None and math.isfinite(value) else None
