#!/usr/bin/env bash
# Figure 21.4 on the GPU machine: one daemon serving the Llama 3 8B shape (random weights) with 64 PEFT adapters of rank
# 16 on q, k, v, o, loaded by `lorad bench serve --dataset random` (1024 in, 128 out, --ignore-eos) at each max
# concurrency, once for the base model alone and once over the 64 adapters (uniform popularity). A first pass of short
# requests makes every adapter resident, so the runs time serving, not first loads. Usage, from the repository root
# with lorad installed:
#   bash bench/serve_random.sh OUTDIR [CONCURRENCIES (default "1 8 32 64 128 256")]
# SERVE_ARGS in the environment: extra `lorad serve` flags. Output: OUTDIR/cC_a0.json and cC_a64.json (bench serve's
# reports), OUTDIR/summary.txt (output tok/s and the ratio at each C), OUTDIR/serve.log.

set -u
OUTDIR=${1:?usage: bench/serve_random.sh OUTDIR [CONCURRENCIES]}
CONCURRENCIES=${2:-"1 8 32 64 128 256"}
mkdir -p "$OUTDIR"
export PYTHONUNBUFFERED=1
L="python3 -m lorad.daemon.server.cli"
ADAPTERS=/tmp/serve_random_adapters SOCKET=/tmp/lorad-serve-random.sock
[ -d "$ADAPTERS" ] || $L demo adapters --model-config llama-3-8b --count 64 --ranks 16 --targets q,k,v,o --out "$ADAPTERS" \
    >"$OUTDIR/adapters.log" 2>&1 || { tail "$OUTDIR/adapters.log"; exit 1; }
# shellcheck disable=SC2086  # the flags split into words
$L serve --model-config llama-3-8b --dummy-weights --adapter-dir "$ADAPTERS" --device cuda --socket "$SOCKET" ${SERVE_ARGS:-} \
    >"$OUTDIR/serve.log" 2>&1 &
DAEMON=$!
trap 'kill -INT $DAEMON 2>/dev/null; wait $DAEMON' EXIT
until curl -sf --unix-socket "$SOCKET" http://localhost/health >/dev/null 2>&1; do
    kill -0 $DAEMON 2>/dev/null || { echo "the daemon did not come up"; tail -20 "$OUTDIR/serve.log"; exit 1; }
    sleep 2
done
$L bench serve --socket "$SOCKET" --dataset random --input-len 64 --output-len 4 --ignore-eos --max-concurrency 64 \
    --num-prompts 640 --adapters 64 --alpha 0 --no-progress >/dev/null || { echo "the warm-up pass failed"; exit 1; }
: >"$OUTDIR/summary.txt"
for c in $CONCURRENCIES; do
    n=$(( c == 1 ? 12 : c == 8 ? 32 : c < 128 ? 2 * c : c ))
    for a in 0 64; do
        $L bench serve --socket "$SOCKET" --dataset random --input-len 1024 --output-len 128 --ignore-eos --max-concurrency "$c" \
            --num-prompts "$n" --adapters "$a" --alpha 0 --no-progress --out "$OUTDIR/c${c}_a${a}.json" >/dev/null \
            || echo "c=$c adapters=$a: bench serve failed" >>"$OUTDIR/summary.txt"
    done
    python3 - "$OUTDIR" "$c" >>"$OUTDIR/summary.txt" <<'PY'
import json, sys
out, c = sys.argv[1], sys.argv[2]
base, lora = (json.load(open(f"{out}/c{c}_a{a}.json"))["runs"][0]["output_throughput"] for a in (0, 64))
print(f"max concurrency {c}: base {base:.1f} tok/s, 64 adapters {lora:.1f} tok/s, {lora / base:.3f}x")
PY
done
cat "$OUTDIR/summary.txt"
