"""`lorad router` in front of real demo daemons (CPU): each policy's split of concurrent requests, streaming
end to end, refusals as JSON, a client that leaves aborts the request in its backend, a backend killed
mid-stream ends that stream with a 502 error while the others keep serving, and comes back when it does.
Also: the view a backend's live state gives the policies, and the 2-GPU benchmark script parses."""

from __future__ import annotations

import dataclasses

import json
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import pytest
from lorad.client import Client, UnixHTTPConnection
from lorad.daemon.router.backends import Backend, InFlightRequest

# test_cli.py's daemon starter (pytest puts this folder on sys.path).
from daemon_harness import COMMAND, start_daemon, stop_daemon, wait_healthy

from lorad.errors import BackendError, BadRequest, LoradError, ModelNotFound

REPOSITORY = Path(__file__).resolve().parents[3]
LONG = {"prompt": [17, 18, 19, 20], "max_tokens": 120, "ignore_eos": True, "temperature": 0}  # outlives the checks (context 128)


def wait_until(condition, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


@pytest.fixture(scope="module")
def workdir():
    directory = Path(tempfile.mkdtemp(prefix="lorad-router-", dir="/tmp"))  # AF_UNIX paths: short
    yield directory
    shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture(scope="module")
def daemons(demo_assets, workdir):
    """Two demo daemons for the whole module: their sockets."""
    paths = [workdir / "a.sock", workdir / "b.sock"]
    processes = [start_daemon(demo_assets, path) for path in paths]
    try:
        for process, path in zip(processes, paths):
            wait_healthy(process, path)
        yield [str(path) for path in paths]
    finally:
        for process in processes:
            stop_daemon(process)


class RouterProcess:
    def __init__(self, workdir: Path, backends: list[str], *flags: str):
        self.path = workdir / "router.sock"
        self.log = workdir / "router.log"
        argv = COMMAND + ["router", "--socket", str(self.path), "--poll-interval-ms", "50", *flags]
        for backend in backends:
            argv += ["--backend", backend]
        with open(self.log, "w") as log:
            self.process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
        self.client = Client(str(self.path), timeout=30)
        deadline = time.monotonic() + 20
        while True:
            assert self.process.poll() is None, f"lorad router exited: {self.log.read_text()}"
            try:
                if self.client.health()["backends_up"] == len(backends):
                    break
            except (OSError, LoradError):  # 503 until its first polls answer
                pass
            assert time.monotonic() < deadline, f"the router did not see its backends: {self.log.read_text()}"
            time.sleep(0.02)

    def backend(self, socket_path: str) -> dict:
        return next(b for b in self.client.status()["backends"] if b["socket"] == socket_path)

    def close(self) -> None:
        stop_daemon(self.process)
        assert self.process.returncode == 0, self.log.read_text()
        assert not self.path.exists()  # the router removes its socket


@pytest.fixture
def router_factory(workdir):
    started = []

    def start(backends: list[str], *flags: str) -> RouterProcess:
        router = RouterProcess(workdir, backends, *flags)
        started.append(router)
        return router

    yield start
    for router in started:
        router.close()


def first_chunk(stream) -> dict:
    chunk = next(stream)
    assert chunk["choices"][0]["text"] is not None
    return chunk


# --- routing per policy, streaming ---------------------------------------------------------------------


@pytest.mark.parametrize("policy, flags, expected", [
    ("most-idle", (), (1, 1)),
    ("rank-aware", ("--tpot-slo-ms", "50"), (1, 1)),  # an idle engine costs nobody anything: Algorithm 1
    ("first-fit", (), (2, 0)),  # Punica: the first engine below its batch limit
])
def test_policy_splits_concurrent_streams(router_factory, daemons, policy, flags, expected):
    router = router_factory(daemons, "--policy", policy, *flags)
    streams = [router.client.stream_completions(model="demo-r16", **LONG) for _ in range(2)]
    for stream in streams:  # both are running upstream before either ends
        first_chunk(stream)
    status = router.client.status()
    assert status["router"]["policy"] == policy.replace("-", "_")
    assert tuple(status["router"]["decisions"][path] for path in daemons) == expected
    assert tuple(router.backend(path)["in_flight"] for path in daemons) == expected
    for stream in streams:
        tokens = 1 + sum(1 for _ in stream)  # every chunk up to [DONE] came through
        assert tokens == LONG["max_tokens"]
    wait_until(lambda: all(router.backend(path)["in_flight"] == 0 for path in daemons))


def test_streaming_and_plain_answers_match_a_backend(router_factory, daemons):
    router = router_factory(daemons, "--policy", "most-idle")
    fields = {"model": "demo-r4", "prompt": "Hello there", "max_tokens": 6, "temperature": 0, "return_token_ids": True}
    direct = Client(daemons[0]).completions(**fields)
    routed = router.client.completions(**fields)
    assert routed["choices"][0]["token_ids"] == direct["choices"][0]["token_ids"]
    assert routed["usage"] == direct["usage"]
    streamed = [c for c in router.client.stream_completions(**fields, stream_options={"include_usage": True})]
    assert [t for c in streamed for choice in c["choices"] for t in choice["token_ids"]] == \
        direct["choices"][0]["token_ids"]
    assert streamed[-1]["usage"] == direct["usage"]
    chat = {"model": "demo-r4", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 5, "temperature": 0}
    assert router.client.chat_completions(**chat)["choices"] == Client(daemons[0]).chat_completions(**chat)["choices"]

    models = router.client.models()
    assert models[0]["id"] == "lorad-demo" and models[0]["backends"] == daemons
    assert {m["id"] for m in models} >= {"demo-r1", "demo-r4", "demo-r16", "demo-r64"}
    assert router.client.model("demo-r4") == next(m for m in models if m["id"] == "demo-r4")
    with pytest.raises(ModelNotFound, match="'no-such-adapter' does not exist on any backend"):
        router.client.model("no-such-adapter")
    assert "lorad_router_decisions_total" in router.client.metrics()


# --- refusals -------------------------------------------------------------------------------------------


def raw_post(path: Path, body: bytes, route: str = "/v1/completions", method: str = "POST") -> tuple[int, dict]:
    connection = UnixHTTPConnection(str(path), timeout=10)
    try:
        connection.request(method, route, body=body, headers={"Content-Type": "application/json"})
        response = connection.getresponse()
        return response.status, json.loads(response.read())
    finally:
        connection.close()


def test_bad_input_is_refused_with_json(router_factory, daemons):
    router = router_factory(daemons, "--policy", "random")
    for body, status, kind in [
        (b"{not json", 400, "invalid_request_error"),
        (b'{"model": "demo-r4", "prompt": [' + b"1" * 5000 + b"]}", 400, "invalid_request_error"),  # too many digits
        (b'{"model": "demo-r4", "prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", 400, "invalid_request_error"),
        # over 256 KiB: parsed in the body parser's process, and refused as the daemon refuses it
        (b'{"model": "demo-r4", "prompt": ' + b"[" * 200_000 + b"]" * 200_000 + b"}", 400, "invalid_request_error"),
        (json.dumps({"model": "demo-r4", "prompt": "lighthouse " * 100_000}).encode(), 400, "context_length_exceeded"),
        (b'{"model": "demo-r4", "prompt": "hi", "bogus": 1}', 400, "invalid_request_error"),
        (b'{"model": "demo-r4", "prompt": "hi", "max_tokens": 0}', 400, "invalid_request_error"),
        (b'{"model": "demo-r4", "prompt": "hi", "max_tokens": 500}', 400, "context_length_exceeded"),  # backend's
        (b'{"model": "no-such-adapter", "prompt": "hi"}', 404, "model_not_found"),
    ]:
        code, answer = raw_post(router.path, body)
        assert (code, answer["error"]["type"]) == (status, kind), answer
        assert answer["error"]["code"] == status and answer["error"]["message"]
    assert raw_post(router.path, b"", "/v1/completions", "GET")[0] == 405
    assert raw_post(router.path, b"{}", "/v1/load_lora_adapter")[0] == 404
    with pytest.raises(ModelNotFound):
        router.client.completions(model="no-such-adapter", prompt="hi")
    with pytest.raises(BadRequest):
        router.client.completions(model="demo-r4", prompt=[])


def test_rank_aware_needs_its_objective(capsys):
    from lorad.daemon.server.cli import main

    assert main(["router", "--backend", "/tmp/x.sock", "--socket", "/tmp/lorad-router-test-unused.sock"]) == 2
    assert "--tpot-slo-ms" in capsys.readouterr().err


# --- a client that leaves ---------------------------------------------------------------------------------


def aborted(socket_path: str) -> float:
    for line in Client(socket_path).metrics().splitlines():
        if line.startswith('lorad_requests_total{finish_reason="abort"}'):
            return float(line.split()[-1])
    return 0.0


def test_client_disconnect_aborts_the_request_upstream(router_factory, daemons):
    router = router_factory(daemons, "--policy", "first-fit")  # everything to the first backend
    before = aborted(daemons[0])
    stream = router.client.stream_completions(model="demo-r8", **LONG)
    first_chunk(stream)
    assert Client(daemons[0]).status()["running"] == 1
    stream.close()  # leaves after one token: closes the connection to the router
    wait_until(lambda: aborted(daemons[0]) == before + 1)
    wait_until(lambda: router.backend(daemons[0])["in_flight"] == 0)
    status = Client(daemons[0]).status()
    assert status["running"] == 0 and status["waiting"] == 0

    # not streamed: the client leaves while the router waits for the whole answer
    connection = UnixHTTPConnection(str(router.path), timeout=10)
    connection.request("POST", "/v1/completions", body=json.dumps({"model": "demo-r8", **LONG}).encode(),
                       headers={"Content-Type": "application/json"})
    wait_until(lambda: Client(daemons[0]).status()["running"] == 1)
    connection.close()
    wait_until(lambda: aborted(daemons[0]) == before + 2)
    wait_until(lambda: router.backend(daemons[0])["in_flight"] == 0)


# --- a backend that dies ---------------------------------------------------------------------------------


def test_backend_killed_mid_stream(router_factory, daemons, demo_assets, workdir):
    doomed_path = workdir / "c.sock"
    doomed = start_daemon(demo_assets, doomed_path)
    revived = None
    try:
        wait_healthy(doomed, doomed_path)
        router = router_factory([daemons[0], str(doomed_path)], "--policy", "most-idle")
        survivor_stream = router.client.stream_completions(model="demo-r16", **LONG)
        first_chunk(survivor_stream)
        doomed_stream = router.client.stream_completions(model="demo-r16", **LONG)
        first_chunk(doomed_stream)
        assert router.backend(str(doomed_path))["in_flight"] == 1

        doomed.kill()  # no shutdown: connections drop mid-stream
        doomed.wait()
        with pytest.raises(BackendError) as failure:
            for _ in doomed_stream:
                pass
        assert failure.value.status == 502 and str(doomed_path) in failure.value.message
        down = router.backend(str(doomed_path))
        assert not down["up"] and down["down_reason"] and down["failed"] == 1

        # the rest is served by the survivor, the stream already there included
        assert 1 + sum(1 for _ in survivor_stream) == LONG["max_tokens"]
        for _ in range(3):
            answer = router.client.completions(model="demo-r4", prompt="hi", max_tokens=2, ignore_eos=True)
            assert answer["choices"][0]["finish_reason"] == "length"
        assert router.client.health()["backends_up"] == 1
        assert router.client.status()["router"]["decisions"][str(doomed_path)] == 1

        # a daemon on the same socket again: polled back up, and routed to
        revived = start_daemon(demo_assets, doomed_path)
        wait_healthy(revived, doomed_path)
        wait_until(lambda: router.backend(str(doomed_path))["up"])
        streams = [router.client.stream_completions(model="demo-r1", **LONG) for _ in range(2)]
        for stream in streams:
            first_chunk(stream)
        assert router.backend(str(doomed_path))["in_flight"] == 1
        for stream in streams:
            stream.close()
    finally:
        for process in (doomed, revived):
            if process is not None:
                stop_daemon(process)


# --- the view the policies read -------------------------------------------------------------------------------


def test_backend_view_counts_own_and_foreign_requests():
    backend = Backend(3, "/nonexistent.sock")
    streamed = InFlightRequest(rank=16, prompt_tokens=10, max_tokens=50, streamed=True, generated=5)
    plain = InFlightRequest(rank=8, prompt_tokens=20, max_tokens=30, streamed=False)
    queued = InFlightRequest(rank=64, prompt_tokens=7, max_tokens=9, streamed=True)
    for flight in (streamed, plain, queued):
        backend.in_flight[flight.id] = flight
    # the engine's batch: ours (rank 16 and 8 running, 64 waiting) and two of someone else's
    backend.status = {"max_running_requests": 4, "free_kv_tokens": 1000}
    backend._find_foreign_requests(running=[[16, 15, 45], [8, 26, 24], [32, 100, 10]], waiting=[[64, 7], [4, 12]])
    assert backend.foreign_running == [(32, 10, 100)] and backend.foreign_waiting == [(4, 12)]
    assert plain.running and plain.generated == 6  # learned from the poll: it is not streamed
    view = backend.engine_view()
    assert (view.engine_id, view.max_running, view.free_kv_tokens) == (3, 4, 1000)
    assert (view.num_running, view.num_queued) == (3, 2)
    assert view.rank_counts == {16: 1, 8: 1, 32: 1, 64: 1, 4: 1} and view.max_rank == 64
    assert view.context_tokens == 15 + 26 + 100 + 7 + 12
    assert view.remaining_tokens == 45 + 24 + 10


def tp_status(size: int, running: list | None = None) -> dict:
    """A /v1/status as a lorad engine spanning `size` GPUs answers it (the fields the router reads)."""
    return {"max_running_requests": 8, "free_kv_tokens": 1000, "running_batch": running or [], "waiting_batch": [],
            "tensor_parallel": {"size": size, "gpus": [f"cuda:{index}" for index in range(size)]}}


def test_a_tensor_parallel_backend_is_one_engine_spanning_its_gpus():
    backend = Backend(0, "/nonexistent.sock")
    backend.status = tp_status(2)
    view = backend.engine_view()  # one batch, one KV capacity: the engine's, whatever GPUs it spans
    assert (view.tensor_parallel_size, view.max_running, view.free_kv_tokens) == (2, 8, 1000)
    described = backend.describe()
    assert described["tensor_parallel_size"] == 2 and described["gpus"] == ["cuda:0", "cuda:1"]
    backend.status = {"max_running_requests": 8, "free_kv_tokens": 1000}  # a lorad that does not say: one GPU
    assert backend.engine_view().tensor_parallel_size == 1 and backend.describe()["gpus"] is None


def test_rank_aware_predicts_each_backend_with_its_sizes_profile(caplog):
    from lorad.daemon.router.server import Router
    from lorad.scheduler.perf_model import example_profile
    from lorad.scheduler.router import RankAware, RouteRequest

    one_gpu, two_gpus = example_profile("mbgmv"), example_profile("mbgmv")
    two_gpus = dataclasses.replace(two_gpus, decode=dataclasses.replace(two_gpus.decode, per_request_s=1e-6,
                                                                          fixed_s=0.015))
    busy = [[16, 100, 50]] * 4  # the same batch on both
    request = RouteRequest(rank=16, prompt_tokens=100)

    def routed(sized: dict) -> tuple[int, list]:
        policy = RankAware(one_gpu.decode, one_gpu.prefill, 1.0, 128.0, mixed_steps=True, by_tensor_parallel_size=sized)
        router = Router(["/a.sock", "/b.sock"], policy)
        for backend, size in zip(router.backends, (1, 2)):
            backend.status = tp_status(size)
            backend._find_foreign_requests(busy, [])
        caplog.clear()
        chosen = router.choose(request, router.backends).index
        router.choose(request, router.backends)  # said once per size
        return chosen, [record.getMessage() for record in caplog.records if "tensor_parallel_size" in record.getMessage()]

    # Each engine's step from its own size's profile: the TP=2 engine's batch grows cheaper.
    chosen, warnings = routed({1: (one_gpu.decode, one_gpu.prefill), 2: (two_gpus.decode, two_gpus.prefill)})
    assert chosen == 1 and warnings == []
    # No profile of size 2: predicted with the first one, and the router says so.
    chosen, warnings = routed({1: (one_gpu.decode, one_gpu.prefill)})
    assert chosen == 0 and len(warnings) == 1
    assert "spans 2 GPUs (tensor_parallel_size 2) and no --profile was measured at that size" in warnings[0]


# --- the 2-GPU benchmark script ---------------------------------------------------------------------------------


def test_router_benchmark_script_parses():
    script = REPOSITORY / "bench" / "router_2gpu.sh"
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True, check=False).returncode == 0
    usage = subprocess.run(["bash", str(script)], capture_output=True, text=True, check=False)
    assert usage.returncode == 2 and "usage" in usage.stderr.lower()


def test_make_policy_rank_aware_charges_prefill_for_mixed_steps(tmp_path):
    """`lorad router`'s rank-aware policy models lorad's engines (prefill chunks in decode steps) and says so
    in /v1/status; it needs a time-per-token objective; the baselines take no profile."""
    import argparse

    from lorad.daemon.router.cli import make_policy
    from lorad.scheduler.perf_model import example_profile
    from lorad.scheduler.router import MostIdle, RankAware

    profile = tmp_path / "profile.json"
    example_profile("mbgmv").save(profile)
    args = argparse.Namespace(policy="rank-aware", seed=0, tpot_slo_ms=40.0, avg_response_tokens=128.0,
                              profile=[str(profile)], kernel="mbgmv")
    policy, about = make_policy(args)
    assert isinstance(policy, RankAware) and policy.mixed_steps and about["mixed_steps"] is True
    assert about["tpot_slo_s"] == pytest.approx(0.04) and about["profile"]["path"] == str(profile)
    with pytest.raises(BadRequest, match="tpot-slo-ms"):
        make_policy(argparse.Namespace(**{**vars(args), "tpot_slo_ms": None}))
    assert isinstance(make_policy(argparse.Namespace(**{**vars(args), "policy": "most-idle"}))[0], MostIdle)
    # --kernel with a measured profile: the decode model of engines run with --lora-kernel KERNEL
    measured = example_profile("mbgmv")
    bgmv = example_profile("bgmv").decode
    measured.notes["decode_bgmv"] = {**dataclasses.asdict(bgmv), "lora": {"kernel": "bgmv", **dataclasses.asdict(bgmv.lora)}}
    measured.save(profile)
    policy, about = make_policy(argparse.Namespace(**{**vars(args), "kernel": "bgmv"}))
    assert policy.decode == bgmv and about["profile"]["kernel"] == "bgmv"
    policy, about = make_policy(argparse.Namespace(**{**vars(args), "kernel": None}))
    assert about["profile"]["kernel"] == "mbgmv"
    # One profile per tensor-parallel size: each engine is predicted with its size's.
    tp2 = tmp_path / "profile-tp2.json"
    dataclasses.replace(example_profile("mbgmv"), machine={"tensor_parallel_size": 2, "measured": True}).save(tp2)
    policy, about = make_policy(argparse.Namespace(**{**vars(args), "profile": [str(profile), str(tp2)]}))
    assert sorted(policy.by_tensor_parallel_size) == [1, 2]
    assert about["profiles_by_tensor_parallel_size"] == {1: str(profile), 2: str(tp2)}
    assert about["profile"]["tensor_parallel_size"] == 1
    with pytest.raises(BadRequest, match="both measured at tensor_parallel_size 2"):
        make_policy(argparse.Namespace(**{**vars(args), "profile": [str(tp2), str(tp2)]}))
