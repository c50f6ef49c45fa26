"""`lorad bench serve`: a load generator against a running daemon over its socket, in the style of
`vllm bench serve`. Prompts come from a dataset (random lengths, the Azure traces, a trace file), are sent
at a request rate (Poisson, all at once, or the trace's own arrivals) under an optional concurrency cap,
streamed, and timed token by token. It reports throughput, TTFT / TPOT / ITL / end-to-end latency and
goodput; `--sweep` runs several rates or concurrencies in one call and plots throughput against latency.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from lorad.daemon.bench.trace_report import write_json
from lorad.daemon.server.cli_args import SEED, number
from lorad.errors import BadRequest, LoradError, Overloaded
from lorad.scheduler.workload import AZURE_ATTRIBUTION, Trace, power_law_weights, read_azure_csv

DATASETS = ("random", "azure-conv", "azure-code", "trace")
AZURE_FILES = {"azure-conv": "azure_llm_inference_2023_conv.csv", "azure-code": "azure_llm_inference_2023_code.csv"}
SWEEP_KEYS = ("request-rate", "max-concurrency")
PERCENTILES = (50, 90, 99)
# Token ids of generated prompts: inside any vocabulary and clear of the usual special tokens.
PROMPT_TOKEN_RANGE = (16, 256)
# A request that loses its connection says the daemon is gone or refusing: the run ends with a partial report.
CONNECTION = "connection"
MAX_PROMPTS = 1_000_000  # --num-prompts, --warmup-requests
WARMUP_PROMPT_TOKENS = 16  # a warm-up request's prompt (--warmup-requests): its adapter's prefill runs once


@dataclass(frozen=True)
class Prompt:
    token_ids: list[int]
    output_len: int
    arrival_s: float | None = None  # the dataset's own arrival time (azure, trace), else None


@dataclass
class Outcome:
    """What one request saw: when it was sent, when each streamed chunk of tokens came, and any error."""

    model: str
    prompt_len: int
    max_tokens: int
    sent: float = math.nan
    chunk_times: list[float] = field(default_factory=list)
    tokens: int = 0
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def ttft(self) -> float:
        return self.chunk_times[0] - self.sent if self.ok and self.chunk_times else math.nan

    @property
    def latency(self) -> float:
        return self.chunk_times[-1] - self.sent if self.ok and self.chunk_times else math.nan

    @property
    def tpot(self) -> float:
        """Time per output token after the first: (last - first) / (tokens - 1)."""
        if not self.ok or self.tokens < 2:
            return math.nan
        return (self.chunk_times[-1] - self.chunk_times[0]) / (self.tokens - 1)

    def inter_token_latencies(self) -> list[float]:
        """The gaps between consecutive streamed chunks (a chunk usually holds one token)."""
        return list(np.diff(self.chunk_times)) if self.ok else []


async def stream_request(client, model: str, prompt: list[int], max_tokens: int, outcome: Outcome, clock,
                         ignore_eos: bool = True, sampling: dict | None = None) -> Outcome:
    """Sends one completion, streamed (ignoring EOS: exactly max_tokens tokens), greedy or with `sampling`'s
    temperature, top_p and top_k, and times each chunk's arrival on `clock` (the event loop's). A refused or lost
    request ends with `outcome.error` set."""
    outcome.sent = clock()
    try:
        async for chunk in client.stream_completions(model=model, prompt=prompt, max_tokens=max_tokens,
                                                     ignore_eos=ignore_eos, return_token_ids=True,
                                                     **(sampling or {"temperature": 0})):
            new = sum(len(choice.get("token_ids") or ()) for choice in chunk.get("choices", ()))
            if new:
                outcome.chunk_times.append(clock())
                outcome.tokens += new
        if not outcome.tokens:
            outcome.error = "no tokens"
    except Overloaded as error:
        outcome.error = f"overloaded: {error.message}"
    except LoradError as error:
        outcome.error = f"{type(error).__name__}: {error.message}"
    except (OSError, asyncio.TimeoutError) as error:  # refused, or dropped mid-stream
        outcome.error = f"{CONNECTION}: {error or type(error).__name__}"
    except Exception as error:  # aiohttp's ClientError (payload, disconnect): this request is lost, the run goes on
        if not _from_aiohttp(error):
            raise
        outcome.error = f"{CONNECTION}: {type(error).__name__}: {error}"
    return outcome


# --- datasets ---------------------------------------------------------------------------------------------


def load_prompts(args: argparse.Namespace, max_model_len: int | None, rng: np.random.Generator) -> tuple[list[Prompt], dict]:
    """args.num_prompts prompts of the chosen dataset, each cut to fit max_model_len; and what the report
    says of the dataset."""
    if args.dataset == "random":
        lengths = [(args.input_len, args.output_len)] * args.num_prompts
        arrivals = [None] * args.num_prompts
        source = {"dataset": "random", "input_len": args.input_len, "output_len": args.output_len}
    elif args.dataset in AZURE_FILES:
        path = Path(args.data_dir or _default_data_dir()) / AZURE_FILES[args.dataset]
        rows = read_azure_csv(path)
        count = min(args.num_prompts, len(rows.prompt_tokens))
        lengths = list(zip(rows.prompt_tokens[:count].tolist(), rows.output_tokens[:count].tolist()))
        arrivals = rows.arrival_s[:count].tolist()
        source = {"dataset": args.dataset, "path": str(path), "attribution": AZURE_ATTRIBUTION}
    else:
        if not args.trace:
            raise BadRequest("--dataset trace needs --trace PATH (a trace written by `lorad trace make`)")
        trace = Trace.load(args.trace)
        requests = trace.requests[: args.num_prompts]
        lengths = [(r.prompt_tokens, max(1, r.output_tokens)) for r in requests]
        arrivals = [r.arrival_s for r in requests]
        source = {"dataset": "trace", "path": args.trace, **trace.source}
    if not lengths:
        raise BadRequest(f"the {args.dataset} dataset gave no prompts")
    prompts, clipped = [], 0
    for (prompt_len, output_len), arrival in zip(lengths, arrivals):
        fitted = fit_lengths(prompt_len, output_len, args.max_input_len, max_model_len)
        clipped += fitted != (prompt_len, output_len)
        token_ids = rng.integers(*PROMPT_TOKEN_RANGE, size=fitted[0]).tolist()
        prompts.append(Prompt(token_ids, fitted[1], arrival))
    source["prompts"] = len(prompts)
    source["clipped_to_fit"] = clipped
    return prompts, source


def fit_lengths(prompt_len: int, output_len: int, max_input_len: int | None, max_model_len: int | None) -> tuple[int, int]:
    """(prompt, output) lengths cut to max_input_len, then, where both exceed the context, halved into it."""
    prompt_len = max(1, min(prompt_len, max_input_len or prompt_len))
    output_len = max(1, output_len)
    if max_model_len and prompt_len + output_len > max_model_len:
        prompt_len = max(1, min(prompt_len, max_model_len // 2))
        output_len = max(1, min(output_len, max_model_len - prompt_len))
    return prompt_len, output_len


def _default_data_dir() -> Path:
    from lorad.daemon.bench.trace_make import default_data_dir

    return default_data_dir()


def choose_models(listed: list[dict], num_adapters: int, alpha: float, count: int,
                  rng: np.random.Generator) -> tuple[list[str], dict]:
    """Each request's `model`: the base model alone (num_adapters 0), or one of the daemon's first
    num_adapters LoRA adapters (sorted by name) drawn with Zipf(alpha) popularity."""
    base = next((entry["id"] for entry in listed if entry.get("kind") != "lora"), listed[0]["id"])
    if num_adapters == 0:
        return [base] * count, {"base_model": base, "adapters": 0}
    adapters = sorted(entry["id"] for entry in listed if entry.get("kind") == "lora")
    if len(adapters) < num_adapters:
        raise BadRequest(f"--adapters {num_adapters}: the daemon serves {len(adapters)} adapters")
    chosen = adapters[:num_adapters]
    picks = rng.choice(num_adapters, size=count, p=power_law_weights(num_adapters, alpha))
    return [chosen[i] for i in picks], {"base_model": base, "adapters": num_adapters, "alpha": alpha}


def send_times(prompts: list[Prompt], request_rate: float | str, time_scale: float,
               rng: np.random.Generator) -> list[float]:
    """Seconds after the start at which each request goes: all at once (inf), Poisson arrivals at the
    rate, or the dataset's own arrival times scaled by time_scale ("trace")."""
    if request_rate == "trace":
        if any(prompt.arrival_s is None for prompt in prompts):
            raise BadRequest("--request-rate trace needs a dataset with arrival times (azure-conv, azure-code, trace)")
        return [prompt.arrival_s * time_scale for prompt in prompts]
    if math.isinf(request_rate):
        return [0.0] * len(prompts)
    gaps = rng.exponential(1.0 / request_rate, size=len(prompts))
    return (np.cumsum(gaps) - gaps[0]).tolist()


# --- one run ------------------------------------------------------------------------------------------------


async def run_load(client, prompts: list[Prompt], models: list[str], at: list[float], max_concurrency: int | None,
                   ignore_eos: bool, progress=None, sampling: dict | None = None) -> tuple[list[Outcome], float]:
    """Sends every prompt at its time, at most max_concurrency in flight; returns the outcomes and the
    run's wall time (first send to last token or error)."""
    loop = asyncio.get_running_loop()
    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    start = loop.time()

    async def one(prompt: Prompt, model: str, when: float) -> Outcome:
        delay = start + when - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        outcome = Outcome(model, len(prompt.token_ids), prompt.output_len)
        if limit is None:
            await stream_request(client, model, prompt.token_ids, prompt.output_len, outcome, loop.time, ignore_eos, sampling)
        else:
            async with limit:
                await stream_request(client, model, prompt.token_ids, prompt.output_len, outcome, loop.time, ignore_eos,
                                     sampling)
        if progress is not None:
            progress.update(1)
        return outcome

    outcomes = await asyncio.gather(*(one(p, m, t) for p, m, t in zip(prompts, models, at)))
    return outcomes, loop.time() - start


def warmup_models(models: list[str], count: int) -> list[str]:
    """The `model` of each of `count` warm-up requests: the run's models, the most requested first (ties: the first
    used first), and round again while `count` is larger."""
    order = [model for model, _ in Counter(models).most_common()]
    return [order[index % len(order)] for index in range(count)]


async def warm_up(client, prompts: list[Prompt], models: list[str], count: int, max_concurrency: int | None,
                  sampling: dict | None = None) -> dict:
    """Sends `count` short requests (a prompt of WARMUP_PROMPT_TOKENS tokens, one output token) over `warmup_models`
    before the measured run and waits for them: the adapters they name are read from disk and placed now, not in the
    first point, so every point of a sweep meets the same warm daemon. Counted in no point; -> what they took."""
    chosen = warmup_models(models, count)
    short = [Prompt(prompts[index % len(prompts)].token_ids[:WARMUP_PROMPT_TOKENS], 1) for index in range(count)]
    outcomes, duration = await run_load(client, short, chosen, [0.0] * count, max_concurrency, True, None, sampling)
    errors = Counter(outcome.error for outcome in outcomes if not outcome.ok)
    return {"requests": count, "models": len(set(chosen)), "seconds": duration, "failed": sum(errors.values()),
            "errors": dict(errors)}


def summarize(outcomes: list[Outcome], duration_s: float, goodput: dict[str, float]) -> dict:
    """vllm bench serve's metrics: counts, request / output / total token throughput, and TTFT, TPOT, ITL
    and end-to-end latency (mean, median and percentiles, in ms); goodput: completed requests per second
    that met every objective in `goodput` (ms, keys ttft, tpot, e2el)."""
    done = [o for o in outcomes if o.ok]
    output_tokens = sum(o.tokens for o in done)
    input_tokens = sum(o.prompt_len for o in done)
    errors: dict[str, int] = {}
    for outcome in outcomes:
        if not outcome.ok:
            errors[outcome.error] = errors.get(outcome.error, 0) + 1
    per_second = (lambda value: value / duration_s) if duration_s > 0 else (lambda value: 0.0)
    itl = [gap for o in done for gap in o.inter_token_latencies()]
    values = {"ttft": [o.ttft for o in done], "tpot": [o.tpot for o in done], "itl": itl,
              "e2el": [o.latency for o in done]}
    summary = {
        "requests": len(outcomes),
        "completed": len(done),
        "failed": len(outcomes) - len(done),
        "errors": errors,
        "duration_s": duration_s,
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": per_second(len(done)),
        "output_throughput": per_second(output_tokens),
        "total_token_throughput": per_second(input_tokens + output_tokens),
    }
    for name, samples in values.items():
        summary[f"{name}_ms"] = _stats_ms(samples)
    if goodput:
        good = sum(all(getattr_ms(o, key) <= limit for key, limit in goodput.items()) for o in done)
        summary["goodput"] = {"objectives_ms": goodput, "requests_met": good, "request_goodput": per_second(good),
                              "share_met": good / len(outcomes) if outcomes else 0.0}
    return summary


def sweep_goodput(report: dict, share: float) -> dict:
    """The highest swept value (request rate or max concurrency) at which at least `share` of the requests met every
    objective: the goodput of a sweep, as figure 21.3 counts it (None: no point did)."""
    key = report["sweep"]["key"]
    met = [run["request_rate"] if key == "request-rate" else run["max_concurrency"]
           for run in report["runs"] if run["goodput"]["share_met"] >= share]
    highest = max(met, key=lambda point: math.inf if point == "inf" else float(point), default=None)
    return {"share": share, "highest": highest}


def getattr_ms(outcome: Outcome, key: str) -> float:
    """The outcome's TTFT, TPOT or end-to-end latency in ms (a one-token request meets any TPOT)."""
    value = {"ttft": outcome.ttft, "tpot": outcome.tpot, "e2el": outcome.latency}[key] * 1e3
    return 0.0 if key == "tpot" and math.isnan(value) else value


def _stats_ms(samples: list[float]) -> dict:
    array = np.asarray([s for s in samples if not math.isnan(s)], dtype=np.float64) * 1e3
    if not len(array):
        return {"mean": math.nan, "median": math.nan, **{f"p{p}": math.nan for p in PERCENTILES}}
    return {"mean": float(array.mean()), "median": float(np.median(array)),
            **{f"p{p}": float(np.percentile(array, p)) for p in PERCENTILES}}


# --- the command ------------------------------------------------------------------------------------------


def parse_rate(text: str) -> float | str:
    if text in ("inf", "trace"):
        return math.inf if text == "inf" else text
    try:
        rate = float(text)
    except ValueError:
        rate = math.nan
    if not rate > 0 or math.isinf(rate):
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive number, inf or trace")
    return rate


def parse_sweep(text: str) -> tuple[str, list]:
    key, _, values = text.partition("=")
    if key not in SWEEP_KEYS or not values:
        raise argparse.ArgumentTypeError(f"{text!r}: expected request-rate=R,R,... or max-concurrency=N,N,...")
    try:
        if key == "request-rate":
            return key, [parse_rate(value) for value in values.split(",")]
        points = [int(value) for value in values.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: max-concurrency takes whole numbers") from None
    if any(point < 1 for point in points):
        raise argparse.ArgumentTypeError(f"{text!r}: max-concurrency takes numbers >= 1")
    return key, points


def parse_goodput(items: list[str]) -> dict[str, float]:
    objectives = {}
    for item in items or ():
        key, _, value = item.partition(":")
        try:
            objectives[key] = float(value)
        except ValueError:
            objectives[key] = math.nan
        if key not in ("ttft", "tpot", "e2el") or not objectives[key] > 0:
            raise BadRequest(f"--goodput {item}: expected ttft:MS, tpot:MS or e2el:MS with a positive MS")
    return objectives


def add_parser(actions, default_socket: str) -> None:
    serve = actions.add_parser("serve", help="load a running daemon like `vllm bench serve`: throughput, "
                                             "TTFT / TPOT / ITL, goodput, sweeps")
    serve.add_argument("--socket", default=default_socket, metavar="PATH",
                       help=f"the daemon's Unix socket (default: {default_socket})")
    serve.add_argument("--dataset", choices=DATASETS, default="random", help="(default: random)")
    serve.add_argument("--input-len", type=number(int, positive=True), default=1024, metavar="N",
                       help="random: prompt tokens (1024)")
    serve.add_argument("--output-len", type=number(int, positive=True), default=128, metavar="N",
                       help="random: output tokens (128)")
    serve.add_argument("--ignore-eos", action="store_true",
                       help="generate every request's whole output length (default: a request may end at EOS)")
    serve.add_argument("--trace", metavar="PATH", help="--dataset trace: a trace written by `lorad trace make`")
    serve.add_argument("--data-dir", metavar="DIR", help="where the Azure CSVs are (default: ../shared/data)")
    serve.add_argument("--max-input-len", type=number(int, positive=True), metavar="N",
                       help="longer prompts are cut to N tokens")
    serve.add_argument("--num-prompts", type=number(int, 1, MAX_PROMPTS), default=200, metavar="N",
                       help="(default: 200)")
    serve.add_argument("--request-rate", type=parse_rate, default=math.inf, metavar="R|inf|trace",
                       help="Poisson arrivals at R requests/s, all at once (inf), or the dataset's own arrival "
                            "times (trace) (default: inf)")
    serve.add_argument("--time-scale", type=number(float, most=1e6, positive=True), default=1.0, metavar="X",
                       help="--request-rate trace: arrival times are multiplied by X (default: 1)")
    serve.add_argument("--max-concurrency", type=number(int, positive=True), metavar="N",
                       help="at most N requests in flight")
    serve.add_argument("--adapters", type=number(int, 0, 1_000_000), default=0, metavar="N",
                       help="spread requests over the daemon's first N adapters (0: the base model alone; default 0)")
    serve.add_argument("--alpha", type=number(float, least=0), default=1.0, metavar="A",
                       help="Zipf exponent of adapter popularity (1)")
    serve.add_argument("--sweep", type=parse_sweep, metavar="KEY=V,V,...",
                       help="one run per value: request-rate=1,2,4,inf or max-concurrency=1,8,32")
    serve.add_argument("--goodput", nargs="+", metavar="KEY:MS",
                       help="objectives for goodput, e.g. ttft:2000 tpot:100 (keys ttft, tpot, e2el)")
    serve.add_argument("--goodput-share", type=number(float, most=1, positive=True), default=0.9, metavar="S",
                       help="with --goodput and --sweep: report the highest swept value at which at least this share "
                            "of the requests met every objective (default 0.9)")
    serve.add_argument("--temperature", type=float, default=0.0, metavar="T",
                       help="each request's temperature (default 0: greedy; the API's own default is 1)")
    serve.add_argument("--top-p", type=float, default=1.0, metavar="P", help="each request's top_p (default 1)")
    serve.add_argument("--top-k", type=number(int, least=0), default=0, metavar="K",
                       help="each request's top_k (default 0: off)")
    serve.add_argument("--warmup-requests", type=number(int, 0, MAX_PROMPTS), default=0, metavar="N",
                       help="N short requests (one output token) before the run, over its adapters, the most requested "
                            "first: their loads from disk happen then, not in the first point; counted in no point "
                            "(default 0)")
    serve.add_argument("--seed", type=SEED, default=0, metavar="N")
    serve.add_argument("--no-progress", action="store_true", help="no progress bar")
    serve.add_argument("--out", metavar="PATH.json", help="JSON report (and PATH.png: throughput against latency)")


def run(args: argparse.Namespace) -> int:
    """Runs the load (each sweep point in turn over the same prompts), prints a table, writes the report.
    Returns 0, or 1 when the daemon stopped answering (the report then holds what was measured)."""
    if not 0 < args.goodput_share <= 1:
        raise BadRequest("--goodput-share must be above 0 and at most 1")
    if not 0 <= args.temperature <= 100 or not 0 < args.top_p <= 1 or args.top_k < 0:
        raise BadRequest("--temperature must be from 0 to 100, --top-p above 0 and at most 1, --top-k >= 0")
    goodput = parse_goodput(args.goodput)
    report = asyncio.run(_run(args, goodput))
    if goodput:
        report["sweep"]["goodput"] = sweep_goodput(report, args.goodput_share)
    warmup = report.get("warmup")
    if warmup:
        print(f"warm-up: {warmup['requests']} requests over {warmup['models']} models in {warmup['seconds']:.1f} s"
              + (f", {warmup['failed']} failed: {warmup['errors']}" if warmup["failed"] else ""))
    print(format_table(report["runs"], report["sweep"]["key"]))
    if goodput and args.sweep:
        best = report["sweep"]["goodput"]["highest"]
        objectives = ", ".join(f"{key} <= {limit:g} ms" for key, limit in goodput.items())
        print(f"goodput: {report['sweep']['key']} {'none of the points' if best is None else best}, the highest with "
              f">= {args.goodput_share:.0%} of the requests at {objectives}")
    if "attribution" in report["dataset"]:
        print(f"data: {report['dataset']['attribution']}")
    lost = report.get("stopped")
    if lost:
        print(f"lorad: the daemon stopped answering: {lost}; the report holds what was measured before",
              file=sys.stderr)
    if args.out:
        write_json(args.out, report)
        plot = plot_sweep(report, Path(args.out).with_suffix(".png"))
        print(f"wrote {args.out}" + (f" and {plot}" if plot else ""))
    return 1 if lost else 0


async def _run(args: argparse.Namespace, goodput: dict[str, float]) -> dict:
    from lorad.client import AsyncClient

    key, points = args.sweep or ("request-rate", [args.request_rate])
    rng = np.random.default_rng(args.seed)
    async with AsyncClient(args.socket, max_connections=0) as client:
        listed = await client.models()
        max_model_len = listed[0].get("max_model_len")
        prompts, dataset = load_prompts(args, max_model_len, rng)
        models, served = choose_models(listed, args.adapters, args.alpha, len(prompts), rng)
        dataset["ignore_eos"] = args.ignore_eos
        sampling = {"temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k}
        dataset["sampling"] = sampling
        report = {"version": 1, "kind": "serve", "socket": args.socket, "dataset": dataset, "models": served,
                  "sweep": {"key": key, "points": [_json_point(p) for p in points]}, "runs": []}
        if args.warmup_requests:
            report["warmup"] = await warm_up(client, prompts, models, args.warmup_requests, args.max_concurrency, sampling)
            lost = _lost(report["warmup"]["errors"])
            if lost:
                report["stopped"] = f"{lost} of {args.warmup_requests} warm-up requests lost their connection"
                return report
        for point in points:
            rate = point if key == "request-rate" else args.request_rate
            concurrency = point if key == "max-concurrency" else args.max_concurrency
            at = send_times(prompts, rate, args.time_scale, np.random.default_rng(args.seed))
            progress = _progress_bar(len(prompts), f"{key} {_json_point(point)}", args.no_progress)
            before = await _step_time(client)
            try:
                outcomes, duration = await run_load(client, prompts, models, at, concurrency, args.ignore_eos, progress,
                                                    sampling)
            finally:
                if progress is not None:
                    progress.close()
            summary = summarize(outcomes, duration, goodput)
            summary["engine"] = step_time_delta(before, await _step_time(client))
            summary.update({"request_rate": _json_point(rate), "max_concurrency": concurrency})
            report["runs"].append(summary)
            lost = _lost(summary["errors"])
            if lost:
                report["stopped"] = f"{lost} of {len(outcomes)} requests lost their connection at {key} {_json_point(point)}"
                break
    return report


def _lost(errors: dict[str, int]) -> int:
    """The requests among `errors` (error -> count) that lost their connection: the daemon is gone or refusing."""
    return sum(count for error, count in errors.items() if error.startswith(CONNECTION))


LIMITS = ("max_running_requests", "kv_capacity_tokens")  # the daemon's batch limits, from /v1/status
# the step time the device's clock splits (StepAccount): the forwards, the tokens' work after them, the waits before them
DEVICE_CLOCK_KEYS = ("device_s", "tokens_device_s", "before_forward_s")
STATUS_KEPT = ("preemptions", *LIMITS)  # /v1/status beside its step_time


async def _step_time(client) -> dict | None:
    """The daemon's account of its steps (/v1/status `step_time`), with its count of preemptions, running cap and KV
    capacity where it gives them; None where there is none (a router, or a daemon that stopped answering)."""
    try:
        status = await client.status()
        step_time = status.get("step_time")
        if step_time is not None:
            step_time = {**step_time, **{key: status[key] for key in STATUS_KEPT if key in status}}
        return step_time
    except (OSError, asyncio.TimeoutError, LoradError):  # the run's own errors say why; its report goes on without them
        return None
    except Exception as error:  # aiohttp's ClientError (a disconnect), as in stream_request
        if not _from_aiohttp(error):
            raise
        return None


def _from_aiohttp(error: Exception) -> bool:
    """One of aiohttp's client errors (imported only with the async client, so told apart by module)."""
    return type(error).__module__.split(".")[0] == "aiohttp"


def step_time_delta(before: dict | None, after: dict | None) -> dict | None:
    """What the engine spent on this run's steps (the daemon's step_time after less before): busy time against
    the summed floor, in all and by step kind. Another client's requests in the same time would count too."""
    if before is None or after is None:
        return None
    by_kind = {}
    for kind, totals in after["by_kind"].items():
        earlier = before["by_kind"].get(kind, {})
        delta = {key: totals[key] - earlier.get(key, 0) for key in ("steps", "busy_s", "floor_s", "rows", "prompt_tokens")}
        delta["efficiency"] = delta["floor_s"] / delta["busy_s"] if delta["busy_s"] > 0 else None
        delta["mean_step_ms"] = delta["busy_s"] / delta["steps"] * 1e3 if delta["steps"] else None
        if "serial_floor_s" in totals:  # the floor with each step's phases one after the other (a daemon that counts it)
            delta["serial_floor_s"] = totals["serial_floor_s"] - earlier.get("serial_floor_s", 0)
        if "padding_rows" in totals:  # CUDA-graph bucket rows past the steps' own (a daemon that counts them)
            delta["padding_rows"] = totals["padding_rows"] - earlier.get("padding_rows", 0)
            delta["padding_rows_per_step"] = delta["padding_rows"] / delta["steps"] if delta["steps"] else None
        if "host_before_launch_s" in totals:  # where the time went (a daemon that splits it)
            delta["host_before_launch_s"] = totals["host_before_launch_s"] - earlier.get("host_before_launch_s", 0)
            parts = totals.get("host_before_launch_by_part_s", {})
            earlier_parts = earlier.get("host_before_launch_by_part_s", {})
            delta["host_before_launch_by_part_s"] = {part: seconds - earlier_parts.get(part, 0)
                                                     for part, seconds in parts.items()}
            for key in DEVICE_CLOCK_KEYS:  # on the device's clock (None: none; absent: a daemon that does not split it)
                if key in totals:
                    value = totals[key]
                    delta[key] = None if value is None else value - (earlier.get(key) or 0)
        if "empty_slots_by_cause" in totals:  # running slots the steps left empty, by why (a daemon that counts them)
            earlier_causes = earlier.get("empty_slots_by_cause", {})
            causes = {cause: count - earlier_causes.get(cause, 0) for cause, count in totals["empty_slots_by_cause"].items()}
            delta["empty_slots_by_cause"] = {cause: count for cause, count in causes.items() if count}
            delta["empty_slots"] = sum(delta["empty_slots_by_cause"].values())
        by_kind[kind] = delta
    busy = sum(kind["busy_s"] for kind in by_kind.values())
    floor = sum(kind["floor_s"] for kind in by_kind.values())
    summary = {"busy_s": busy, "floor_s": floor, "efficiency": floor / busy if busy > 0 else None,
               "device_rates": after["device_rates"], "by_kind": by_kind}
    if all("serial_floor_s" in kind for kind in by_kind.values()):
        summary["serial_floor_s"] = sum(kind["serial_floor_s"] for kind in by_kind.values())
    if "preemptions" in before and "preemptions" in after:  # requests preempted for KV, computed again
        summary["preemptions"] = after["preemptions"] - before["preemptions"]
    for key in LIMITS:  # the daemon's batch limits in this run
        if key in after:
            summary[key] = after[key]
    if all("host_before_launch_s" in kind for kind in by_kind.values()):
        summary["host_before_launch_s"] = sum(kind["host_before_launch_s"] for kind in by_kind.values())
        for key in DEVICE_CLOCK_KEYS:
            if all(key in kind for kind in by_kind.values()):
                values = [kind[key] for kind in by_kind.values() if kind[key] is not None]
                summary[key] = sum(values) if values else None
    if all("empty_slots_by_cause" in kind for kind in by_kind.values()):
        causes = sum((Counter(kind["empty_slots_by_cause"]) for kind in by_kind.values()), Counter())
        summary["empty_slots"] = sum(causes.values())
        summary["empty_slots_by_cause"] = dict(causes)
    return summary


def _json_point(point) -> float | str:
    return "inf" if isinstance(point, float) and math.isinf(point) else point


def _progress_bar(total: int, description: str, disabled: bool):
    if disabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc=description, unit="req", file=sys.stderr, leave=False)


def format_table(runs: list[dict], key: str) -> str:
    header = [key, "done", "failed", "req/s", "out tok/s", "total tok/s"]
    for metric in ("TTFT", "TPOT", "ITL", "E2E"):
        header += [f"{metric} mean", f"{metric} p50", f"{metric} p99"]
    header += ["goodput req/s", "busy s", "device s", "tokens s", "waits s", "floor s", "floor/busy", "serial floor s",
               "preempted"]
    rows = [header]
    for run in runs:
        point = run["request_rate"] if key == "request-rate" else run["max_concurrency"]
        row = [str(point), str(run["completed"]), str(run["failed"]), f"{run['request_throughput']:.2f}",
               f"{run['output_throughput']:.0f}", f"{run['total_token_throughput']:.0f}"]
        for metric in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms"):
            row += [_ms(run[metric][stat]) for stat in ("mean", "median", "p99")]
        row.append(f"{run['goodput']['request_goodput']:.2f}" if "goodput" in run else "-")
        engine = run.get("engine")
        row += ([f"{engine['busy_s']:.2f}", *(_seconds(engine.get(key)) for key in DEVICE_CLOCK_KEYS),
                 f"{engine['floor_s']:.2f}", f"{engine['efficiency']:.2f}" if engine["efficiency"] is not None else "-",
                 _seconds(engine.get("serial_floor_s")), str(engine["preemptions"]) if "preemptions" in engine else "-"]
                if engine else ["-"] * 8)
        rows.append(row)
    widths = [max(len(row[column]) for row in rows) for column in range(len(header))]
    lines = ["  ".join(cell.rjust(width) for cell, width in zip(row, widths)) for row in rows]
    lines.append("(times in ms; busy s: the engine's step time in the run, device s: the same steps' forwards on the "
                 "device's clock, tokens s: the device's work on their tokens after each forward (sampling, logprobs, "
                 "the copies to the host), waits s: the device's time from a step's tokens to the next forward (waiting "
                 "for the host's launch), floor s: their least time on this device from bytes and FLOPs, serial floor "
                 "s: the same with each step's projections, attention and LoRA one after the other; preempted: "
                 "running requests preempted for KV and computed again)")
    limits = (runs[-1].get("engine") or {}) if runs else {}
    if "max_running_requests" in limits:
        lines.append(f"the daemon: {limits['max_running_requests']} running requests at most, a KV cache of "
                     f"{limits.get('kv_capacity_tokens', '?')} tokens")
    for run in runs:  # a daemon that counts the running slots its steps left empty
        causes = (run.get("engine") or {}).get("empty_slots_by_cause")
        if causes:
            point = run["request_rate"] if key == "request-rate" else run["max_concurrency"]
            lines.append(f"{key} {point}: empty running slots (slot-steps) by cause: "
                         + ", ".join(f"{cause} {count}" for cause, count in sorted(causes.items(), key=lambda item: -item[1])))
    return "\n".join(lines)


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _ms(value: float) -> str:
    return "-" if math.isnan(value) else f"{value:.1f}"


def plot_sweep(report: dict, path: Path) -> Path | None:
    """Output tokens per second against TTFT and against TPOT (medians), one line over the sweep's points;
    skipped, with the reason printed, without matplotlib (`pip install lorad[bench]`)."""
    try:
        import matplotlib
    except ImportError as error:
        print(f"lorad: no plot ({error}; pip install 'lorad[bench]')", file=sys.stderr)
        return None

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = report["runs"]
    key = report["sweep"]["key"]
    throughput = [run["output_throughput"] for run in runs]
    figure, axes = plt.subplots(1, 2, figsize=(10, 4))
    for axis, metric, label in ((axes[0], "ttft_ms", "TTFT p50 (ms)"), (axes[1], "tpot_ms", "TPOT p50 (ms)")):
        latency = [run[metric]["median"] for run in runs]
        axis.plot(latency, throughput, marker="o", label=f"{report['models']['adapters']} adapters")
        for run, x, y in zip(runs, latency, throughput):
            axis.annotate(str(run["request_rate"] if key == "request-rate" else run["max_concurrency"]), (x, y),
                          fontsize=8, textcoords="offset points", xytext=(4, 4))
        axis.set_xlabel(label)
        axis.set_ylabel("output tokens/s")
        axis.grid(alpha=0.3)
        axis.legend()
    figure.suptitle(f"lorad bench serve: {report['dataset']['dataset']}, sweep over {key}", fontsize=10)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path
