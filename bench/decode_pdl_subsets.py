"""Which modules' early launches cost or gain in a decode step (an experiment kept beside bench/decode_pdl.py): one
engine with decode_pdl on; per subset of gpu_ops modules launching early, the batch-1 and 64-row graphs recaptured and
timed; the logits of a short request compared with all-off's. python3 -P bench/decode_pdl_subsets.py BENCH_DIR fp8 OUT.json"""
import json, statistics, sys
import torch
sys.path.insert(0, sys.argv[1])
from engine_decode import decode_rate
from lorad.config import EngineConfig
from lorad.daemon.engine.engine import Engine
from lorad.daemon.engine.request import GenerationRequest, SamplingParams
from lorad.daemon.engine.decode_graphs import capture_forward
from lorad.daemon.model.checkpoint import PROJECTIONS
from lorad.gpu_ops import fused, gemv, fp8_gemm, paged_attention, mbgmv, launch

MODULES = {"fused": fused, "gemv": gemv, "fp8_gemm": fp8_gemm, "paged_attention": paged_attention, "mbgmv": mbgmv}
quant = sys.argv[2]
engine = Engine(EngineConfig(model_config="llama-2-7b", dummy_weights=True, dummy_adapters=64, dummy_adapter_rank=16,
    dummy_adapter_targets=",".join(PROJECTIONS), device="cuda", dtype="bfloat16", max_running_requests=64,
    max_lora_rank=64, max_model_len=2048, quantization=quant, kv_cache_dtype=quant, decode_pdl="on"))
g = engine.runner.graphs
keys = [(1, "none", 0, "all"), (64, "mbgmv", 16, "all")]
adapters = [f"dummy-{i}" for i in range(64)]

def use(subset):
    for name, module in MODULES.items():
        module.launching_early = launch.launching_early if name in subset else (lambda: False)
    for key in keys:
        size, kernel, rank, targets = key
        graph, logits, g.pool = capture_forward(g.model, g._static_step(size, rank, kernel, targets), g.kv.view, g.table, g.pool, g.logits)
        g.graphs[key] = (graph, logits)

def logits():
    greedy = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    r = engine.generate([GenerationRequest([5, 6, 7, 8], None, greedy, keep_logits=True)])[0]
    return torch.stack(r.logits).float()

subsets = {"none": [], "all": list(MODULES)}
for name in MODULES:
    subsets[f"only {name}"] = [name]
    subsets[f"all but {name}"] = [m for m in MODULES if m != name]
rows = []
base = None
for label, subset in subsets.items():
    use(subset)
    one = [decode_rate(engine, [None], 128, 64)[1] for _ in range(3)]
    many = [decode_rate(engine, adapters, 1024, 48)[1] for _ in range(2)]
    lg = logits()
    if base is None:
        base = lg
    row = {"subset": label, "batch1_ms": round(statistics.median(one), 4), "lora64_ms": round(statistics.median(many), 4),
           "logits_max_diff": float((lg - base).abs().max())}
    print(json.dumps(row), flush=True)
    rows.append(row)
json.dump(rows, open(sys.argv[3], "w"), indent=1)
