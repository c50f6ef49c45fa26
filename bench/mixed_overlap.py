"""Can a mixed step's two halves overlap on the GPU? Per layer of the 7B shape (bf16): the GEMMs of P prompt rows
(qkv, o, gate_up, down through cuBLAS: bound by the tensor cores) and the paged decode attention of 64 rows at
context C (lorad's kernel: bound by HBM); each alone, one after the other on one stream, and on two streams forked
and joined inside one CUDA graph. Also with the 64 decode rows' own GEMMs on the second stream (two nano-batches).
With `--carveouts`: the same with the prompt rows' GEMMs through cuBLASLt told to leave that many SMs free
(`torch._C._set_sm_carveout_experimental`, CUBLASLT_MATMUL_DESC_SM_COUNT_TARGET, set while the graph is captured), so
that the attention's programs find SMs of their own while the GEMMs run. With `--side-priority high` the second
stream (the attention's) is created at the device's highest priority, so that its programs are dispatched first
as the GEMMs' leave SMs.
Times are per layer, from CUDA graphs of LAYERS layers (each layer its own weights and pages, so that each round
reads HBM).

    python3 bench/mixed_overlap.py --out OUT.json
    python3 bench/mixed_overlap.py --carveouts 16,32,48 --out OUT.json
    python3 bench/mixed_overlap.py --carveouts 16,32 --side-priority high --out OUT.json
    python3 bench/mixed_overlap.py --smoke     # tiny shapes on the CPU: checks the script
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

SMOKE = "--smoke" in sys.argv
if SMOKE and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from attention import PagedCache  # noqa: E402  (bench/attention.py, beside this script)
from timing import Timer  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out")
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--carveouts", default="", help="SM counts the prompt GEMMs leave free, e.g. 16,32,48 (cuda)")
    parser.add_argument("--side-priority", choices=("normal", "high"), default="normal",
                        help="the second stream's priority (cuda)")
    args = parser.parse_args()
    try:
        carveouts = [int(value) for value in args.carveouts.split(",") if value.strip()]
    except ValueError:
        sys.exit(f"--carveouts: integers separated by commas, not {args.carveouts!r}")
    cuda = torch.cuda.is_available()
    if not cuda and not SMOKE:
        sys.exit("no GPU: run with --smoke to check the script on the CPU")
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    layers = 8 if cuda else 2
    hidden, inter, heads, head_dim, decode_rows = (4096, 11008, 32, 128, 64) if cuda else (64, 172, 2, 32, 4)
    timer = Timer(device, reps=30 if cuda else 1, graph_on_cpu=True)
    weights = [{"qkv": torch.randn(3 * hidden, hidden, device=device, dtype=dtype) * 0.02,
                "o": torch.randn(hidden, hidden, device=device, dtype=dtype) * 0.02,
                "gate_up": torch.randn(2 * inter, hidden, device=device, dtype=dtype) * 0.02,
                "down": torch.randn(hidden, inter, device=device, dtype=dtype) * 0.02} for _ in range(layers)]

    def gemms(rows):
        x = torch.randn(rows, hidden, device=device, dtype=dtype)
        act = torch.randn(rows, inter, device=device, dtype=dtype)
        outs = {name: torch.empty(rows, weight.shape[0], device=device, dtype=dtype) for name, weight in weights[0].items()}

        def layer(i):
            for name in ("qkv", "o", "gate_up"):
                torch.matmul(x, weights[i][name].t(), out=outs[name])
            torch.matmul(act, weights[i]["down"].t(), out=outs["down"])
        return layer

    shapes = ((1024, 1024), (1024, 2048), (2048, 1024), (512, 1024)) if cuda else ((32, 64),)
    results = []
    for prompt_rows, context in shapes:
        cache = PagedCache(heads, heads, head_dim, 1, [(context, 1)] * decode_rows, layers, dtype, device, seed=1)
        attention = cache.kernel_calls()
        prompt, decode_own = gemms(prompt_rows), gemms(decode_rows)
        entry = {"prompt_rows": prompt_rows, "decode_rows": decode_rows, "context": context,
                 "gemms_us": timer.graph([lambda i=i: prompt(i) for i in range(layers)]),
                 "attention_us": timer.graph(attention),
                 "decode_rows_gemms_us": timer.graph([lambda i=i: decode_own(i) for i in range(layers)]),
                 "one_stream_us": timer.graph([lambda i=i: (prompt(i), attention[i]()) for i in range(layers)])}
        if cuda:
            # a lower number is a higher priority; torch maps one past the device's range to its highest
            side = torch.cuda.Stream(priority=-100 if args.side_priority == "high" else 0)

            def forked(i, nano):
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    if nano:
                        decode_own(i)
                    attention[i]()
                prompt(i)
                torch.cuda.current_stream().wait_stream(side)

            def gemms_first(i):  # the same graph, the GEMMs captured (and so launched) before the attention
                side.wait_stream(torch.cuda.current_stream())
                prompt(i)
                with torch.cuda.stream(side):
                    attention[i]()
                torch.cuda.current_stream().wait_stream(side)

            entry["two_streams_us"] = timer.graph([lambda i=i: forked(i, False) for i in range(layers)])
            entry["two_streams_with_decode_gemms_us"] = timer.graph([lambda i=i: forked(i, True) for i in range(layers)])
            entry["two_streams_gemms_first_us"] = timer.graph([lambda i=i: gemms_first(i) for i in range(layers)])
            sms = torch.cuda.get_device_properties(device).multi_processor_count
            for carveout in carveouts:
                if not 0 < carveout < sms:
                    sys.exit(f"--carveouts: {carveout} is not within 1..{sms - 1} (this GPU's SMs)")
                preferred = torch.backends.cuda.preferred_blas_library()
                torch.backends.cuda.preferred_blas_library("cublaslt")
                torch._C._set_sm_carveout_experimental(carveout)
                try:  # read by cuBLASLt as each GEMM is captured: the graphs keep it
                    entry[f"carveout_{carveout}"] = {
                        "gemms_us": timer.graph([lambda i=i: prompt(i) for i in range(layers)]),
                        "one_stream_us": timer.graph([lambda i=i: (prompt(i), attention[i]()) for i in range(layers)]),
                        "two_streams_us": timer.graph([lambda i=i: forked(i, False) for i in range(layers)]),
                        "two_streams_gemms_first_us": timer.graph([lambda i=i: gemms_first(i) for i in range(layers)]),
                        "two_streams_with_decode_gemms_us": timer.graph([lambda i=i: forked(i, True) for i in range(layers)]),
                    }
                finally:
                    torch._C._set_sm_carveout_experimental(None)
                    torch.backends.cuda.preferred_blas_library(preferred)
        print(json.dumps(entry), flush=True)
        results.append(entry)
    if args.out:
        with open(args.out, "w") as out:
            json.dump({"device": torch.cuda.get_device_name() if cuda else "cpu (smoke)", "layers": layers,
                       "side_priority": args.side_priority, "results": results},
                      out, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
