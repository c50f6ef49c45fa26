"""Decode throughput and latency of the whole engine on a GPU, against the baselines measured in the
same run: the same engine serving the base model alone, the memory-bandwidth floor, and the pinned
host->GPU copy bandwidth for adapter loads (BENCHMARKS.md's figures 3.3, 3.4 and 3.5).

    python3 bench/engine_decode.py --model-config llama-2-7b --out bench/results/engine_decode.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from lorad.config import EngineConfig
from lorad.daemon.model.checkpoint import PROJECTIONS
from lorad.daemon.engine.engine import Engine
from lorad.daemon.engine.request import GenerationRequest, SamplingParams


def device_copy_bandwidth(nbytes: int = 1 << 30) -> float:
    """Bytes read plus bytes written per second of a large device-to-device copy."""
    src = torch.randn(nbytes // 2, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    return 2 * nbytes / median_ms(lambda: dst.copy_(src)) * 1e3


def pinned_h2d_bandwidth(nbytes: int = 100 << 20) -> float:
    src = torch.randn(nbytes // 2, dtype=torch.bfloat16).pin_memory()
    dst = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda")
    return nbytes / median_ms(lambda: dst.copy_(src, non_blocking=True)) * 1e3


def median_ms(fn, repeats: int = 20) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def start_decoding(engine: Engine, adapters: list[str | None], prompt_len: int, decode_steps: int, sampling: dict | None = None) -> list[GenerationRequest]:
    """len(adapters) requests of random prompts, prefilled and 3 decode steps in: from here each of the next
    `decode_steps` steps decodes them all. Their max_tokens covers the steps their admission takes too (at most
    max_batch_tokens prompt and decode tokens a step), so the first admitted cannot end while later steps are
    timed and shrink the batch. sampling: SamplingParams fields beside greedy's (None: plain greedy). The adapters
    are placed in the pool first: admitted cold, their requests would join one by one while the stager stages each
    (the engine runs the others' steps meanwhile)."""
    for name in set(adapters) - {None}:
        if not engine.residency.preload(name):
            raise RuntimeError(f"adapter {name} does not fit in the pool")
    budget = max(1, engine.config.max_batch_tokens - len(adapters))  # prompt tokens a step, beside the decode rows
    join_steps = -(-len(adapters) * prompt_len // budget) + 4
    generator = torch.Generator().manual_seed(len(adapters))
    sampling = SamplingParams(**{"temperature": 0, **(sampling or {})}, max_tokens=join_steps + 4 + decode_steps,
                              ignore_eos=True)
    requests = [
        GenerationRequest(torch.randint(0, engine.vocab_size, (prompt_len,), generator=generator).tolist(), adapter=a, sampling=sampling)
        for a in adapters
    ]
    for request in requests:
        engine.submit(request)
    steps = 0
    while len(engine.scheduler.running) < len(requests) or any(s.num_generated == 0 for s in engine.scheduler.running):
        engine.step()
        steps += 1
        if steps > join_steps:  # the first admitted would end before `decode_steps` more steps of them all
            raise RuntimeError(f"{len(engine.scheduler.running)} of {len(requests)} requests running after {steps} steps")
    for _ in range(3):  # warm
        engine.step()
    return requests


def decode_rate(engine: Engine, adapters: list[str | None], prompt_len: int, steps: int, sampling: dict | None = None) -> tuple[float, float]:
    """(tokens/s, ms per step) over `steps` decode steps of len(adapters) running requests."""
    requests = start_decoding(engine, adapters, prompt_len, steps, sampling)
    torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(steps):
        engine.step()
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - started
    if len(engine.scheduler.running) < len(requests):  # a step timed with fewer rows than the figure says
        raise RuntimeError(f"{len(requests) - len(engine.scheduler.running)} of {len(requests)} requests ended during the timed steps")
    for request in requests:
        engine.abort(request.request_id)
    engine.step()
    assert not engine.scheduler.has_work()
    return len(requests) * steps / elapsed, elapsed / steps * 1e3


def step_breakdown(engine: Engine, adapters: list[str | None], prompt_len: int, steps: int = 32) -> dict:
    """Where a decode step's wall time goes: the graph's device time alone (its replays back to back),
    the host's phases of `engine.step()` (forward launch, sampling = the wait for the device, the rest),
    and the kernels of a few steps by device time (torch.profiler sees inside graph replays)."""
    import lorad.daemon.engine.engine as engine_module

    requests = start_decoding(engine, adapters, prompt_len, steps + 61)
    phases = {"forward": [], "sample": [], "step": []}
    forward, sample = engine.runner.forward, engine_module.sample

    def timed(name, fn):
        def wrapper(*args, **kwargs):
            started = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                phases[name].append((time.perf_counter() - started) * 1e3)
        return wrapper

    engine.runner.forward, engine_module.sample = timed("forward", forward), timed("sample", sample)
    overlap, engine.overlap_decode = engine.overlap_decode, False  # the host's phases one after the other
    try:
        torch.cuda.synchronize()
        for _ in range(steps):
            started = time.perf_counter()
            engine.step()
            phases["step"].append((time.perf_counter() - started) * 1e3)
    finally:
        del engine.runner.forward
        engine_module.sample = sample
        engine.overlap_decode = overlap
    result = {name: statistics.median(values) for name, values in phases.items()}
    result["rest"] = result["step"] - result["forward"] - result["sample"]
    graphs = engine.runner.graphs
    if graphs is not None:
        graph, _ = graphs.graphs[graphs.last_key]
        result["graph"] = list(graphs.last_key)
        result["graph_replay_ms"] = median_ms(graph.replay, repeats=30)
    try:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(4):
                engine.step()
            torch.cuda.synchronize()
        kernels = {}
        for event in prof.key_averages():
            device_us = getattr(event, "device_time_total", None) or getattr(event, "cuda_time_total", 0)
            if device_us and event.key and not event.key.startswith(("aten::", "cuda", "Memcpy", "ProfilerStep")):
                kernels[event.key] = (device_us / 4 / 1e3, event.count / 4)
        top = sorted(kernels.items(), key=lambda item: -item[1][0])[:25]
        result["kernels_ms_per_step"] = [{"kernel": name[:120], "ms": ms, "calls": calls} for name, (ms, calls) in top]
        result["kernel_ms_per_step_total"] = sum(ms for ms, _ in kernels.values())
    except Exception as error:  # a diagnostic: its absence must not cost the run's figures
        result["profiler_error"] = repr(error)
    for request in requests:
        engine.abort(request.request_id)
    engine.step()
    return result


def adapter_load(engine: Engine, rank: int, targets: tuple[str, ...], repeats: int = 10) -> dict:
    """Time for a staged (pinned) adapter to reach the pool: one side-stream copy plus the page scatter."""
    spec = engine.spec
    weights = {}
    for layer in range(spec.num_layers):
        for projection in targets:
            fan_in, fan_out = spec.projection_shape(projection)
            weights[(layer, PROJECTIONS.index(projection))] = (torch.randn(rank, fan_in), torch.randn(fan_out, rank))
    staged = engine.table.stage(weights)
    slot = engine.table.free_slot()
    times, host = [], []
    for _ in range(repeats + 1):
        torch.cuda.synchronize()
        started = time.perf_counter()
        assert engine.table.place(slot, staged)
        returned = time.perf_counter()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - started) * 1e3)
        host.append((returned - started) * 1e3)
        engine.table.evict(slot)
    # ms: until the adapter is in the pool; host_ms: until place() returns (the engine goes on meanwhile)
    return {"bytes": staged.pages.nbytes, "ms": statistics.median(times[1:]), "host_ms": statistics.median(host[1:])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-config", default="llama-2-7b")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--prompt", type=int, default=128, help="prompt tokens of the batch-1 run")
    parser.add_argument("--prompts", type=lambda text: [int(x) for x in text.split(",")], default=[128, 512],
                        help="prompt lengths of the batch runs")
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--breakdown-batch", action="store_true", help="also break down a step of the LoRA batch")
    parser.add_argument("--no-fuse-lora-groups", action="store_true",
                        help="the engine's fuse_lora_groups off: one decode LoRA launch pair per projection")
    parser.add_argument("--lora-pdl", default="auto", help="the engine's lora_pdl: auto|on|off")
    parser.add_argument("--sampler-overhead", action="store_true",
                        help="only the sampler figure: decode steps of --batch rows with penalties, logit_bias and "
                             "logprobs against plain greedy, alternated over rounds")
    parser.add_argument("--out")
    args = parser.parse_args()

    engine = Engine(EngineConfig(
        model_config=args.model_config, dummy_weights=True, dummy_adapters=args.batch, dummy_adapter_rank=args.rank,
        dummy_adapter_targets=",".join(PROJECTIONS), device="cuda", dtype="bfloat16",
        max_running_requests=args.batch, max_batch_tokens=max(2048, args.batch * max(args.prompts)), max_lora_rank=max(64, args.rank),
        max_model_len=2048, fuse_lora_groups=not args.no_fuse_lora_groups, lora_pdl=args.lora_pdl,
    ))
    if args.sampler_overhead:
        return sampler_overhead(engine, args)
    hbm = device_copy_bandwidth()
    pinned = pinned_h2d_bandwidth()
    load = adapter_load(engine, 64, ("q_proj", "k_proj", "v_proj"))  # into a fresh pool: one run of pages
    weight_bytes = sum(t.nbytes for name, t in _model_tensors(engine))
    spec = engine.spec
    lora_bytes = args.batch * spec.num_layers * args.rank * 2 * sum(sum(spec.projection_shape(p)) for p in PROJECTIONS)
    decode = []
    for prompt in args.prompts:
        base_rate, base_ms = decode_rate(engine, [None] * args.batch, prompt, args.steps)
        lora_rate, lora_ms = decode_rate(engine, [f"dummy-{i}" for i in range(args.batch)], prompt, args.steps)
        context = prompt + args.steps // 2  # mean context over the timed steps
        kv_bytes = args.batch * context * spec.num_layers * 2 * spec.kv_size * 2
        decode.append({
            "prompt": prompt, "base_tok_s": base_rate, "lora_tok_s": lora_rate, "lora_over_base": lora_rate / base_rate,
            "base_step_ms": base_ms, "lora_step_ms": lora_ms,
            "base_floor_ms": (weight_bytes + kv_bytes) / hbm * 1e3,
            "lora_floor_ms": (weight_bytes + kv_bytes + lora_bytes) / hbm * 1e3,
            "ratio_at_floor": (weight_bytes + kv_bytes) / (weight_bytes + kv_bytes + lora_bytes),
        })
    _, single_ms = decode_rate(engine, [None], args.prompt, args.steps)
    overlap, engine.overlap_decode = engine.overlap_decode, False
    _, single_plain_ms = decode_rate(engine, [None], args.prompt, args.steps)  # each step waits for its tokens
    engine.overlap_decode = overlap
    breakdown = {"batch1_base": step_breakdown(engine, [None], args.prompt)}
    if args.breakdown_batch:
        breakdown["batch_lora"] = step_breakdown(engine, [f"dummy-{i}" for i in range(args.batch)], args.prompt)
    print(json.dumps(breakdown, indent=1))
    floor_ms = weight_bytes / hbm * 1e3
    load_floor_ms = load["bytes"] / pinned * 1e3
    result = {
        "machine": torch.cuda.get_device_name(), "torch": torch.__version__, "model": args.model_config,
        "ops": engine.runner.ops.name, "cuda_graph_steps": engine.runner.graph_steps, "decode_lora_groups": engine.runner.lora_groups,
        "decode_lora_pdl": engine.runner.lora_pdl,
        # which decode LoRA kernel the steps ran (a profile at the default path picks it per step), and from what
        "lora_kernel_choice": engine.kernel_choice.describe(), "lora_kernel_steps": dict(engine.kernel_choice.steps),
        "hbm_copy_GBps": hbm / 1e9, "pinned_h2d_GBps": pinned / 1e9,
        "decode": {"batch": args.batch, "rank": args.rank, "targets": "all seven", "steps": args.steps,
                   "lora_bytes_per_step": lora_bytes, "by_prompt": decode},
        "overlap_decode": engine.overlap_decode, "overlapped_steps": engine.overlapped_steps,
        "batch1": {"step_ms": single_ms, "weight_bytes": weight_bytes, "floor_ms": floor_ms, "over_floor": single_ms / floor_ms,
                   "plain_step_ms": single_plain_ms, "plain_over_floor": single_plain_ms / floor_ms},
        "breakdown": breakdown,
        "adapter_load": {"rank": 64, "targets": "q,k,v", **load, "floor_ms": load_floor_ms, "over_floor": load["ms"] / load_floor_ms},
    }
    print(json.dumps(result, indent=1))
    if args.out:
        with open(args.out, "w") as handle:
            json.dump(result, handle, indent=1)


# Every logits-processing option at once, as a client could send them (OpenAI's penalties and bias, HF's
# repetition penalty, 5 top logprobs per token): the sampler's most expensive row.
PROCESSED = {"presence_penalty": 0.5, "frequency_penalty": 0.5, "repetition_penalty": 1.1,
             "logit_bias": tuple((token, 5.0) for token in range(0, 8000, 1000)), "logprobs": 5}


def sampler_overhead(engine: Engine, args) -> None:
    """Decode step time with every row processed (PROCESSED) against plain greedy, same rows and prompts,
    in alternating rounds (A B B A ...) so drift hits both alike. Beside it, per overlapped step, the host's time
    launching the step's sampling (engine._launch_tokens) and waiting for the step in flight: a wait near zero
    means the host, not the device, sets the pace."""
    prompt = args.prompts[-1]
    times = {"greedy": [], "processed": []}
    host = {name: {"launch_tokens": [], "wait": []} for name in times}
    launch_tokens, wait = engine._launch_tokens, torch.cuda.Event.synchronize
    current = host["greedy"]

    def timed_launch(*positional, **named):
        started = time.perf_counter()
        try:
            return launch_tokens(*positional, **named)
        finally:
            current["launch_tokens"].append((time.perf_counter() - started) * 1e3)

    def timed_wait(event):
        started = time.perf_counter()
        wait(event)
        current["wait"].append((time.perf_counter() - started) * 1e3)

    engine._launch_tokens, torch.cuda.Event.synchronize = timed_launch, timed_wait
    try:
        for name in ("greedy", "processed", "processed", "greedy", "greedy", "processed"):
            current = host[name]
            _, ms = decode_rate(engine, [None] * args.batch, prompt, args.steps, PROCESSED if name == "processed" else None)
            times[name].append(ms)
    finally:
        del engine._launch_tokens
        torch.cuda.Event.synchronize = wait
    greedy, processed = statistics.median(times["greedy"]), statistics.median(times["processed"])
    result = {
        "machine": torch.cuda.get_device_name(), "torch": torch.__version__, "model": args.model_config,
        "batch": args.batch, "prompt": prompt, "steps": args.steps, "processed": {k: str(v) for k, v in PROCESSED.items()},
        "step_ms": times, "greedy_ms": greedy, "processed_ms": processed, "processed_over_greedy": processed / greedy,
        "overlap_decode": engine.overlap_decode,
        "host_ms_per_step": {name: {phase: statistics.median(values) if values else None for phase, values in phases.items()}
                             for name, phases in host.items()},
    }
    print(json.dumps(result, indent=1))
    if args.out:
        with open(args.out, "w") as handle:
            json.dump(result, handle, indent=1)


def _model_tensors(engine: Engine):
    """The weights a decode step reads (the embedding table is gathered, not streamed)."""
    model = engine.runner.model
    yield "lm_head", model.lm_head
    yield "norm", model.norm
    for index, layer in enumerate(model.layers):
        for name, value in vars(layer).items():
            if isinstance(value, torch.Tensor):
                yield f"{index}.{name}", value


if __name__ == "__main__":
    main()
