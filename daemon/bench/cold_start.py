"""`lorad bench cold-start`: the engine itself (in this process: dummy base weights, dummy adapters held in
host memory) under open-loop Poisson arrivals, for each cold-start mode (CaraServe Figs. 10, 11, 14):
TTFT, time per output token and request latency

- with every request for a distinct adapter (every request a cold start), and
- with Zipf-skewed popularity over 128, 256, 512 adapters (some warm, some cold),

for `cached` (every adapter placed before the first request: the floor), `ondemand` (wait for the
load), `cpu` (CPU-assisted prefill) and `auto` (decided per request). Then an ablation on the distinct
workload: pinned vs pageable host copies (pinned_host_bytes 0: every load copies from the staged adapter in
pageable memory), CPU assist on vs off, streaming on vs off for `auto` with pageable copies, and
layer-wise takeover when EngineConfig has a switch for it. `--pinned-host-bytes` sets the pinned budget of
every engine, the modes' own included (BENCHMARKS.md's figure 5.1: the four modes with pageable adapters).

One engine per mode, built and warmed up (every prompt length, with and without adapters, batched
decodes, one CPU-assisted prefill in cpu/auto) before its first workload: build and warm-up times are
reported apart (`engine_build_s`, `engine_warmup_s`) and no workload pays first-use costs. One thread
drives the engine (submit at each arrival, `step()` while anything runs), so nothing races the
measurement; times are from each request's scheduled arrival. Between workloads the idle
adapters leave the pool, so each workload starts cold.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import time

import numpy as np
import torch
from lorad.config import EngineConfig
from lorad.daemon.bench.report import DEFAULT_MODEL, finish, machine, markdown_table, resolve_device, summary
from lorad.errors import BadRequest, LoradError

log = logging.getLogger(__name__)

MODES = ("cached", "ondemand", "cpu", "auto")
RUN_TIMEOUT_S = 600.0  # one workload; longer means the engine stopped making progress
WARMUP_PROMPT = 8


@dataclasses.dataclass
class Record:
    arrival: float  # seconds from the workload's start
    adapter: str
    first: float | None = None
    done: float | None = None
    generated: int = 0
    error: str | None = None

    def on_output(self, output) -> None:
        now = time.perf_counter()
        if output.new_token_ids and self.first is None:
            self.first = now
        self.generated = output.num_generated_tokens or self.generated + len(output.new_token_ids)
        if output.finished:
            self.done = now
            if output.finish_reason not in ("stop", "length"):
                self.error = output.error or output.finish_reason


def layerwise_field() -> str | None:
    """The EngineConfig field that switches layer-wise takeover (the adapter streams in layer by layer
    while the CPU computes the layers not yet there), if the engine has one."""
    for field in dataclasses.fields(EngineConfig):
        if "layerwise" in field.name.replace("_", "") and isinstance(field.default, bool):
            return field.name
    return None


def workloads(requests: int, rate: float, adapter_counts, alpha: float, seed: int) -> list[dict]:
    """[{name, arrivals (s), adapters (indices)}]: distinct adapters, then Zipf(alpha) over each count."""
    from lorad.scheduler.workload import poisson_arrivals, power_law_weights

    rng = np.random.default_rng(seed)

    def arrivals() -> np.ndarray:
        times = poisson_arrivals(rate, 4 * requests / rate + 10, rng)[:requests]
        if len(times) < requests:
            raise RuntimeError(f"the Poisson process gave {len(times)} of {requests} arrivals")
        return times

    plans = [{"name": "distinct", "adapters_in_play": requests, "arrivals": arrivals(),
              "adapters": np.arange(requests)}]
    for count in adapter_counts:
        chosen = rng.choice(count, size=requests, p=power_law_weights(count, alpha))
        plans.append({"name": f"skewed-{count}", "adapters_in_play": count, "arrivals": arrivals(), "adapters": chosen})
    return plans


def run(args) -> dict:
    device = resolve_device(args.device)
    cuda = device.type == "cuda"
    model = args.model_config or DEFAULT_MODEL[device.type]
    requests = args.requests or (48 if cuda else 6)  # on the H100: ~4.5 minutes for the whole default run
    rate = args.rate or (8.0 if cuda else 50.0)
    adapter_counts = args.adapters or ((128, 256, 512) if cuda else (8, 16))
    prompt_tokens = args.prompt_tokens or (256 if cuda else 16)
    output_tokens = args.output_tokens or (32 if cuda else 4)
    rank = args.rank or (32 if cuda else 8)
    modes = args.modes or MODES
    for mode in modes:
        if mode not in MODES:
            raise BadRequest(f"--modes: unknown mode {mode!r}; one of {', '.join(MODES)}")
    from lorad.daemon.engine.engine import dummy_adapter_projections
    from lorad.daemon.model.checkpoint import MODEL_CONFIGS, ModelSpec

    if model not in MODEL_CONFIGS:
        raise BadRequest(f"unknown --model-config {model!r}: one of {', '.join(MODEL_CONFIGS)}")
    allowed = dummy_adapter_projections(ModelSpec.from_hf_config(MODEL_CONFIGS[model]))
    unknown = [target for target in args.targets.split(",") if target not in allowed]
    if unknown:
        raise BadRequest(f"--targets: unknown projection {unknown[0]!r}; of {', '.join(allowed)}")
    base = {
        "model_config": model, "dummy_weights": True, "dummy_adapters": max(requests, *adapter_counts),
        "dummy_adapter_rank": rank, "dummy_adapter_targets": args.targets, "device": str(device),
        "max_model_len": prompt_tokens + output_tokens + WARMUP_PROMPT, "cpu_workers": args.cpu_workers,
        "seed": args.seed,
    }
    if getattr(args, "pinned_host_bytes", None) is not None:
        base["pinned_host_bytes"] = args.pinned_host_bytes
    try:
        EngineConfig(**base)
    except TypeError as error:
        raise BadRequest(f"engine configuration: {error}") from None
    plans = workloads(requests, rate, adapter_counts, args.alpha, args.seed)
    generator = torch.Generator().manual_seed(args.seed)
    vocab = MODEL_CONFIGS[model]["vocab_size"]
    prompts = [torch.randint(1, vocab, (prompt_tokens,), generator=generator).tolist() for _ in range(requests)]

    results: dict[tuple, dict] = {}  # config overrides -> {workload name: row}

    defaults = {field.name: field.default for field in dataclasses.fields(EngineConfig)}

    def key_of(overrides: dict) -> tuple:
        # What differs from EngineConfig's defaults: one engine per distinct configuration.
        return tuple(sorted((name, value) for name, value in overrides.items() if value != defaults[name]))

    def measure(overrides: dict, names: list[str]) -> dict:
        done = results.setdefault(key_of(overrides), {})
        todo = [plan for plan in plans if plan["name"] in names and plan["name"] not in done]
        if todo:
            done.update(_run_engine({**base, **overrides}, todo, prompts, output_tokens))
        return done

    if getattr(args, "prime", True) and cuda:
        # Triton compiles a kernel variant the first time a launch needs it, in the step that needs it,
        # once per process. The per-engine warm-up cannot reach every variant the workloads' mixed steps
        # use, so the first engine measured paid for the rest inside its workloads (cached, which runs
        # first, showed 3.4 s mean TTFT on its first workload and 0.1 s on its fourth). One throwaway
        # engine runs the first workload first; its rows are not reported.
        print("priming: an unreported ondemand engine runs the first workload")
        _run_engine({**base, "cold_start": "ondemand"}, plans[:1], prompts, output_tokens)
    rows = []
    rounds = getattr(args, "rounds", 1)
    if rounds == 1:
        for mode in modes:
            outcome = measure({"cold_start": mode}, [plan["name"] for plan in plans])
            for plan in plans:
                rows.append({"mode": mode, "workload": plan["name"], **outcome[plan["name"]]})
    else:
        rows = _rounds(rounds, modes, base, plans, prompts, output_tokens)
        for mode in modes:  # the ablation reuses the pooled rows of the modes' own configurations
            results[key_of({"cold_start": mode})] = {row["workload"]: row for row in rows if row["mode"] == mode}
    ablation, notes = [], []
    if args.ablation:
        switch = layerwise_field()
        configs = [("cpu assist off, pinned host copies", {"cold_start": "ondemand"}),
                   ("cpu assist on, pinned host copies", {"cold_start": "cpu"})]
        if cuda:
            configs += [("cpu assist off, pageable host copies", {"cold_start": "ondemand", "pinned_host_bytes": 0}),
                        ("cpu assist on, pageable host copies", {"cold_start": "cpu", "pinned_host_bytes": 0}),
                        ("auto, pageable host copies", {"cold_start": "auto", "pinned_host_bytes": 0}),
                        ("auto, pageable host copies, layerwise=False (no streaming)",
                         {"cold_start": "auto", "pinned_host_bytes": 0, "layerwise": False})]
        else:
            notes.append("ablation: no pinned vs pageable rows on the CPU (the page pool is host memory)")
        if switch is None:
            notes.append("ablation: no layer-wise row: EngineConfig has no layer-wise takeover switch yet")
        else:
            default = next(f.default for f in dataclasses.fields(EngineConfig) if f.name == switch)
            configs += [(f"cpu assist on, {switch}={value}", {"cold_start": "cpu", switch: value})
                        for value in (default, not default)]
        for label, overrides in configs:
            outcome = measure(overrides, ["distinct"])["distinct"]
            ablation.append({"config": label, "overrides": overrides, "workload": "distinct", **outcome})
    for note in notes:
        print(note)
    for row in [*rows, *ablation]:
        row.pop("samples", None)
    report = {
        "version": 1, "kind": "bench-cold-start", "command": args.command_line, "machine": machine(device),
        "config": {"model_config": model, "requests": requests, "rate": rate, "adapters": list(adapter_counts),
                   "alpha": args.alpha, "prompt_tokens": prompt_tokens, "output_tokens": output_tokens,
                   "adapter_rank": rank, "adapter_targets": args.targets, "cpu_workers": args.cpu_workers,
                   "modes": list(modes), "registered_adapters": base["dummy_adapters"], "seed": args.seed,
                   "rounds": rounds, "pinned_host_bytes": base.get("pinned_host_bytes", "engine default"),
                   "primed": bool(getattr(args, "prime", True) and cuda)},
        "rows": rows,
        "ablation": ablation,
        "notes": ["times from each request's scheduled arrival (open loop), ms",
                  "tpot: (last token - first token) / (tokens - 1)", *notes],
    }
    header = ["mode", "workload", "done", "errors", "TTFT p50", "TTFT p90", "TTFT p99", "TPOT p50", "latency p50",
              "latency p90", "loads", "cpu-assisted"]
    print(markdown_table(header, [_table_row(r["mode"], r) for r in rows]))
    if ablation:
        print()
        print(markdown_table(["ablation (distinct adapters)"] + header[1:], [_table_row(a["config"], a) for a in ablation]))
    finish(args.out, report, lambda plt: _plot(plt, rows, [p["name"] for p in plans]))
    if all("error" in row for row in rows + ablation):  # nothing was measured: a failure, whatever the table says
        raise BadRequest(f"no engine could be built: {rows[0]['error']}")
    return report


def _rounds(rounds: int, modes, base: dict, plans: list[dict], prompts: list, output_tokens: int) -> list[dict]:
    """Every mode `rounds` times, a fresh engine each time, in the order of `modes` in even rounds and
    reversed in odd ones (A B, B A, ...: drift over the run falls on every mode alike). Each row pools its
    mode's requests over the rounds (the same arrivals, adapters and prompts every round) and lists each
    round's mean TTFT under `rounds`."""
    outcomes: dict[str, list[dict]] = {mode: [] for mode in modes}
    for number in range(rounds):
        order = list(modes) if number % 2 == 0 else list(reversed(modes))
        print(f"round {number + 1} of {rounds}: {', '.join(order)}")
        for mode in order:
            outcomes[mode].append(_run_engine({**base, "cold_start": mode}, plans, prompts, output_tokens))
    rows = []
    for mode in modes:
        for plan in plans:
            rows.append({"mode": mode, **_pooled([outcome[plan["name"]] for outcome in outcomes[mode]])})
    return rows


def _pooled(parts: list[dict]) -> dict:
    """One row from the rows of several rounds of the same workload: summaries over every round's samples,
    counts summed, and each round's mean TTFT."""
    if any("error" in part for part in parts):
        return next(part for part in parts if "error" in part)
    first = parts[0]
    row = {key: first[key] for key in ("workload", "adapters_in_play", "distinct_adapters_used")}
    for key in ("requests", "completed", "errors", "wall_s"):
        row[key] = sum(part[key] for part in parts)
    row["error_examples"] = sorted({e for part in parts for e in part["error_examples"]})[:3]
    samples = {metric: [value for part in parts for value in part["samples"][metric]] for metric in first["samples"]}
    row.update({metric: summary(values) for metric, values in samples.items()})
    row["throughput_rps"] = row["completed"] / row["wall_s"]
    engines = [part["engine"] for part in parts]
    row["engine"] = {key: _summed([engine[key] for engine in engines]) for key in engines[0]}
    for key in ("engine_build_s", "engine_warmup_s"):
        row[key] = sum(part[key] for part in parts) / len(parts)
    row["rounds"] = [{"ttft_mean_ms": part["ttft_ms"]["mean"], "tpot_mean_ms": part["tpot_ms"]["mean"],
                      "cpu_assisted_prefills": part["engine"]["cpu_assisted_prefills"]} for part in parts]
    row["samples"] = samples
    return row


def _summed(values: list):
    """Counters of several rounds added up (dicts key by key; None where any round has None)."""
    if any(value is None for value in values):
        return None
    if isinstance(values[0], dict):
        return {key: sum(value.get(key, 0) for value in values) for key in {k for value in values for k in value}}
    return sum(values)


def _table_row(label: str, row: dict) -> list:
    if "error" in row:
        return [label, row["workload"], 0, row["error"]] + [None] * 8
    return [label, row["workload"], row["completed"], row["errors"], row["ttft_ms"]["median"], row["ttft_ms"]["p90"],
            row["ttft_ms"]["p99"], row["tpot_ms"]["median"], row["latency_ms"]["median"], row["latency_ms"]["p90"],
            row["engine"]["adapter_loads"], row["engine"]["cpu_assisted_prefills"]]


def _run_engine(config_fields: dict, plans: list[dict], prompts: list, output_tokens: int) -> dict:
    """One engine for `config_fields`, each plan run through it; {plan name: row}. An engine that cannot
    be built (cached with more adapters than the pool holds, say) gives every plan a row with its error."""
    from lorad.daemon.engine.engine import Engine

    label = ", ".join(f"{k}={v}" for k, v in config_fields.items() if k in ("cold_start", "pinned_host_bytes") or "layer" in k)
    started = time.perf_counter()
    try:
        engine = Engine(EngineConfig(**config_fields))
    except LoradError as error:
        print(f"engine {label}: cannot be built: {error.message}")
        return {plan["name"]: {"error": error.message} for plan in plans}
    out = {}
    try:
        build_s = time.perf_counter() - started
        started, kernels = time.perf_counter(), compiled_kernels()
        _warm_up(engine, len(prompts[0]), output_tokens)
        warmup_s = time.perf_counter() - started
        warmup_kernels = None if kernels is None else compiled_kernels() - kernels
        print(f"engine {label}: built in {build_s:.1f} s, warmed up in {warmup_s:.1f} s "
              f"(kernel variants compiled in the warm-up: {warmup_kernels})")
        for plan in plans:
            _evict_idle(engine)
            out[plan["name"]] = _drive(engine, plan, prompts, output_tokens)
            out[plan["name"]]["engine_build_s"] = build_s
            out[plan["name"]]["engine_warmup_s"] = warmup_s
            out[plan["name"]]["engine_warmup_kernels_compiled"] = warmup_kernels
            print(f"engine {label}: {plan['name']} done in {out[plan['name']]['wall_s']:.1f} s "
                  f"(kernel variants compiled: {out[plan['name']]['engine']['kernels_compiled']})")
    finally:
        engine.close()
        del engine
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return out


def _warm_up(engine, prompt_tokens: int, output_tokens: int) -> None:
    """Compile and cache what the measured requests would otherwise pay for (Triton kernels per shape,
    decode graphs, allocator growth, first-use costs): prefills of several lengths without and with an
    adapter (cold, then warm), batched decodes, and in cpu/auto one CPU-assisted prefill (auto's costs
    are put back afterwards: the warm-up must not teach its online correction first-use times). The
    warm-up's adapters leave the pool afterwards."""
    from lorad.daemon.engine.request import GenerationRequest, SamplingParams

    sampling = SamplingParams(max_tokens=min(output_tokens, 4), temperature=0, ignore_eos=True)
    names = engine.registry.names()
    spare = [name for name in names if name.startswith("dummy-")][-3:]  # the least used by the workloads
    lengths = sorted({WARMUP_PROMPT, max(1, prompt_tokens // 2), prompt_tokens})
    for length in lengths:
        for adapter in (None, spare[0], spare[0]):
            engine.generate([GenerationRequest([1 + length % 7] * length, adapter=adapter, sampling=sampling)])
    # Batches as the workloads form them: several requests, some on adapters, decoding together.
    engine.generate([GenerationRequest([2] * prompt_tokens, adapter=adapter, sampling=sampling)
                     for adapter in (None, *spare, None)])
    # One adapter of every weight set: the dummy adapters share a few weight sets, and the first load of a
    # set stages and pins its pages (60-190 ms on the H100 host). Unwarmed, that cost fell on the first
    # request of one set in every engine (the distinct workload's first, dummy-0), a different size each
    # time: the noise of the distinct workload's mean TTFT. Each later load is the pinned tier's copy.
    staged = {id(engine.residency.lookup(name).weights) for name in spare}
    for name in names:
        weights = id(engine.residency.lookup(name).weights)
        if weights not in staged:
            staged.add(weights)
            engine.generate([GenerationRequest([4] * WARMUP_PROMPT, adapter=name, sampling=sampling)])
    if engine.cold_starts.cpu_assist is not None:
        saved = engine.cold_starts.costs
        if saved is not None:  # auto: a tier too slow to wait for makes the next cold start cpu-assisted
            engine.cold_starts.costs = dataclasses.replace(saved, load_bytes_per_s=dict.fromkeys(saved.load_bytes_per_s, 1.0))
        _evict_idle(engine)
        assisted = engine.cold_starts.cpu_assist.assisted
        try:
            for adapter in spare[1:]:
                engine.generate([GenerationRequest([3] * prompt_tokens, adapter=adapter, sampling=sampling)])
        finally:
            if saved is not None:
                engine.cold_starts.costs = dataclasses.replace(
                    saved, prefill_ms_per_token=engine.cold_starts.costs.prefill_ms_per_token)
        if engine.cold_starts.cpu_assist.assisted == assisted:
            raise RuntimeError("the warm-up's cold requests were not CPU-assisted")
    _evict_idle(engine)


def _evict_idle(engine) -> None:
    """Every adapter no request holds leaves the pool (cached mode's are held for good and stay)."""
    engine.residency.reclaim(engine.pool.capacity + 1)


def compiled_kernels() -> int | None:
    """Kernel variants the process holds for lorad's Triton kernels (compiled or loaded from the disk
    cache; one per specialisation: constexprs, integer and alignment specialisations), or None
    without Triton. A count that moves during a workload means it paid JIT compiles in the engine
    thread, which the first engine of the process does for every variant its warm-up missed."""
    import sys

    try:
        from triton.runtime.jit import JITFunction
    except ImportError:
        return None
    total = 0
    for name, module in list(sys.modules.items()):
        if not name.startswith("lorad.gpu_ops") or module is None:
            continue
        for value in vars(module).values():
            if isinstance(value, JITFunction):
                caches = getattr(value, "device_caches", None)  # triton >= 3.0: device -> (kernel_cache, ...)
                if caches is not None:
                    total += sum(len(entry[0]) for entry in caches.values())
                else:  # older triton: device -> {key: kernel}
                    total += sum(len(cache) for cache in getattr(value, "cache", {}).values())
    return total


def _counters(engine) -> dict:
    assist = engine.cold_starts.cpu_assist
    return {
        "adapter_loads": engine.residency.loads,
        "cpu_assisted_prefills": assist.assisted if assist is not None else 0,
        "cpu_assist_fallbacks": assist.fallbacks if assist is not None else 0,
        "decisions": dict(engine.cold_starts.decisions),
        "kernels_compiled": compiled_kernels(),
        "stream_steps": engine.cold_starts.stream_steps["steps"],
        "stream_step_s": engine.cold_starts.stream_steps["seconds"],
        "stream_issue_s": engine.residency.issue_seconds,
        "streamed_ahead": engine.residency.streamed_ahead,
        "ahead_layers": engine.residency.ahead_layers,
        "ahead_issue_s": engine.residency.ahead_seconds,
    }


def _drive(engine, plan: dict, prompts: list, output_tokens: int) -> dict:
    from lorad.daemon.engine.request import GenerationRequest, SamplingParams

    sampling = SamplingParams(max_tokens=output_tokens, temperature=0, ignore_eos=True)
    records = [Record(float(at), f"dummy-{int(index)}") for at, index in zip(plan["arrivals"], plan["adapters"])]
    before = _counters(engine)
    start = time.perf_counter()
    submitted = finished = 0
    while finished < len(records):
        now = time.perf_counter() - start
        if now > RUN_TIMEOUT_S:
            raise RuntimeError(f"workload {plan['name']}: {len(records) - finished} requests unfinished after {RUN_TIMEOUT_S} s")
        while submitted < len(records) and records[submitted].arrival <= now:
            record = records[submitted]
            engine.submit(GenerationRequest(prompts[submitted], adapter=record.adapter, sampling=sampling,
                                            on_output=record.on_output))
            submitted += 1
        if submitted > finished:
            engine.step()
        else:  # idle until the next arrival
            time.sleep(max(0.0, records[submitted].arrival - (time.perf_counter() - start)))
        finished = sum(record.done is not None for record in records)
    wall = time.perf_counter() - start
    after = _counters(engine)
    good = [r for r in records if r.error is None and r.first is not None]
    ttft = [(r.first - start - r.arrival) * 1e3 for r in good]
    tpot = [(r.done - r.first) * 1e3 / (r.generated - 1) for r in good if r.generated > 1]
    latency = [(r.done - start - r.arrival) * 1e3 for r in good]
    errors = [r.error for r in records if r.error is not None]
    return {
        "workload": plan["name"], "adapters_in_play": plan["adapters_in_play"],
        "distinct_adapters_used": len({r.adapter for r in records}), "requests": len(records),
        "completed": len(good), "errors": len(errors), "error_examples": sorted(set(errors))[:3],
        "ttft_ms": summary(ttft), "tpot_ms": summary(tpot), "latency_ms": summary(latency), "wall_s": wall,
        "samples": {"ttft_ms": ttft, "tpot_ms": tpot, "latency_ms": latency},  # for pooled rounds; not reported
        "throughput_rps": len(good) / wall,
        "engine": {
            "adapter_loads": after["adapter_loads"] - before["adapter_loads"],
            "cpu_assisted_prefills": after["cpu_assisted_prefills"] - before["cpu_assisted_prefills"],
            "cpu_assist_fallbacks": after["cpu_assist_fallbacks"] - before["cpu_assist_fallbacks"],
            "decisions": {k: v - before["decisions"].get(k, 0) for k, v in after["decisions"].items()},
            # New Triton kernel variants during the workload (None without Triton): JIT compiles in the step loop.
            "kernels_compiled": None if before["kernels_compiled"] is None
            else after["kernels_compiled"] - before["kernels_compiled"],
            # steps run while adapters streamed in (gpu-stream): their number, wall time, and the host's time
            # issuing the copies in them (after each graph's launch); totals, so that rounds add up
            "stream_steps": after["stream_steps"] - before["stream_steps"],
            "stream_steps_ms": (after["stream_step_s"] - before["stream_step_s"]) * 1e3,
            "stream_issue_ms": (after["stream_issue_s"] - before["stream_issue_s"]) * 1e3,
            # adapters streamed ahead of their admission, their layers queued then, the host's time on it
            "streamed_ahead": after["streamed_ahead"] - before["streamed_ahead"],
            "ahead_layers": after["ahead_layers"] - before["ahead_layers"],
            "ahead_issue_ms": (after["ahead_issue_s"] - before["ahead_issue_s"]) * 1e3,
        },
    }


def _plot(plt, rows: list[dict], workload_names: list[str]):
    figure, axes = plt.subplots(1, 3, figsize=(14, 4))
    modes = list(dict.fromkeys(r["mode"] for r in rows))
    width = 0.8 / max(1, len(modes))
    for axis, (metric, title) in zip(axes, (("ttft_ms", "TTFT p50 (ms)"), ("tpot_ms", "time per token p50 (ms)"),
                                            ("latency_ms", "request latency p50 (ms)"))):
        for index, mode in enumerate(modes):
            values = []
            for name in workload_names:
                row = next(r for r in rows if r["mode"] == mode and r["workload"] == name)
                values.append(row[metric]["median"] if "error" not in row and row[metric]["median"] is not None else 0)
            axis.bar(np.arange(len(workload_names)) + index * width, values, width, label=mode)
        axis.set_xticks(np.arange(len(workload_names)) + width * (len(modes) - 1) / 2, workload_names, fontsize=8)
        axis.set_title(title)
        axis.grid(alpha=0.3, axis="y")
    axes[0].legend()
    return figure
