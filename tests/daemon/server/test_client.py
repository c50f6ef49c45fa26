"""lorad.client: AsyncClient against the fake engine of test_api.py (every route, typed errors, leaving a
stream early), both clients when no daemon listens, and the client-side CLI (`lorad generate`,
`lorad adapters`, `lorad status`) against the demo engine."""

from __future__ import annotations

import asyncio
import json
import shutil

import pytest

import lorad.client
from lorad.config import EngineConfig
from lorad.daemon.server.client_cli import client_main
from lorad.errors import AdapterError, BadRequest, LoradError, ModelNotFound, NotFound, Overloaded

from daemon_harness import serve_engine
from test_api import engine, server, wait_until  # noqa: F401 (fixtures)

AsyncClient, Client = lorad.client.AsyncClient, lorad.client.Client


def run(coroutine):
    return asyncio.run(coroutine)


# --- AsyncClient ----------------------------------------------------------------------------------------


def test_async_routes(server):
    async def go():
        async with AsyncClient(server.path, timeout=10) as client:
            assert await client.health() == {"status": "ok"}
            assert [m["id"] for m in await client.models()][:2] == ["fake-base", "sql"]
            assert (await client.model("sql"))["rank"] == 8
            assert await client.status() == {"model": "fake-base", "running": 0}
            answer = await client.completions(model="sql", prompt="hello", max_tokens=3)
            assert answer["choices"][0]["text"] == "hel" and answer["usage"]["completion_tokens"] == 3
            chunks = [chunk async for chunk in client.stream_completions(model="chat", prompt="hey", max_tokens=3)]
            assert "".join(c["choices"][0]["text"] for c in chunks) == "hey"
            assert chunks[-1]["choices"][0]["finish_reason"] == "length"
            # many calls at once over the session's connections
            answers = await asyncio.gather(*(
                client.completions(model="fake-base", prompt=f"p{i:02d}", max_tokens=3) for i in range(30)))
            assert [a["choices"][0]["text"] for a in answers] == [f"p{i:02d}" for i in range(30)]

    run(go())


def test_async_typed_errors(server, engine):
    async def go():
        async with AsyncClient(server.path, timeout=10) as client:
            with pytest.raises(ModelNotFound) as caught:
                await client.completions(model="nope", prompt="hi")
            assert caught.value.status == 404 and caught.value.type == "model_not_found"
            assert "'nope'" in caught.value.message
            with pytest.raises(ModelNotFound, match="'nope'"):
                await client.model("nope")
            with pytest.raises(BadRequest, match="max_tokens"):
                await client.completions(model="fake-base", prompt="hi", max_tokens=0)
            with pytest.raises(BadRequest, match="max_tokens"):
                async for _ in client.stream_completions(model="fake-base", prompt="hi", max_tokens=0):
                    pass
            with pytest.raises(AdapterError, match="corrupt"):
                await client.completions(model="broken", prompt="hi")
            with pytest.raises(LoradError) as caught:  # failed after the stream began: an error event
                async for _ in client.stream_completions(model="failing", prompt="hi"):
                    pass
            assert caught.value.status == 500 and "vanished" in caught.value.message
            engine.max_waiting = 0
            with pytest.raises(Overloaded) as caught:
                await client.completions(model="fake-base", prompt="hi")
            assert caught.value.retry_after_s == 3 and caught.value.status == 503
            engine.max_waiting = 1000
            assert (await client.completions(model="fake-base", prompt="ok", max_tokens=2))["choices"][0]["text"] == "ok"

    run(go())


def test_async_stream_left_early_aborts(server, engine):
    async def go():
        async with AsyncClient(server.path, timeout=10) as client:
            chunks = client.stream_completions(model="slow", prompt="abc", max_tokens=100)
            first = await chunks.__anext__()
            await chunks.aclose()
            return first["id"], await client.health()

    request_id, health = run(go())
    wait_until(lambda: request_id in engine.aborted)
    assert health == {"status": "ok"}


def test_no_daemon_is_an_oserror(short_tmp):
    path = f"{short_tmp}/absent.sock"
    with pytest.raises(OSError):
        Client(path).health()

    async def go():
        async with AsyncClient(path) as client:
            await client.health()

    with pytest.raises(OSError):
        run(go())


# --- the CLI ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def demo_daemon(demo_assets):
    from lorad.daemon.engine.engine import Engine

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("LORAD_DEMO_DIR", str(demo_assets.model_dir.parent))
        engine = Engine(EngineConfig(demo=True, device="cpu", pool_bytes=8 << 20, max_model_len=64))
    with serve_engine(engine, "cli.sock") as server:
        yield server.path, engine, demo_assets


def test_async_admin_and_metrics(demo_daemon):
    path, _, assets = demo_daemon

    async def go():
        async with AsyncClient(path, timeout=30) as client:
            entry = await client.load_adapter("async-made", str(assets.adapters["demo-r1"]))
            assert entry["rank"] == 1 and entry["id"] == "async-made"
            answer = await client.completions(model="async-made", prompt="hi", max_tokens=2, ignore_eos=True)
            assert answer["usage"]["completion_tokens"] == 2
            assert "lorad_requests_total" in await client.metrics()
            assert await client.unload_adapter("async-made") == {"id": "async-made", "object": "model", "deleted": True}
            with pytest.raises(NotFound):
                await client.unload_adapter("async-made")
            with pytest.raises(BadRequest, match="lora_path is required"):
                await client._json("POST", "/v1/load_lora_adapter", {"lora_name": "x"})

    run(go())


def cli(capsys, *argv) -> tuple[int, str, str]:
    code = client_main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_generate_streams_the_completion(demo_daemon, capsys):
    path, _, _ = demo_daemon
    reference = Client(path).completions(model="demo-r8", prompt="Once upon", max_tokens=6, temperature=0)
    code, out, err = cli(capsys, "generate", "--adapter", "demo-r8", "--max-tokens", "6", "--temperature", "0",
                         "--socket", path, "Once upon")
    assert code == 0 and err == "" and out == reference["choices"][0]["text"] + "\n"
    code, same, _ = cli(capsys, "generate", "--model", "demo-r8", "--max-tokens", "6", "--temperature", "0",
                        "--socket", path, "Once upon")
    assert code == 0 and same == out
    code, base, _ = cli(capsys, "generate", "--max-tokens", "3", "--socket", path, "hi")  # the base model
    assert code == 0 and base.endswith("\n")


def test_adapters_list_load_unload(demo_daemon, capsys, tmp_path):
    path, _, assets = demo_daemon
    code, out, _ = cli(capsys, "adapters", "list", "--socket", path)
    lines = out.splitlines()
    assert code == 0 and lines[0].split() == ["NAME", "RANK", "TARGETS", "SIZE", "LOCATION", "PATH"]
    assert {line.split()[0] for line in lines[1:]} >= {"demo-r1", "demo-r64"}

    source = assets.adapters["demo-r2"]
    code, out, err = cli(capsys, "adapters", "load", "cli-made", str(source), "--socket", path)
    assert code == 0 and out.startswith("loaded cli-made: rank 2, targets q_proj,k_proj,v_proj,o_proj"), (out, err)
    code, out, _ = cli(capsys, "adapters", "list", "--json", "--socket", path)
    entry = {e["id"]: e for e in json.loads(out)}["cli-made"]
    assert entry["rank"] == 2 and entry["location"] == "host"
    code, out, _ = cli(capsys, "adapters", "list", "--socket", path)
    (row,) = [line.split() for line in out.splitlines() if line.startswith("cli-made ")]
    assert row[1:3] == ["2", "q,k,v,o"] and row[5] == "host"

    code, out, _ = cli(capsys, "adapters", "unload", "cli-made", "--socket", path)
    assert code == 0 and "unloaded cli-made" in out
    code, _, err = cli(capsys, "adapters", "unload", "cli-made", "--socket", path)
    assert code == 2 and "'cli-made'" in err
    outside = tmp_path / "elsewhere"
    shutil.copytree(source, outside)
    code, _, err = cli(capsys, "adapters", "load", "x", str(outside), "--socket", path)
    assert code == 2 and "not under an adapter root" in err


def test_status(demo_daemon, capsys):
    path, _, _ = demo_daemon
    code, out, _ = cli(capsys, "status", "--socket", path)
    fields = dict(line.split(": ", 1) for line in out.splitlines())
    assert code == 0 and fields["model"] == "lorad-demo" and fields["device"] == "cpu"
    assert "pages=" in fields["pool"]
    code, out, _ = cli(capsys, "status", "--json", "--socket", path)
    assert json.loads(out)["model"] == "lorad-demo"


def test_refusals_and_usage_exit_2(demo_daemon, capsys):
    path, _, _ = demo_daemon
    code, _, err = cli(capsys, "generate", "--adapter", "nope", "--socket", path, "hi")
    assert code == 2 and "refused" in err and "'nope'" in err
    code, _, err = cli(capsys, "generate", "--max-tokens", "0", "--socket", path, "hi")
    assert code == 2 and "max_tokens" in err
    for argv in (["generate"], ["adapters"], ["adapters", "load", "x"], ["adapters", "frob"], ["status", "--bogus"],
                 ["generate", "--max-tokens", "many", "hi"], ["serve-me"], []):
        code, out, err = cli(capsys, *argv)
        assert code == 2 and out == "" and err.startswith("lorad") and "--help" in err, (argv, err)


def test_unreachable_exit_1(short_tmp, capsys):
    path = f"{short_tmp}/nobody.sock"
    for argv in (["generate", "hi"], ["adapters", "list"], ["adapters", "unload", "x"], ["status"]):
        code, out, err = cli(capsys, *argv, "--socket", path)
        assert code == 1 and f"cannot reach the daemon at {path}" in err, (argv, err)


def test_help_exits_0(capsys):
    code, out, _ = cli(capsys, "generate", "--help")
    assert code == 0 and "--adapter" in out and "--socket" in out
