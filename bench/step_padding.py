"""How many padding rows the prefill graphs' token buckets add to the steps of a saturated run, on the CPU.

The engine's own Scheduler is replayed over a dataset's prompt and output lengths (every request waiting at
once, as `lorad bench serve --request-rate inf`; KV and adapters never short): each step's rows go to the
smallest bucket that holds them (daemon/engine/prefill_graphs.py), and every row past them is a padding row
the step's GEMMs compute for nothing. Printed per step kind (decode steps run in the decode graphs, whose own
buckets are not counted here) for the buckets given, against the engine's, so a change of buckets or of the
token budget shows its effect before a GPU run. The engine counts the same padding on a live daemon
(`padding_rows` in /v1/status's step_time), which a GPU run of bench/serve_compare.sh reads back.

    python3 bench/step_padding.py [--dataset azure-conv] [--num-prompts 400] [--out OUT.json]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
from lorad.daemon.bench.serve import AZURE_FILES, fit_lengths
from lorad.daemon.bench.trace_make import default_data_dir
from lorad.daemon.engine.prefill_graphs import TOKEN_BUCKETS, bucket_rows
from lorad.scheduler.batching import Scheduler, Sequence
from lorad.scheduler.workload import read_azure_csv

# The 7B shape's context (llama-2-7b), which bench serve fits the prompts to.
MAX_MODEL_LEN = 4096
# The buckets before the 128-token steps to 1536, for the comparison: every 256 tokens past 512.
EVERY_256 = (16, 32, 64, 128, 256, 384, 512, 768, 1024, 1280, 1536, 1792, 2048)


class _Unbounded:
    """Memory and adapters that always have room: the run is bound by the running cap and the token budget."""

    def grow(self, blocks, num_tokens):
        return True

    def release(self, blocks):
        pass

    def acquire(self, name, tokens=None):
        return True

    def staging(self, name):
        return False


def lengths_of(dataset: str, num_prompts: int, data_dir: Path, input_len: int, output_len: int) -> list[tuple[int, int]]:
    """(prompt, output) lengths as bench serve sends them."""
    if dataset == "random":
        return [(input_len, output_len)] * num_prompts
    rows = read_azure_csv(data_dir / AZURE_FILES[dataset])
    count = min(num_prompts, len(rows.prompt_tokens))
    return [fit_lengths(int(prompt), int(output), None, MAX_MODEL_LEN)
            for prompt, output in zip(rows.prompt_tokens[:count], rows.output_tokens[:count])]


def add_dataset_arguments(parser: argparse.ArgumentParser) -> None:
    """The dataset's flags, as bench serve has them (this script's and kv_admission.py's)."""
    parser.add_argument("--dataset", choices=("azure-conv", "azure-code", "random"), default="azure-conv")
    parser.add_argument("--num-prompts", type=int, default=400)
    parser.add_argument("--data-dir", type=Path, help="the Azure CSVs (default: ../shared/data)")
    parser.add_argument("--input-len", type=int, default=1024, help="random: prompt tokens")
    parser.add_argument("--output-len", type=int, default=128, help="random: output tokens")


def dataset_lengths(args: argparse.Namespace) -> list[tuple[int, int]]:
    return lengths_of(args.dataset, args.num_prompts, args.data_dir or default_data_dir(), args.input_len, args.output_len)


def enqueue(scheduler: Scheduler, lengths: list[tuple[int, int]], adapters: list[str | None] | None = None) -> None:
    """Every request waiting from the start: a sequence of its prompt length that generates its output length
    (`max_new_tokens`), with its adapter (None: the base model alone, every request when not given)."""
    for index, (prompt_len, output_len) in enumerate(lengths):
        adapter = None if adapters is None else adapters[index]
        scheduler.add(Sequence(str(index), [0] * prompt_len, prompt_len, adapter, max_new_tokens=output_len))


def step_kind(batch: list[tuple[Sequence, int]]) -> str:
    """As step_account.py has it: decode (every row after its prompt), prefill (none), mixed."""
    decoding = [seq.num_computed >= seq.prompt_len for seq, _ in batch]
    return "decode" if all(decoding) else "mixed" if any(decoding) else "prefill"


def advance(scheduler: Scheduler, batch: list[tuple[Sequence, int]]) -> None:
    """The step ran: each sequence's rows are computed, one that ended its prompt or decoded has its next token, and
    one that reached its output length ends (by its length)."""
    for seq, count in batch:
        seq.num_computed += count
        if seq.num_computed >= seq.num_tokens:
            seq.tokens.append(0)
            if seq.num_generated >= seq.max_new_tokens:
                scheduler.finish(seq, completed=True)


def scheduled(lengths: list[tuple[int, int]], max_running: int, max_batch_tokens: int):
    """The engine's Scheduler over the requests, every one waiting from the start, KV and adapters never short: each
    step's batch, run (`advance`) once the caller is done with it (it may cut the batch's last chunk in place)."""
    room = _Unbounded()
    scheduler = Scheduler(max_running, max_batch_tokens, room, room)
    enqueue(scheduler, lengths)
    while scheduler.has_work():
        batch = scheduler.schedule()
        yield batch
        advance(scheduler, batch)


def replay(lengths: list[tuple[int, int]], max_running: int, max_batch_tokens: int,
           trim_to: tuple[int, ...] | None = None) -> list[tuple[str, int]]:
    """Each step's (kind, rows) as the engine's scheduler plans them, every request waiting from the start.
    Kinds as step_account.py has them: decode, prefill, mixed. trim_to: a what-if the engine does not do, buckets
    the last prompt chunk of a mixed step is cut back to (the bucket below its rows, past 256), its rest left to
    the next step."""
    steps = []
    for batch in scheduled(lengths, max_running, max_batch_tokens):
        kind = step_kind(batch)
        rows = sum(count for _, count in batch)
        last, _ = batch[-1]
        if trim_to and kind == "mixed" and last.num_computed < last.prompt_len:
            below = max((bucket for bucket in trim_to if bucket < rows), default=0)
            seq, count = batch[-1]
            if below > 256 and rows - below < count:
                batch[-1] = (seq, count - (rows - below))
                rows = below
        steps.append((kind, rows))
    return steps


def chunked_steps(lengths: list[tuple[int, int]], max_running: int, max_batch_tokens: int) -> dict:
    """The steps with prompt rows, and those among them with a prompt chunk that does not end its prompt (the token
    budget cut it): such a step samples no token for that row, and the step after it goes on with the prompt from
    the host (the engine plans it ahead beside the decode rows' tokens in flight; DESIGN.md, "Overlapped decode")."""
    with_prompt = chunked = 0
    for batch in scheduled(lengths, max_running, max_batch_tokens):
        if step_kind(batch) != "decode":
            with_prompt += 1
            chunked += any(seq.num_computed + count < seq.num_tokens for seq, count in batch)
    return {"steps_with_prompt_rows": with_prompt, "ending_on_a_chunk": chunked}


def padding(steps: list[tuple[str, int]], buckets: tuple[int, ...], max_batch_tokens: int) -> dict:
    """Per kind with prompt rows: steps, rows, the buckets' rows and the padding rows among them."""
    largest = [bucket for bucket in buckets if bucket < max_batch_tokens] + [max_batch_tokens]
    report = {}
    for kind in ("mixed", "prefill"):
        rows = np.array([count for step_kind, count in steps if step_kind == kind], dtype=np.int64)
        graph = np.array([bucket_rows(count, largest) for count in rows], dtype=np.int64)
        pad = graph - rows
        report[kind] = {
            "steps": len(rows),
            "rows": int(rows.sum()),
            "graph_rows": int(graph.sum()),
            "padding_rows": int(pad.sum()),
            "padding_rows_per_step": round(float(pad.mean()), 1) if len(rows) else None,
            "padding_share": round(float(pad.sum() / graph.sum()), 4) if len(rows) else None,
            "steps_by_bucket": {int(bucket): int((graph == bucket).sum()) for bucket in np.unique(graph)},
        }
    report["decode"] = {"steps": sum(kind == "decode" for kind, _ in steps)}
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_dataset_arguments(parser)
    parser.add_argument("--max-running-requests", type=int, default=64)
    parser.add_argument("--max-batch-tokens", type=int, default=2048)
    parser.add_argument("--buckets", help="comma-separated token buckets to compare with the engine's "
                                          "(default: every 256 tokens past 512)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    other = tuple(int(token) for token in args.buckets.split(",")) if args.buckets else EVERY_256
    lengths = dataset_lengths(args)
    steps = replay(lengths, args.max_running_requests, args.max_batch_tokens)
    trimmed = replay(lengths, args.max_running_requests, args.max_batch_tokens, trim_to=TOKEN_BUCKETS)
    runs = {"engine": (TOKEN_BUCKETS, steps), "other": (other, steps),
            "engine, chunks cut to a bucket (what-if)": (TOKEN_BUCKETS, trimmed)}
    result = {"dataset": args.dataset, "prompts": len(lengths), "max_running_requests": args.max_running_requests,
              "max_batch_tokens": args.max_batch_tokens,
              "chunks": chunked_steps(lengths, args.max_running_requests, args.max_batch_tokens),
              "runs": {name: {"tokens": list(buckets), "steps": len(run), **padding(run, buckets, args.max_batch_tokens)}
                       for name, (buckets, run) in runs.items()}}
    print(f"{args.dataset}: {len(lengths)} prompts, max_running_requests {args.max_running_requests}, "
          f"max_batch_tokens {args.max_batch_tokens}")
    print(f"{'buckets':<42} {'steps':>5} {'kind':<8} {'steps':>5} {'rows':>8} {'graph rows':>10} {'padding':>8} "
          f"{'per step':>8} {'share':>6}")
    for name, report in result["runs"].items():
        for kind in ("mixed", "prefill"):
            entry = report[kind]
            if entry["steps"]:
                print(f"{name:<42} {report['steps']:>5} {kind:<8} {entry['steps']:>5} {entry['rows']:>8} "
                      f"{entry['graph_rows']:>10} {entry['padding_rows']:>8} {entry['padding_rows_per_step']:>8} "
                      f"{entry['padding_share']:>6.3f}")
    print(f"engine buckets: {','.join(map(str, TOKEN_BUCKETS))}; other: {','.join(map(str, other))}")
    chunks = result["chunks"]
    print(f"steps with prompt rows: {chunks['steps_with_prompt_rows']}, of which {chunks['ending_on_a_chunk']} with a "
          f"prompt chunk that does not end its prompt")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
