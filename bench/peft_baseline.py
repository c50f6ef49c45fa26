"""The transformers + PEFT baseline of S-LoRA's evaluation, on the workload of bench/slora_workload.py.

A server loop in the style S-LoRA compared against: requests wait in a queue; whenever the model is
free, up to --max-batch waiting requests run together through `generate` with PEFT's mixed-adapter
batching (`adapter_names`), until the longest of them is done. Random 7B-shaped weights, drawn on the
GPU; n random rank-8 adapters on q, k, v, o.

    python3 bench/peft_baseline.py --adapters 100 --requests 48 --out bench/results/peft_baseline.json
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from lorad.daemon.model.checkpoint import MODEL_CONFIGS
from slora_workload import slora_trace  # bench/, beside this script


def build(model_config: str, adapters: int, rank: int, device: str = "cuda"):
    from peft import LoraConfig, get_peft_model
    from peft.tuners.lora import LoraLayer
    from transformers import LlamaConfig, LlamaForCausalLM

    shape = {k: v for k, v in MODEL_CONFIGS[model_config].items() if k not in ("architectures", "torch_dtype")}
    torch.set_default_dtype(torch.bfloat16 if device == "cuda" else torch.float32)
    with torch.device(device):
        model = LlamaForCausalLM(LlamaConfig(**shape))
        # init_lora_weights=False: random B, so every adapter changes the output as a trained one would.
        lora = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                          init_lora_weights=False)
        model = get_peft_model(model, lora, adapter_name="a0")
        # PeftModel.add_adapter re-walks the whole model each time (quadratic in adapters: ~3 minutes for
        # 100 on the 7B shape); adding each adapter to the LoRA layers directly is what it does per layer.
        layers = [module for module in model.modules() if isinstance(module, LoraLayer)]
        for index in range(1, adapters):
            model.peft_config[f"a{index}"] = lora
            for layer in layers:
                layer.update_layer(f"a{index}", lora.r, lora.lora_alpha, config=lora)
    model.eval()
    return model


@torch.no_grad()
def serve(model, trace, vocab: int, max_batch: int, budget_s: float | None = None) -> dict:
    """Serves the trace; past `budget_s` the batch in flight stops where it is and no new one starts.
    Useful tokens: each request's own output tokens generated (a batch runs to its longest member; the
    extra steps of the shorter ones are waste, as in S-LoRA's baseline)."""
    from transformers import StoppingCriteria, StoppingCriteriaList

    class Deadline(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            out_of_time = budget_s is not None and time.perf_counter() - started > budget_s
            return torch.full((input_ids.shape[0],), out_of_time, dtype=torch.bool, device=input_ids.device)

    generator = torch.Generator().manual_seed(0)
    index = {name: i for i, name in enumerate(sorted(trace.adapter_ranks))}
    waiting, pending, done = [], list(trace.requests), 0
    tokens = 0
    started = time.perf_counter()
    while pending or waiting:
        now = time.perf_counter() - started
        if budget_s is not None and now > budget_s:
            break
        while pending and pending[0].arrival_s <= now:
            waiting.append(pending.pop(0))
        if not waiting:
            time.sleep(0.001)
            continue
        batch, waiting = waiting[:max_batch], waiting[max_batch:]
        width = max(r.prompt_tokens for r in batch)
        ids = torch.zeros(len(batch), width, dtype=torch.long)
        mask = torch.zeros(len(batch), width, dtype=torch.long)
        for row, request in enumerate(batch):  # left padding
            ids[row, width - request.prompt_tokens :] = torch.randint(0, vocab, (request.prompt_tokens,), generator=generator)
            mask[row, width - request.prompt_tokens :] = 1
        new = max(r.output_tokens for r in batch)
        batch_started = time.perf_counter()
        output = model.generate(
            input_ids=ids.to(model.device), attention_mask=mask.to(model.device), adapter_names=[f"a{index[r.adapter]}" for r in batch],
            max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0,
            stopping_criteria=StoppingCriteriaList([Deadline()]),
        )
        steps = output.shape[1] - width
        done += sum(r.output_tokens <= steps for r in batch)
        tokens += sum(min(r.output_tokens, steps) for r in batch)
        print(json.dumps({"batch": len(batch), "distinct_adapters": len({r.adapter for r in batch}), "steps": steps,
                          "of": new, "seconds": time.perf_counter() - batch_started}), flush=True)
    elapsed = time.perf_counter() - started
    return {"requests": done, "unserved": len(pending) + len(waiting), "seconds": elapsed,
            "throughput_req_s": done / elapsed, "tokens_s": tokens / elapsed, "useful_tokens": tokens}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-config", default="llama-2-7b")
    parser.add_argument("--adapters", type=int, default=100)
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--rate", type=float, default=20.0)
    parser.add_argument("--trace-requests", type=int, default=400, help="bench/slora_workload.py's --requests")
    parser.add_argument("--max-batch", type=int, default=32)
    parser.add_argument("--budget-s", type=float, default=None, help="take no new batch after this many seconds")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out")
    args = parser.parse_args()
    built = time.perf_counter()
    model = build(args.model_config, args.adapters, 8, args.device)
    build_s = time.perf_counter() - built
    print(json.dumps({"built_s": build_s}), flush=True)
    # The requests of bench/slora_workload.py's S1 run at the same n (same trace, same lengths); this
    # baseline serves the first --requests of them.
    trace = slora_trace(args.adapters, [8], args.trace_requests, args.rate, seed=args.adapters)
    trace.requests = trace.requests[: args.requests]
    result = {"system": "transformers+peft", "machine": torch.cuda.get_device_name() if args.device == "cuda" else "cpu", "model": args.model_config,
              "adapters": args.adapters, "max_batch": args.max_batch, "build_s": build_s,
              **serve(model, trace, MODEL_CONFIGS[args.model_config]["vocab_size"], args.max_batch, args.budget_s)}
    print(json.dumps(result))
    if args.out:
        with open(args.out, "w") as handle:
            json.dump(result, handle, indent=1)


if __name__ == "__main__":
    main()
