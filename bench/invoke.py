"""Kept for bench/gpu_check.sh: the invocation benchmark is `lorad bench invoke` (daemon/bench/invoke.py);
this runs it with the same flags.

    python3 bench/invoke.py --out bench/results/invoke_h100.json
"""

import sys

from lorad.daemon.bench.cli import bench_main

if __name__ == "__main__":
    sys.exit(bench_main(["bench", "invoke", *sys.argv[1:]]))
