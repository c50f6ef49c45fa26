"""daemon/server/metrics.py and GET /metrics: the text exposition format (checked by a small parser written
here), the names routers read, and values that move as the demo engine serves requests."""

from __future__ import annotations

import math
import pickle
import re
import threading
import time

import pytest

from lorad.config import EngineConfig
from lorad.client import Client
from lorad.daemon.engine.engine import Engine
from lorad.daemon.engine.stats import Metrics
from lorad.daemon.server.metrics import CONTENT_TYPE, render
from lorad.errors import ModelNotFound

from daemon_harness import raw_request, serve_engine

# --- a small parser of the text format (0.0.4) ---------------------------------------------------------

_NAME = r"[a-zA-Z_:][a-zA-Z0-9_:]*"
_SAMPLE = re.compile(rf"^({_NAME})(?:\{{(.*)\}})? (\S+)$")
_LABEL = re.compile(r'\s*([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"\s*(,|$)')
_SUFFIXES = {"histogram": ("_bucket", "_sum", "_count"), "counter": ("",), "gauge": ("",)}


def parse(text: str) -> dict:
    """{family: {"type", "help", "samples": [(name, labels, value)]}}; asserts the format's rules."""
    assert text.endswith("\n")
    families: dict[str, dict] = {}
    current = None
    for line in text.splitlines():
        assert line, "blank line"
        if line.startswith("# HELP "):
            name, _, help_text = line[len("# HELP "):].partition(" ")
            assert re.fullmatch(_NAME, name) and name not in families, line
            families[name] = {"help": help_text, "type": None, "samples": []}
        elif line.startswith("# TYPE "):
            name, kind = line[len("# TYPE "):].split(" ")
            assert name in families and families[name]["type"] is None and not families[name]["samples"], line
            assert kind in _SUFFIXES, line
            families[name]["type"] = kind
            current = name
        else:
            match = _SAMPLE.match(line)
            assert match, f"not a sample line: {line!r}"
            name, label_text, value = match.groups()
            assert current is not None and any(name == current + s for s in _SUFFIXES[families[current]["type"]]), (
                f"{name} outside its family {current}")
            labels = {}
            position = 0
            while label_text and position < len(label_text):
                label = _LABEL.match(label_text, position)
                assert label, f"bad labels: {label_text!r}"
                key, raw = label.group(1), label.group(2)
                assert key not in labels
                labels[key] = re.sub(r"\\(.)", lambda m: {"n": "\n"}.get(m.group(1), m.group(1)), raw)
                position = label.end()
            families[current]["samples"].append((name, labels, float(value)))  # float() reads +Inf and NaN
    for name, family in families.items():
        assert family["type"] is not None, f"{name} has no TYPE"
        if family["type"] == "histogram":
            check_histogram(name, family["samples"])
        if family["type"] == "counter":
            assert name.endswith("_total") and all(value >= 0 for _, _, value in family["samples"]), name
    return families


def check_histogram(name: str, samples: list) -> None:
    series: dict[tuple, dict] = {}
    for sample_name, labels, value in samples:
        key = tuple(sorted((k, v) for k, v in labels.items() if k != "le"))
        entry = series.setdefault(key, {"buckets": [], "sum": None, "count": None})
        if sample_name.endswith("_bucket"):
            entry["buckets"].append((float(labels["le"]), value))
        else:
            entry[sample_name.rsplit("_", 1)[1]] = value
    for entry in series.values():
        bounds = [bound for bound, _ in entry["buckets"]]
        counts = [count for _, count in entry["buckets"]]
        assert bounds == sorted(bounds) and bounds[-1] == math.inf, name
        assert counts == sorted(counts), f"{name}: buckets are not cumulative"
        assert counts[-1] == entry["count"] and entry["sum"] is not None, name


def value(families: dict, name: str, **labels) -> float:
    family = families[re.sub(r"_(bucket|sum|count)$", "", name) if name not in families else name]
    matches = [v for n, l, v in family["samples"] if n == name and all(l.get(k) == str(w) for k, w in labels.items())]
    assert len(matches) == 1, (name, labels, family["samples"])
    return matches[0]


# --- the formatter alone ----------------------------------------------------------------------------------

GAUGES = dict(model="m", running=2, waiting=3, running_adapters=["a", None, "a", "b"], waiting_adapters=[],
              max_lora=1024, pool={"pages": 100, "free": 50, "kv": 30, "adapter": 20, "page_bytes": 256},
              adapters_resident=2, adapter_evictions=4, preemptions=5, step_running_s=41.5, stalled_steps=1)


def test_render_parses_and_carries_the_values():
    metrics = Metrics()
    metrics.first_token(0.003)
    metrics.first_token(30.0)  # past the last bucket: only +Inf
    metrics.request_finished("length", prompt_tokens=5, generation_tokens=4, latency_s=0.2, decode_s=0.03)
    metrics.request_finished("abort", prompt_tokens=7, generation_tokens=0, latency_s=0.1, decode_s=None)
    metrics.adapter_loaded("disk_to_host", 0.02)
    metrics.adapter_loaded("host_to_pool", 0.001)
    metrics.cold_start()
    snapshot = metrics.snapshot(**GAUGES)
    families = parse(render(pickle.loads(pickle.dumps(snapshot))))

    assert value(families, "vllm:num_requests_running", model_name="m") == 2
    assert value(families, "vllm:num_requests_waiting", model_name="m") == 3
    assert value(families, "vllm:gpu_cache_usage_perc", model_name="m") == 0.3
    (_, info, stamp), = families["vllm:lora_requests_info"]["samples"]
    assert info == {"running_lora_adapters": "a,b", "waiting_lora_adapters": "", "max_lora": "1024"}
    assert abs(stamp - time.time()) < 60
    assert value(families, "lorad_requests_total", finish_reason="length") == 1
    assert value(families, "lorad_requests_total", finish_reason="abort") == 1
    assert value(families, "lorad_requests_total", finish_reason="stop") == 0
    assert value(families, "lorad_prompt_tokens_total") == 12
    assert value(families, "lorad_generation_tokens_total") == 4
    assert value(families, "lorad_time_to_first_token_seconds_count") == 2
    assert value(families, "lorad_time_to_first_token_seconds_bucket", le="0.005") == 1
    assert value(families, "lorad_time_to_first_token_seconds_bucket", le="20.0") == 1
    assert value(families, "lorad_time_to_first_token_seconds_bucket", le="+Inf") == 2
    assert value(families, "lorad_time_to_first_token_seconds_sum") == pytest.approx(30.003)
    assert value(families, "lorad_time_per_output_token_seconds_sum") == pytest.approx(0.01)  # 0.03 / 3 gaps
    assert value(families, "lorad_adapter_loads_total", tier="disk_to_host") == 1
    assert value(families, "lorad_adapter_load_seconds_count", tier="host_to_pool") == 1
    assert value(families, "lorad_cold_starts_total") == 1
    assert value(families, "lorad_pool_pages", owner="free") == 50
    assert value(families, "lorad_adapter_evictions_total") == 4
    assert value(families, "lorad_preemptions_total") == 5
    assert value(families, "lorad_engine_step_running_seconds") == 41.5
    assert value(families, "lorad_engine_stalled_steps_total") == 1
    assert value(families, "lorad_cpu_worker_restarts_total") == 0
    assert value(families, "lorad_cpu_jobs_native_total") == 0


def test_the_device_clocks_split_of_step_time_is_rendered_by_kind(demo_assets):
    """On cuda the account's device clock: the forwards, the tokens' work after them and the waits before them."""
    from lorad.daemon.engine.step_account import StepAccount
    from lorad.daemon.engine.step_cost import DeviceRates, StepCostModel
    from lorad.daemon.model.checkpoint import load_spec
    from step_fakes import FakeEvent, Seq, plan

    account = StepAccount(StepCostModel(load_spec(demo_assets.model_dir), 4, adapter_ranks=lambda name: {}),
                          DeviceRates(1e9, 1e9), device_clock=True, new_event=FakeEvent)
    FakeEvent.clock, FakeEvent.next_at = 0.0, 0.0
    account.begin(0.0)
    for at in (0.0, 1.0):  # two decode steps of a 0.25 s forward and 0.25 s of tokens, the device idle 0.5 s between
        FakeEvent.next_at = at
        account.before_forward()
        account.launched(plan([(Seq(prompt_len=4), 7, 1, True)]), now=at)
        account.tokens_queued()
    FakeEvent.clock = 2.0
    account.landed(0.5)
    account.landed(1.5)
    families = parse(render(Metrics().snapshot(**GAUGES, steps=account.metrics())))
    assert value(families, "lorad_step_device_seconds_total", kind="decode") == pytest.approx(0.5)
    assert value(families, "lorad_step_tokens_device_seconds_total", kind="decode") == pytest.approx(0.5)
    assert value(families, "lorad_step_before_forward_seconds_total", kind="decode") == pytest.approx(0.5)
    assert value(families, "lorad_step_before_forward_seconds_total", kind="mixed") == 0


def test_a_bucket_bound_is_inclusive():
    metrics = Metrics()
    metrics.first_token(0.01)
    families = parse(render(metrics.snapshot(**GAUGES)))
    assert value(families, "lorad_time_to_first_token_seconds_bucket", le="0.01") == 1
    assert value(families, "lorad_time_to_first_token_seconds_bucket", le="0.005") == 0


def test_label_values_are_escaped():
    gauges = {**GAUGES, "model": 'a "quoted"\\name\nnext', "running_adapters": ["x,y"]}
    families = parse(render(Metrics().snapshot(**gauges)))
    assert value(families, "vllm:num_requests_running", model_name='a "quoted"\\name\nnext') == 2


def test_parser_refuses_broken_text():
    with pytest.raises(AssertionError):
        parse("# HELP x a\n# TYPE x gauge\nx{a=\"1} 2\n")
    with pytest.raises(AssertionError):
        parse("y 1\n")
    with pytest.raises(AssertionError):  # buckets that are not cumulative
        parse('# HELP h x\n# TYPE h histogram\nh_bucket{le="1"} 2\nh_bucket{le="+Inf"} 1\nh_sum 1\nh_count 1\n')


# --- GET /metrics on the demo engine --------------------------------------------------------------------


@pytest.fixture
def demo(demo_assets):
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("LORAD_DEMO_DIR", str(demo_assets.model_dir.parent))
        engine = Engine(EngineConfig(demo=True, device="cpu", pool_bytes=8 << 20, max_model_len=64,
                                     max_running_requests=1))
    with serve_engine(engine, "metrics.sock") as server:
        yield Client(server.path, timeout=30), engine, server


def scrape(server) -> dict:
    status, headers, payload = raw_request(server.path, "GET", "/metrics")
    assert status == 200 and headers["Content-Type"] == CONTENT_TYPE
    return parse(payload.decode())


def test_metrics_move_as_requests_run(demo):
    client, engine, server = demo
    before = scrape(server)
    assert value(before, "vllm:num_requests_running", model_name="lorad-demo") == 0
    assert value(before, "lorad_requests_total", finish_reason="length") == 0
    assert value(before, "lorad_pool_pages", owner="kv") == 0
    assert value(before, "lorad_preemptions_total") == 0
    assert value(before, "lorad_engine_step_running_seconds") == 0  # between steps
    assert value(before, "lorad_engine_stalled_steps_total") == 0

    client.completions(model="demo-r4", prompt="hello there", max_tokens=5, ignore_eos=True)
    client.completions(model="demo-r4", prompt="hello there", max_tokens=5, ignore_eos=True)
    after = scrape(server)
    prompt = len(engine.tokenizer.encode("hello there"))
    assert value(after, "lorad_requests_total", finish_reason="length") == 2
    assert value(after, "lorad_prompt_tokens_total") == 2 * prompt
    assert value(after, "lorad_generation_tokens_total") == 10
    assert value(after, "lorad_time_to_first_token_seconds_count") == 2
    assert value(after, "lorad_time_per_output_token_seconds_count") == 2
    assert value(after, "lorad_request_latency_seconds_count") == 2
    # demo-r4 was read once from disk and brought into the pool once: the first request was a cold start
    assert value(after, "lorad_adapter_loads_total", tier="disk_to_host") == 1
    assert value(after, "lorad_adapter_loads_total", tier="host_to_pool") == 1
    assert value(after, "lorad_adapter_load_seconds_count", tier="disk_to_host") == 1
    assert value(after, "lorad_cold_starts_total") == 1
    assert value(after, "lorad_adapters_resident") == 1
    assert value(after, "lorad_pool_pages", owner="adapter") > 0
    pages = sum(value(after, "lorad_pool_pages", owner=owner) for owner in ("kv", "adapter", "free"))
    assert pages == engine.pool.capacity
    # one request at a time: each one prompt step, then a decode step per token after the first
    assert value(after, "lorad_step_seconds_count", kind="prefill") == 2
    assert value(after, "lorad_step_seconds_count", kind="decode") == 8
    assert value(after, "lorad_step_seconds_count", kind="mixed") == 0
    assert value(after, "lorad_step_rows_total", kind="prefill") == 2 * prompt
    assert value(after, "lorad_step_prompt_tokens_total", kind="prefill") == 2 * prompt
    assert value(after, "lorad_step_rows_total", kind="decode") == 8
    assert value(after, "lorad_step_padding_rows_total", kind="decode") == 0  # eager on the cpu: no graph bucket
    # a cap of one running request, one request at a time: no step left a running slot empty
    assert value(after, "lorad_step_empty_slots_total", kind="decode", cause="no_request_waiting") == 0
    assert 0 < value(after, "lorad_step_floor_seconds_total", kind="decode")
    for kind in ("prefill", "decode"):  # never below the floor
        assert value(after, "lorad_step_serial_floor_seconds_total", kind=kind) >= value(after, "lorad_step_floor_seconds_total", kind=kind)
    assert 0 < value(after, "lorad_step_host_before_launch_seconds_total", kind="prefill", part="launch")
    assert "lorad_step_device_seconds_total" not in after  # no device clock on the cpu
    assert "lorad_step_before_forward_seconds_total" not in after
    assert 0 < value(after, "lorad_step_busy_seconds_total", kind="decode") == pytest.approx(
        value(after, "lorad_step_seconds_sum", kind="decode"))

    chunks = client.stream_completions(model="demo-r4", prompt="abc", max_tokens=2, ignore_eos=True)
    list(chunks)
    client.completions(model="lorad-demo", prompt="abc", max_tokens=1, ignore_eos=True)
    with pytest.raises(ModelNotFound):
        client.completions(model="nope", prompt="abc", max_tokens=1)  # refused: not counted as a request
    later = scrape(server)
    assert value(later, "lorad_requests_total", finish_reason="length") == 4
    assert value(later, "lorad_cold_starts_total") == 1  # demo-r4 stayed resident; the base model needs none


def test_running_and_waiting_adapters(demo):
    client, engine, server = demo
    forward = engine.runner.model.forward

    def slow_forward(*args, **kwargs):
        time.sleep(0.02)
        return forward(*args, **kwargs)

    engine.runner.model.forward = slow_forward
    try:
        running = client.stream_completions(model="demo-r1", prompt="abc", max_tokens=40, ignore_eos=True)
        next(running)
        # max_running_requests=1: the second request waits behind the first
        thread = threading.Thread(target=lambda: client.completions(model="demo-r2", prompt="abc", max_tokens=2,
                                                                    ignore_eos=True))
        thread.start()
        deadline = time.monotonic() + 10
        while engine.status()["waiting"] == 0:
            assert time.monotonic() < deadline
            time.sleep(0.005)
        families = scrape(server)
        assert value(families, "vllm:num_requests_running", model_name="lorad-demo") == 1
        assert value(families, "vllm:num_requests_waiting", model_name="lorad-demo") == 1
        (_, info, _), = families["vllm:lora_requests_info"]["samples"]
        assert info["running_lora_adapters"] == "demo-r1" and info["waiting_lora_adapters"] == "demo-r2"
        assert int(info["max_lora"]) > 0
        assert 0 < value(families, "vllm:gpu_cache_usage_perc", model_name="lorad-demo") < 1
    finally:
        engine.runner.model.forward = forward
    list(running)
    thread.join(10)
    assert value(scrape(server), "lorad_requests_total", finish_reason="length") == 2


def test_engine_snapshot_pickles(demo):
    _, engine, _ = demo
    snapshot = engine.metrics()
    assert pickle.loads(pickle.dumps(snapshot)) == snapshot
    assert snapshot["model"] == "lorad-demo" and snapshot["running"] == 0


def test_metrics_through_the_client(demo):
    client, _, _ = demo
    assert "vllm:num_requests_waiting" in client.metrics()
