"""What the sampler launches in one overlapped greedy decode step, against plain greedy: the torch ops dispatched
per step (each a kernel launch or more on a GPU; Triton kernels counted apart) and the host's time per step, for
`--rows` rows that each ask for presence and frequency penalties, a repetition penalty, 8 logit_bias entries and 5
logprobs (bench/engine_decode.py's PROCESSED), prompts of `--prompt` tokens, a 32000-token vocabulary.

    python3 bench/sampler_step.py                   # on the CPU: op counts, host ms per step, cProfile's top
    python3 bench/sampler_step.py --device cuda     # on a GPU (host ms with the wait for the device), and the
                                                    # kernels and copies a step launches, with their device time
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import statistics
import time
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from lorad.daemon.engine.request import SamplingParams
from lorad.daemon.engine.sampler import History, LogprobCopies
from lorad.daemon.engine.sampler_state import SamplerState

PROCESSED = {"presence_penalty": 0.5, "frequency_penalty": 0.5, "repetition_penalty": 1.1,
             "logit_bias": tuple((token, 5.0) for token in range(0, 8000, 1000)), "logprobs": 5}


class OpCounter(TorchDispatchMode):
    """Counts the aten ops dispatched (a device kernel each, at least, bar views and metadata ops)."""

    def __init__(self):
        super().__init__()
        self.ops = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func.overloadpacket.__name__)] += 1
        return func(*args, **(kwargs or {}))


VIEWS = {"view", "_unsafe_view", "slice", "select", "unsqueeze", "squeeze", "t", "transpose", "expand", "alias",
         "detach", "as_strided", "_reshape_alias", "lift_fresh", "lift_fresh_copy"}


class Decode:
    """The sampler's side of an overlapped greedy decode step of `rows` rows (engine._launch_tokens, then
    _finish_step_in_flight's reads), on logits made once."""

    def __init__(self, rows: int, prompt: int, vocab: int, device: torch.device, processed: bool,
                 kernels: bool | None = None):
        generator = torch.Generator().manual_seed(0)
        self.device, self.processed = device, processed
        self.params = [SamplingParams(temperature=0, max_tokens=1 << 20, **(PROCESSED if processed else {}))] * rows
        self.logits = torch.randn(rows, vocab, generator=generator).to(device)
        self.rows = list(range(rows))
        self.state = SamplerState(vocab, device, max_banned=2, **({} if kernels is None else {"kernels": kernels}))
        self.launches = Counter()  # Triton's, which the dispatch counter does not see
        if getattr(self.state, "kernels", False):
            for name in ("_process", "_advance"):
                setattr(self.state, name, self._counted(name, getattr(self.state, name)))
        if processed:
            self.state.admit((row, p, History(torch.randint(0, vocab, (prompt,), generator=generator).tolist(), [], (2,)))
                             for row, p in enumerate(self.params))
        self.copies = LogprobCopies(rows, pin=device.type == "cuda")
        self.host = torch.zeros(rows, dtype=torch.long, pin_memory=device.type == "cuda")

    def _counted(self, name, launch):
        def counted(*args, **kwargs):
            self.launches[name.strip("_") + " (triton)"] += 1
            with _disable_current_modes():  # the interpreter's own tensor work is not the launch's
                return launch(*args, **kwargs)
        return counted

    def step(self) -> None:
        logits = self.logits.clone()  # the forward's fresh logits (one op, in both counts)
        processed = self.state.process(logits, self.rows, self.rows) if self.processed else None
        tokens = logits.argmax(dim=-1)
        if processed is not None:
            self.state.advance(processed, tokens)
        pending = self.copies.launch(logits, self.params, tokens, argmax=True)
        self.host.copy_(tokens, non_blocking=True)
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        if pending is not None:
            pending.read()
        self.host.tolist()


def measure(decode: Decode, steps: int) -> dict:
    for _ in range(3):
        decode.step()
    decode.launches.clear()
    with OpCounter() as counter:
        decode.step()
    ops = dict(sorted((counter.ops + decode.launches).items()))
    times = []
    for _ in range(steps):
        started = time.perf_counter()
        decode.step()
        times.append((time.perf_counter() - started) * 1e3)
    result = {"ops": ops, "ops_total": sum(ops.values()),
              "ops_not_views": sum(n for name, n in ops.items() if name not in VIEWS),
              "host_ms_per_step": statistics.median(times)}
    if decode.device.type == "cuda":
        result.update(device_work(decode))
    return result


def device_work(decode: Decode, steps: int = 8) -> dict:
    """On a GPU: the kernels and copies a step puts on the device, their count and device time (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            decode.step()
    kernels = Counter()
    device_us = 0.0
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            kernels[event.name[:80]] += 1
            device_us += event.device_time_total
    return {"device_launches_per_step": sum(kernels.values()) / steps, "device_us_per_step": device_us / steps,
            "device_launches": {name: n / steps for name, n in kernels.most_common()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--steps", type=int, default=48)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--profile", action="store_true", help="print cProfile's top functions of the processed steps")
    parser.add_argument("--kernels", choices=("auto", "on", "off"), default="auto",
                        help="SamplerState's Triton kernels (auto: on cuda only; on without a GPU: Triton's interpreter, "
                             "whose host time says nothing)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    device = torch.device(args.device)
    kernels = {"auto": None, "on": True, "off": False}[args.kernels]
    result = {"device": args.device, "rows": args.rows, "prompt": args.prompt, "vocab": args.vocab, "steps": args.steps}
    for name in ("greedy", "processed"):
        result[name] = measure(Decode(args.rows, args.prompt, args.vocab, device, name == "processed", kernels), args.steps)
    print(json.dumps(result, indent=1))
    if args.profile:
        decode = Decode(args.rows, args.prompt, args.vocab, device, True, kernels)
        decode.step()
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(args.steps):
            decode.step()
        profiler.disable()
        pstats.Stats(profiler).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()
