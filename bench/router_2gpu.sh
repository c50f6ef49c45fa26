#!/usr/bin/env bash
# Rank-aware (CaraServe Algorithm 1) vs most-idle routing over two lorad engines, one per GPU: the same
# gamma trace of mixed-rank adapters is replayed through `lorad router` under each policy, and their SLO
# attainment compared. Fresh engines per policy, so neither run finds the other's adapters resident.
# Usage, from the repository root (lorad installed, on PATH):
#   bash bench/router_2gpu.sh OUTDIR          # 2 GPUs: Llama-2-7B shape, random weights, ~5 minutes
#   bash bench/router_2gpu.sh OUTDIR --cpu    # smoke test: the demo model on the CPU, ~30 s
# OUTDIR gets trace.json, POLICY.json (the `lorad bench trace` reports; POLICY.rN.json with REPEATS > 1),
# POLICY.router_status.json (the router's decisions per engine), comparison.json, and logs/. Settings come
# from the environment (defaults below): RATE DURATION WARMUP_S ADAPTERS SLO_TTFT_S SLO_TPOT_MS POLICIES,
# PROFILE (a `lorad profile` JSON for rank-aware; "measure": profile GPU 0 first, into OUTDIR/profile.json;
# unset: the example profile, NOT MEASURED), REPEATS (runs per policy, default 1: the order of the policies
# alternates between rounds, A B B A ..., so that neither always runs first), LORA_KERNEL (auto: the engines
# choose each step's decode LoRA kernel from their profile; bgmv or mbgmv: every step, and rank-aware routing
# uses that kernel's decode model from PROFILE), RANKS (the trace's adapter ranks, default 8,16,32,64).

set -euo pipefail
if [ $# -lt 1 ] || [ $# -gt 2 ] || { [ $# -eq 2 ] && [ "$2" != "--cpu" ]; }; then
    echo "usage: bash bench/router_2gpu.sh OUTDIR [--cpu]" >&2
    exit 2
fi
mkdir -p "$1/logs"
OUTDIR=$(cd "$1" && pwd)
MODE=${2:---gpu}
PYTHON=${PYTHON:-python3}
POLICIES=${POLICIES:-rank-aware most-idle}
LORA_KERNEL=${LORA_KERNEL:-auto}
RANKS=${RANKS:-8,16,32,64}
PROFILE=${PROFILE:-}
REPEATS=${REPEATS:-1}
"$PYTHON" -c "import lorad.daemon.router.cli" || { echo "lorad is not importable by $PYTHON (set PYTHON)" >&2; exit 2; }
command -v lorad >/dev/null || { echo "no lorad on PATH" >&2; exit 2; }

RUN=$(mktemp -d /tmp/lorad-router-bench.XXXXXX)  # sockets (AF_UNIX paths must be short) and adapters
pids=()
cleanup() {
    for pid in ${pids[@]+"${pids[@]}"}; do kill -TERM "$pid" 2>/dev/null || true; done
    wait 2>/dev/null || true
    rm -rf "$RUN"
}
trap cleanup EXIT

if [ "$MODE" = "--cpu" ]; then
    RATE=${RATE:-6} DURATION=${DURATION:-3} SLO_TTFT_S=${SLO_TTFT_S:-5} SLO_TPOT_MS=${SLO_TPOT_MS:-500}
    TRACE_LENGTHS=(--prompt-len 4,24 --output-len 2,8) REPLAY_LIMITS=(--max-prompt-tokens 24 --max-output-tokens 8)
    ENGINE_FLAGS=(--demo --device cpu --pool-bytes 8M --max-model-len 128)
    DEVICES=("" "")
    export LORAD_DEMO_DIR="$RUN/demo"  # the demo's adapters have ranks 1 to 64
    START_TIMEOUT_S=120
else
    RATE=${RATE:-16} DURATION=${DURATION:-60} SLO_TTFT_S=${SLO_TTFT_S:-1.5} SLO_TPOT_MS=${SLO_TPOT_MS:-40}
    ADAPTERS=${ADAPTERS:-16}
    TRACE_LENGTHS=(--prompt-len 16,512 --output-len 16,256) REPLAY_LIMITS=(--max-prompt-tokens 512 --max-output-tokens 256)
    echo "writing $ADAPTERS random PEFT adapters of ranks $RANKS (Llama-2-7B shape, q,k,v,o)"
    lorad demo adapters --model-config llama-2-7b --count "$ADAPTERS" --ranks "$RANKS" --targets q,k,v,o \
        --out "$RUN/adapters" >"$OUTDIR/logs/adapters.log" 2>&1
    ENGINE_FLAGS=(--model-config llama-2-7b --dummy-weights --adapter-dir "$RUN/adapters" --device cuda)
    DEVICES=(0 1)
    START_TIMEOUT_S=300
fi

if [ "$PROFILE" = "measure" ]; then
    PROFILE="$OUTDIR/profile.json"
    echo "profiling this machine's GPU 0 for rank-aware routing -> $PROFILE"
    if [ "$MODE" = "--cpu" ]; then
        lorad profile --model-config tiny-llama --device cpu --quick --out "$PROFILE" >"$OUTDIR/logs/profile.log" 2>&1
    else
        CUDA_VISIBLE_DEVICES=${DEVICES[0]} lorad profile --model-config llama-2-7b --max-lora-rank 64 --device cuda \
            --out "$PROFILE" >"$OUTDIR/logs/profile.log" 2>&1
    fi
fi

ENGINE_FLAGS+=(--lora-kernel "$LORA_KERNEL")
echo "trace: gamma, $RATE req/s for $DURATION s, adapters of ranks $RANKS; engines' decode LoRA kernel: $LORA_KERNEL"
lorad trace make --kind gamma --adapters 64 --alpha 1 --cv 2 --rate "$RATE" --duration "$DURATION" \
    --ranks "$RANKS" "${TRACE_LENGTHS[@]}" --seed 0 --out "$OUTDIR/trace.json"
# A warm-up replay through the router before each measured one: fresh engines compile kernels and fill
# caches on their first traffic (whichever policy ran first would pay for it).
lorad trace make --kind gamma --adapters 64 --alpha 1 --cv 2 --rate "$RATE" --duration "${WARMUP_S:-10}" \
    --ranks "$RANKS" "${TRACE_LENGTHS[@]}" --seed 1 --out "$OUTDIR/warmup_trace.json" >/dev/null

# wait_for SOCKET PID TIMEOUT_S [BACKENDS_UP]: until the daemon (or the router, with all its backends up) answers.
wait_for() {
    "$PYTHON" - "$@" <<'EOF'
import sys, time
from lorad.client import Client
path, pid, timeout, backends = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), int((sys.argv[4:] or [0])[0])
deadline = time.monotonic() + timeout
while True:
    try:
        answer = Client(path, timeout=5).health()
        if answer.get("backends_up", 0) >= backends:
            break
    except Exception:  # not listening yet, or 503 while loading
        pass
    try:
        import os
        os.kill(pid, 0)
    except OSError:
        sys.exit(f"process {pid} serving {path} exited")
    if time.monotonic() > deadline:
        sys.exit(f"{path} did not answer within {timeout:.0f} s")
    time.sleep(0.2)
EOF
}

stop() {  # SIGTERM, then wait
    kill -TERM "$1" 2>/dev/null || true
    wait "$1" 2>/dev/null || true
}

# The rounds: the policies in order, then reversed, and so on.
read -r -a forward <<<"$POLICIES"
backward=()
for ((i = ${#forward[@]} - 1; i >= 0; i--)); do backward+=("${forward[$i]}"); done
runs=()
for ((round = 1; round <= REPEATS; round++)); do
    if ((round % 2)); then order=("${forward[@]}"); else order=("${backward[@]}"); fi
    for policy in "${order[@]}"; do runs+=("$policy:$round"); done
done

for run in "${runs[@]}"; do
    policy=${run%%:*} round=${run##*:}
    if [ "$REPEATS" -gt 1 ]; then name="$policy.r$round"; else name=$policy; fi
    echo "=== $name: starting two engines"
    engines=()
    for i in 0 1; do
        socket="$RUN/engine$i.sock"
        CUDA_VISIBLE_DEVICES=${DEVICES[$i]} lorad serve "${ENGINE_FLAGS[@]}" --socket "$socket" --shutdown-grace-s 5 \
            >"$OUTDIR/logs/$name.engine$i.log" 2>&1 &
        engines+=($!)
        pids+=($!)
    done
    for i in 0 1; do
        wait_for "$RUN/engine$i.sock" "${engines[$i]}" "$START_TIMEOUT_S"
    done
    router_flags=(--policy "$policy" --tpot-slo-ms "$SLO_TPOT_MS")
    [ -n "$PROFILE" ] && router_flags+=(--profile "$PROFILE")
    [ "$LORA_KERNEL" != auto ] && router_flags+=(--kernel "$LORA_KERNEL")
    lorad router --backend "$RUN/engine0.sock" --backend "$RUN/engine1.sock" --socket "$RUN/router.sock" \
        "${router_flags[@]}" >"$OUTDIR/logs/$name.router.log" 2>&1 &
    router=$!
    pids+=($router)
    wait_for "$RUN/router.sock" "$router" 30 2
    echo "=== $name: warm-up replay (not reported)"
    lorad bench trace --socket "$RUN/router.sock" --trace "$OUTDIR/warmup_trace.json" "${REPLAY_LIMITS[@]}" \
        --out "$OUTDIR/logs/$name.warmup.json" >"$OUTDIR/logs/$name.warmup.log" 2>&1
    echo "=== $name: replaying"
    lorad bench trace --socket "$RUN/router.sock" --trace "$OUTDIR/trace.json" "${REPLAY_LIMITS[@]}" \
        --slo-ttft-s "$SLO_TTFT_S" --slo-tpot-s "$("$PYTHON" -c "print($SLO_TPOT_MS / 1e3)")" \
        --out "$OUTDIR/$name.json" | tee "$OUTDIR/logs/$name.replay.log"
    lorad status --json --socket "$RUN/router.sock" >"$OUTDIR/$name.router_status.json"
    stop "$router"
    for pid in "${engines[@]}"; do stop "$pid"; done
done

"$PYTHON" - "$OUTDIR" "$REPEATS" "${runs[@]}" <<'EOF'
import json, statistics, sys
from pathlib import Path
out, repeats, runs = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3:]
rows = {}
for run in runs:  # "policy:round", in the order they ran
    policy, round_ = run.split(":")
    name = f"{policy}.r{round_}" if repeats > 1 else policy
    summary = json.loads((out / f"{name}.json").read_text())["summary"]
    router = json.loads((out / f"{name}.router_status.json").read_text())["router"]
    rows[name] = {
        "completed": summary["completed"], "dropped": summary["dropped"],
        "ttft_p50_s": summary["ttft_s"]["p50"], "ttft_p99_s": summary["ttft_s"]["p99"],
        "tpot_p50_s": summary["tpot_s"]["p50"], "tpot_p99_s": summary["tpot_s"]["p99"],
        "slo_ttft": summary["slo_ttft_attainment"], "slo_tpot": summary["slo_tpot_attainment"],
        "slo_both": summary["slo_attainment"], "decisions": list(router["decisions"].values()),
        "profile_measured": (router.get("profile") or {}).get("measured"), "policy": policy, "round": int(round_),
    }
means = {}
if repeats > 1:  # each policy's mean over its rounds
    for policy in dict.fromkeys(r["policy"] for r in rows.values()):
        mine = [r for r in rows.values() if r["policy"] == policy]
        means[policy] = {key: statistics.fmean(r[key] for r in mine) for key in ("slo_ttft", "slo_tpot", "slo_both")
                         if all(r[key] is not None for r in mine)}
(out / "comparison.json").write_text(json.dumps({"runs": rows, "means": means}, indent=1) + "\n")
ms = lambda s: "-" if s is None else f"{s * 1e3:.1f}"
pct = lambda v: "-" if v is None else f"{100 * v:.1f}%"
print(f"{'policy':<15} {'done':>5} {'drop':>5} {'TTFT p50':>9} {'p99':>8} {'TPOT p50':>9} {'p99':>7} "
      f"{'SLO TTFT':>9} {'SLO TPOT':>9} {'SLO both':>9}  split")
for policy, r in rows.items():
    print(f"{policy:<15} {r['completed']:>5} {r['dropped']:>5} {ms(r['ttft_p50_s']):>9} {ms(r['ttft_p99_s']):>8} "
          f"{ms(r['tpot_p50_s']):>9} {ms(r['tpot_p99_s']):>7} {pct(r['slo_ttft']):>9} {pct(r['slo_tpot']):>9} "
          f"{pct(r['slo_both']):>9}  {'/'.join(map(str, r['decisions']))}")
for policy, m in means.items():
    print(f"{policy + ' mean':<15} {'':>5} {'':>5} {'':>9} {'':>8} {'':>9} {'':>7} {pct(m.get('slo_ttft')):>9} "
          f"{pct(m.get('slo_tpot')):>9} {pct(m.get('slo_both')):>9}")
print("(ms; SLO: share of all requests meeting the objective, drops are misses; split: requests per engine)")
if not all(r["profile_measured"] for r in rows.values() if r["profile_measured"] is not None):
    print("rank-aware used the example profile: NOT MEASURED on this machine (set PROFILE=...json from `lorad profile`)")
print(f"wrote {out / 'comparison.json'}")
EOF
