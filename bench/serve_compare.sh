#!/usr/bin/env bash
# Serving figures on the GPU machine, lorad beside a baseline build, in one run: each build serves the 7B shape
# (random weights; MODEL_CONFIG in the environment names another `--model-config`, e.g. llama-3-8b) with 100 PEFT
# adapters of ranks 8-64 on q, k, v, o, and this checkout's `lorad bench serve` loads it. Usage, from the repository root:
#   bash bench/serve_compare.sh OUTDIR [BASELINE_SRC] [-- BENCH_SERVE_ARGS...]
# BASELINE_SRC: a source tree of the baseline commit (`git archive COMMIT | tar -x -C DIR`), served first.
# Without BENCH_SERVE_ARGS: the saturated Azure conversation run (400 requests, all at once).
# SERVE_ARGS in the environment: extra `lorad serve` flags for both builds; BASELINE_SERVE_ARGS and
# CURRENT_SERVE_ARGS: for one build only. STEP_LOG=1: each daemon writes its steps to OUTDIR/NAME.steps.jsonl
# (LORAD_STEP_LOG; a build before the step log ignores it), which `python3 bench/step_log_report.py` reads. One commit's two settings side by side (FP8 against bf16, figure 25.4):
#   CURRENT_SERVE_ARGS="--quantization fp8 --kv-cache-dtype fp8" bash bench/serve_compare.sh OUTDIR . The Azure CSVs are read from
# $DATA_DIR (default ../shared/data). Each build is installed into its own folder (not editable), so the two
# never see each other's modules (python3 -P: the checkout's own lorad/ folder is not on the path). An editable
# install of lorad on the machine would shadow both folders: run this before `pip install -e .` (the script refuses
# a baseline that resolves elsewhere). Output: OUTDIR/NAME.json (bench serve), NAME.status.json (/v1/status
# after the run), NAME.metrics.txt (/metrics after the run), NAME.serve.log.

set -u
OUTDIR=${1:?usage: bench/serve_compare.sh OUTDIR [BASELINE_SRC] [-- BENCH_SERVE_ARGS...]}
shift
BASELINE=""
if [ $# -gt 0 ] && [ "$1" != "--" ]; then BASELINE=$1; shift; fi
[ "${1:-}" = "--" ] && shift
BENCH_ARGS=("$@")
[ ${#BENCH_ARGS[@]} -eq 0 ] && BENCH_ARGS=(--dataset azure-conv --num-prompts 400 --request-rate inf --adapters 100)
mkdir -p "$OUTDIR"
OUTDIR=$(cd "$OUTDIR" && pwd)
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
DATA_DIR=${DATA_DIR:-../shared/data}
SITE=""
if compgen -G ".devcarry/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --target /tmp/site .devcarry/*.whl || exit 1
    SITE=/tmp/site
fi

install() {  # SRC DEST: a plain (non-editable) install of the tree at SRC into DEST, a fresh one
    local start=$SECONDS
    rm -rf "$2"  # pip --target keeps what a run before this one left there (a warm machine) and installs nothing over it
    python3 -m pip install -q --no-deps --no-build-isolation --target "$2" "$1" >"$OUTDIR/install_$(basename "$2").log" 2>&1 \
        || { echo "install of $1 failed"; tail -20 "$OUTDIR/install_$(basename "$2").log"; exit 1; }
    echo "installed $1 into $2 in $((SECONDS - start)) s"
}

install . /tmp/lorad_current &
[ -n "$BASELINE" ] && install "$BASELINE" /tmp/lorad_baseline &
wait
CURRENT_PATH=/tmp/lorad_current${SITE:+:$SITE}
lorad_current() { PYTHONPATH=$CURRENT_PATH python3 -P -m lorad.daemon.server.cli "$@"; }

MODEL_CONFIG=${MODEL_CONFIG:-llama-2-7b}
ADAPTERS=/tmp/serve_adapters_$MODEL_CONFIG
[ -d "$ADAPTERS" ] || lorad_current demo adapters --model-config "$MODEL_CONFIG" --count 100 --ranks 8,16,32,64 \
    --targets q,k,v,o --out "$ADAPTERS" >"$OUTDIR/adapters.log" 2>&1 || { tail "$OUTDIR/adapters.log"; exit 1; }

serve_and_load() {  # NAME PYTHONPATH SOURCE [SERVE FLAGS of this build alone]
    local name=$1 path=$2 source=$3 socket=/tmp/lorad-$1.sock start=$SECONDS
    shift 3
    # An editable install (pip install -e .) puts an import hook before PYTHONPATH: every build would run its
    # checkout's code. Only a build of that same checkout may resolve there.
    local resolved
    resolved=$(cd /tmp && PYTHONPATH=$path python3 -P -c 'import lorad; print(lorad.__file__)' 2>&1)
    if [[ "$resolved" != /tmp/lorad_$name/* && "$resolved" != "$(cd "$source" && pwd)/lorad/"* ]]; then
        echo "$name: lorad resolves to $resolved, not to the build of $source (an editable install of lorad" \
             "shadows PYTHONPATH: pip uninstall lorad, or run this before installing it)"
        return 1
    fi
    local step_log=()
    [ "${STEP_LOG:-0}" = 1 ] && step_log=(env "LORAD_STEP_LOG=$OUTDIR/$name.steps.jsonl")
    PYTHONPATH=$path "${step_log[@]}" python3 -P -m lorad.daemon.server.cli serve --model-config "$MODEL_CONFIG" --dummy-weights \
        --adapter-dir "$ADAPTERS" --device cuda --socket "$socket" ${SERVE_ARGS:-} "$@" >"$OUTDIR/$name.serve.log" 2>&1 &
    local daemon=$!
    until curl -sf --unix-socket "$socket" http://localhost/health >/dev/null 2>&1; do
        if ! kill -0 $daemon 2>/dev/null || [ $((SECONDS - start)) -gt 300 ]; then
            echo "$name: the daemon did not come up"; tail -20 "$OUTDIR/$name.serve.log"; kill $daemon 2>/dev/null; return 1
        fi
        sleep 2
    done
    echo "$name: up after $((SECONDS - start)) s"
    lorad_current bench serve --socket "$socket" --data-dir "$DATA_DIR" --no-progress "${BENCH_ARGS[@]}" \
        --out "$OUTDIR/$name.json" 2>&1 | tail -8
    curl -sf --unix-socket "$socket" http://localhost/v1/status >"$OUTDIR/$name.status.json"
    curl -sf --unix-socket "$socket" http://localhost/metrics >"$OUTDIR/$name.metrics.txt"
    kill -INT $daemon
    wait $daemon
    echo "$name: done after $((SECONDS - start)) s"
}

# shellcheck disable=SC2086  # the flags split into words
[ -n "$BASELINE" ] && serve_and_load baseline /tmp/lorad_baseline${SITE:+:$SITE} "$BASELINE" ${BASELINE_SERVE_ARGS:-}
# shellcheck disable=SC2086
serve_and_load current "$CURRENT_PATH" . ${CURRENT_SERVE_ARGS:-}
