"""The sum over 2 GPUs of a [rows, hidden] partial, as a tensor-parallel decode step runs 2 per layer: NCCL's
all-reduce (what the engine runs, daemon/model/tensor_parallel.py) against torch's one-shot and two-shot
all-reduces through symmetric memory (each rank's partial copied into a buffer the other maps over NVLink; one
kernel with a barrier of flags); and, up to 256 rows, the sum with the residual add and RMSNorm after it as the
engine runs it: NCCL then add_rms_norm (`nccl_add_norm_us`) against the fused peer sum (`fused_add_norm_us`,
gpu_ops/peer_sum.py, all_reduce fused). Per call, from replays of a CUDA graph of `--calls` sums in a row (as the
step's graph holds them; between them a small matmul, so that the ranks drift as a step's kernels make them). Each
result checked against the exact sum first.

    python3 bench/all_reduce.py --out bench/results/all_reduce_h100x2.json

Needs 2 GPUs; each rank is a process, spawned afresh for each hidden size (a process maps the engine's fused-sum
buffers once, daemon/model/tensor_parallel.py). Prints one JSON document.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", default="5120,8192", help="hidden sizes (13B, 70B)")
    parser.add_argument("--rows", default="1,8,32,64,128,256,512")
    parser.add_argument("--calls", type=int, default=80, help="sums per graph (a 40-layer model's decode step)")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    if args.calls < 2 or args.calls % 2:
        parser.error("--calls must be even: the fused sums alternate two halves of their buffers")
    return args


def rank_main(rank: int, port: int, args, hidden: int, results: list) -> None:
    import torch.distributed as dist
    from lorad.daemon.model import tensor_parallel

    device = torch.device(f"cuda:{rank}")
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2, device_id=device)
    import torch.distributed._symmetric_memory as symm_mem

    group = dist.group.WORLD.group_name
    enable = getattr(symm_mem, "enable_symm_mem_for_group", None)  # needed before torch 2.9
    if enable is not None:
        enable(group)
    buffer = symm_mem.empty((4 << 20) // 2, dtype=torch.bfloat16, device=device)  # up to 4 MiB of bf16
    symm_mem.rendezvous(buffer, group)

    def one_shot(tensor):
        out = torch.empty_like(tensor)
        symmetric = buffer[: tensor.numel()].view(tensor.shape)
        return torch.ops.symm_mem.one_shot_all_reduce_copy_out(symmetric, tensor, "sum", group, out)

    def two_shot(tensor):
        symmetric = buffer[: tensor.numel()].view(tensor.shape)
        symmetric.copy_(tensor)
        out = torch.empty_like(tensor)
        return torch.ops.symm_mem.two_shot_all_reduce_out(symmetric, "sum", group, out)

    paths = {"nccl": tensor_parallel.all_reduce, "one_shot": one_shot, "two_shot": two_shot}
    between = torch.randn(64, 64, device=device, dtype=torch.bfloat16)
    rows_list = [int(r) for r in args.rows.split(",")]
    fused = tensor_parallel.PeerSum(hidden, torch.bfloat16, device)  # collective: both ranks make it here
    if rank == 0:
        print(f"hidden {hidden}: {fused.path}", flush=True)
    for rows in rows_list:
        generator = torch.Generator(device=device).manual_seed(rank * 1000 + rows)
        partial = torch.randn(rows, hidden, device=device, dtype=torch.bfloat16, generator=generator)
        others = [torch.empty_like(partial) for _ in range(2)]
        dist.all_gather(others, partial)
        exact = (others[0].float() + others[1].float()).to(torch.bfloat16)
        entry = {"hidden": hidden, "rows": rows, "bytes": partial.nbytes}
        for name, reduce in paths.items():
            if name != "nccl" and partial.numel() > buffer.numel():
                continue
            got = reduce(partial.clone())
            assert torch.equal(got, exact), (name, rows, hidden)
            work = partial.clone()
            entry[f"{name}_us"] = graph_us(args, between, lambda: reduce(work))
        if rows <= tensor_parallel.PEER_SUM_MAX_ROWS:
            entry.update(time_sum_and_norm(args, device, fused, partial, exact, between))
        results.append(entry)
        if rank == 0:
            print(json.dumps(entry), flush=True)
    dist.barrier()
    dist.destroy_process_group()


def time_sum_and_norm(args, device, fused, partial, exact, between) -> dict:
    """The sum as the engine runs it between a projection and the next norm: NCCL's all-reduce then the fused
    add_rms_norm kernel, against gpu_ops/peer_sum.py's one kernel (all_reduce fused), each call on the next half
    of its buffers, as the model alternates them. Checked equal (h and the normed rows) first."""
    from lorad.daemon.model import tensor_parallel
    from lorad.gpu_ops.fused import add_rms_norm

    rows, hidden = partial.shape
    if fused.buffers is None:
        return {"fused_error": fused.path}
    generator = torch.Generator(device=device).manual_seed(rows)  # the same h and weight on both ranks
    h0 = torch.randn(rows, hidden, device=device, dtype=torch.bfloat16, generator=generator)
    weight = torch.rand(hidden, device=device, dtype=torch.bfloat16, generator=generator) + 0.5
    # Each fused call on the half the last one did not take (PeerBuffers.last_half): launched in this order, and a
    # graph of an even number of them, replayed, leaves off where its first launch takes up again.
    calls = {"nccl_add_norm_us": lambda h: add_rms_norm(h, tensor_parallel.all_reduce(partial.clone()), weight, 1e-5),
             "fused_add_norm_us": lambda h: fused(h, partial, weight, 1e-5, 1 - fused.buffers.last_half)}
    got = {name: call(h0.clone()) for name, call in calls.items()}
    for name, (h, x) in got.items():
        assert torch.equal(h, add_rms_norm(h0.clone(), exact, weight, 1e-5)[0]), (name, rows, hidden)
    assert torch.equal(got["nccl_add_norm_us"][1], got["fused_add_norm_us"][1]), (rows, hidden)
    out = {}
    for name, call in calls.items():
        h = h0.clone()
        out[name] = graph_us(args, between, lambda: call(h))
    return out


def graph_us(args, between: torch.Tensor, launch) -> float:
    """launch() twice as a warm-up, then a CUDA graph of --calls launch(), each after a small matmul, replayed --reps
    times (both ranks at once) -> the median device time per call in us."""
    import torch.distributed as dist

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up off the capture: cuBLAS's handle, the allocator's blocks
        for _ in range(2):
            between @ between
            launch()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(args.calls):
            between @ between
            launch()
    graph.replay()
    torch.cuda.synchronize()
    dist.barrier()
    times = []
    for _ in range(args.reps):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(begin.elapsed_time(end) * 1e3 / args.calls)
    times.sort()
    return times[len(times) // 2]


def worker(rank: int, port: int, args, hidden: int, path: str) -> None:
    results = []
    rank_main(rank, port, args, hidden, results)
    if rank == 0:
        with open(path, "w") as handle:
            json.dump(results, handle)


def main(argv=None) -> None:
    args = parse_args(argv)
    if torch.cuda.device_count() < 2:
        raise SystemExit("bench/all_reduce.py needs 2 GPUs")
    started = time.perf_counter()
    import tempfile

    import torch.multiprocessing as mp
    from lorad.daemon.engine.tp_worker import free_port

    results = []
    with tempfile.TemporaryDirectory() as scratch:
        for hidden in (int(h) for h in args.hidden.split(",")):
            path = f"{scratch}/{hidden}.json"
            mp.spawn(worker, args=(free_port(), args, hidden, path), nprocs=2, join=True)
            with open(path) as handle:
                results += json.load(handle)
    document = {"machine": f"{torch.cuda.device_count()}x {torch.cuda.get_device_name()}", "torch": torch.__version__,
                "calls_per_graph": args.calls, "results": results,
                "notes": "us: device time per sum, median of graph replays; between sums a 64x64 matmul"}
    print(json.dumps(document, indent=1), flush=True)
    if args.out:
        with open(args.out, "w") as handle:
            json.dump(document, handle, indent=1)
    print(f"wall {time.perf_counter() - started:.0f} s", file=sys.stderr)


if __name__ == "__main__":
    main()
