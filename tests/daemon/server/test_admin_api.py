"""The adapter admin routes (vLLM's /v1/load_lora_adapter, /v1/unload_lora_adapter) on the real engine
serving the demo model: loads only from the adapter roots, every refusal leaves the registry as it was,
unload lets running requests finish, and API registrations survive a restart through state_dir.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import threading
import time

import pytest

from lorad.config import EngineConfig
from lorad.daemon.model.checkpoint import load_spec
from lorad.client import Client
from lorad.daemon.model.demo import MLP, write_random_adapter
from lorad.daemon.engine.engine import Engine
from lorad.daemon.engine.request import GenerationRequest, SamplingParams
from lorad.errors import AdapterError, BadRequest, LoradError, ModelNotFound, NotFound

from daemon_harness import raw_request, serve_engine

MAX_RANK = 32


@pytest.fixture(scope="module")
def roots(demo_assets, tmp_path_factory):
    """An adapter root with good and broken adapters, and a directory outside every root."""
    base = tmp_path_factory.mktemp("admin")
    root, outside = base / "root", base / "outside"
    spec = load_spec(demo_assets.model_dir)
    shutil.copytree(demo_assets.adapters["demo-r8"], root / "good")
    shutil.copytree(demo_assets.adapters["demo-r64"], root / "over-rank")
    shutil.copytree(demo_assets.adapters["demo-r8"], outside / "good")
    corrupt = shutil.copytree(demo_assets.adapters["demo-r8"], root / "corrupt")
    (corrupt / "adapter_model.safetensors").write_bytes(b"\x00" * 5)
    pickled = shutil.copytree(demo_assets.adapters["demo-r8"], root / "pickled")
    (pickled / "adapter_model.safetensors").unlink()
    (pickled / "adapter_model.bin").write_bytes(b"\x80\x04 not even a real pickle")
    other_base = dataclasses.replace(spec, intermediate_size=spec.intermediate_size + 8)
    write_random_adapter(root / "wrong-shape", other_base, rank=4, targets=MLP, seed=3)
    (root / "escape").symlink_to(outside / "good", target_is_directory=True)
    return root, outside


def make_engine(demo_assets, roots, state_dir=None, **config) -> Engine:
    root, _ = roots
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("LORAD_DEMO_DIR", str(demo_assets.model_dir.parent))
        return Engine(EngineConfig(demo=True, device="cpu", pool_bytes=8 << 20, max_model_len=64,
                                   max_lora_rank=MAX_RANK, adapter_roots=(str(root),),
                                   state_dir=None if state_dir is None else str(state_dir), **config))


@pytest.fixture
def served(demo_assets, roots):
    """(client, engine, server) on a fresh engine: each test starts from the demo's adapters."""
    engine = make_engine(demo_assets, roots)
    with serve_engine(engine, "admin.sock") as server:
        yield Client(server.path, timeout=30), engine, server


def adapter_ids(client: Client) -> list[str]:
    return [entry["id"] for entry in client.models()[1:]]


def test_load_then_serve(served, roots):
    client, engine, _ = served
    root, _ = roots
    entry = client.load_adapter("customer-7", str(root / "good"))
    assert entry["id"] == "customer-7" and entry["parent"] == "lorad-demo" and entry["kind"] == "lora"
    assert entry["rank"] == 8 and entry["targets"] == ["q_proj", "k_proj", "v_proj"]
    assert entry["nbytes"] > 0 and entry["location"] == "host" and entry["path"] == str(root / "good")
    listed = {m["id"]: m for m in client.models()}["customer-7"]
    assert listed == entry  # the answer is the adapter's /v1/models entry, max_model_len included
    assert (listed["rank"], listed["location"], listed["max_model_len"]) == (8, "host", engine.max_model_len)
    # the same weights as demo-r8: the same greedy tokens
    fields = dict(prompt="The quick brown fox", max_tokens=6, temperature=0, return_token_ids=True)
    mine = client.completions(model="customer-7", **fields)["choices"][0]["token_ids"]
    assert mine == client.completions(model="demo-r8", **fields)["choices"][0]["token_ids"]
    # it has run, so it is in the page pool, which lives in host memory on the CPU engine
    assert {m["id"]: m for m in client.models()}["customer-7"]["location"] == "pool"
    assert "customer-7" in client.status()["adapters_resident"]


def test_models_locations(served):
    client, _, _ = served
    client.completions(model="demo-r2", prompt="hi", max_tokens=1)
    locations = {m["id"]: m.get("location") for m in client.models()}
    assert locations["demo-r2"] == "pool" and locations["demo-r4"] == "disk"
    assert set(locations.values()) <= {None, "disk", "host", "pool", "gpu"}


@pytest.mark.parametrize(
    "path, error, fragment",
    [
        ("{outside}/good", BadRequest, "is not under an adapter root"),
        ("{root}/../outside/good", BadRequest, "is not under an adapter root"),
        ("{root}/escape", BadRequest, "is not under an adapter root"),
        ("{root}/absent", AdapterError, "does not exist"),
        ("{root}/" + "a" * 300, AdapterError, "does not exist"),  # a name longer than the file system's
        ("{root}/" + "/".join(["a" * 200] * 30), AdapterError, "does not exist"),  # a path longer than PATH_MAX
        ("{root}/nul\0name", BadRequest, "must not contain NUL"),
        ("{root}/\ud800", BadRequest, "lone surrogate"),
        ("{root}/corrupt", AdapterError, "corrupt or truncated"),
        ("{root}/pickled", AdapterError, "only pickle files (adapter_model.bin)"),
        ("{root}/wrong-shape", AdapterError, "trained for a different base model"),
        ("{root}/over-rank", AdapterError, f"above max_lora_rank={MAX_RANK}"),
    ],
)
def test_refused_loads_change_nothing(served, roots, path, error, fragment):
    client, engine, _ = served
    root, outside = roots
    before = client.models()
    with pytest.raises(error) as caught:
        client.load_adapter("customer-7", path.format(root=root, outside=outside))
    assert fragment in caught.value.message and caught.value.status == 400, caught.value.message
    assert client.models() == before
    with pytest.raises(ModelNotFound):
        client.completions(model="customer-7", prompt="hi", max_tokens=2)


def test_a_refused_load_keeps_an_existing_adapter(served, roots):
    client, _, _ = served
    root, _ = roots
    client.load_adapter("customer-7", str(root / "good"))
    with pytest.raises(AdapterError, match="already registered"):
        client.load_adapter("customer-7", str(root / "corrupt"))
    with pytest.raises(LoradError):
        client.load_adapter("demo-r8", str(root / "good"))  # a name the daemon already serves elsewhere
    assert client.completions(model="customer-7", prompt="hi", max_tokens=2, ignore_eos=True)["usage"]["completion_tokens"] == 2
    assert client.completions(model="demo-r8", prompt="hi", max_tokens=2, ignore_eos=True)["usage"]["completion_tokens"] == 2


@pytest.mark.parametrize(
    "route, body, fragment",
    [
        ("load", {"lora_name": "x"}, "lora_path is required"),
        ("load", {"lora_path": "/x"}, "lora_name is required"),
        ("load", {"lora_name": "", "lora_path": "/x"}, "lora_name is required"),
        ("load", {"lora_name": 5, "lora_path": "/x"}, "lora_name must be a string, not int"),
        ("load", {"lora_name": "x", "lora_path": ["/x"]}, "lora_path must be a string, not list"),
        ("load", {"lora_name": "x", "lora_path": "/x\u0000y"}, "NUL"),
        ("load", {"lora_name": "x", "lora_path": "/x", "load_inplace": True}, "unknown field(s): load_inplace"),
        ("load", [1, 2], "must be a JSON object"),
        ("unload", {}, "lora_name is required"),
        ("unload", {"lora_name": "x", "force": True}, "unknown field(s): force"),
        ("unload", {"lora_name": None}, "lora_name is required"),
    ],
)
def test_bad_admin_bodies(served, route, body, fragment):
    _, _, server = served
    status, _, payload = raw_request(server.path, "POST", f"/v1/{route}_lora_adapter", json.dumps(body).encode())
    error = json.loads(payload)["error"]
    assert status == 400 and error["type"] == "invalid_request_error" and fragment in error["message"], error


def test_admin_body_not_json(served):
    _, _, server = served
    status, _, payload = raw_request(server.path, "POST", "/v1/load_lora_adapter", b"{nope")
    assert status == 400 and "not JSON" in json.loads(payload)["error"]["message"]


def test_unload_unknown_and_base(served):
    client, _, _ = served
    with pytest.raises(NotFound) as caught:
        client.unload_adapter("nobody")
    assert caught.value.status == 404 and "'nobody'" in caught.value.message
    with pytest.raises(LoradError):
        client.unload_adapter("lorad-demo")
    assert client.health() == {"status": "ok"}


def test_unload_while_a_request_streams(served, roots):
    client, engine, _ = served
    root, _ = roots
    client.load_adapter("customer-7", str(root / "good"))
    forward = engine.runner.model.forward

    def slow_forward(*args, **kwargs):  # about 20 ms a step: the stream outlives the unload
        time.sleep(0.02)
        return forward(*args, **kwargs)

    engine.runner.model.forward = slow_forward
    chunks = client.stream_completions(model="customer-7", prompt="abc", max_tokens=30, ignore_eos=True,
                                       temperature=0)
    first = next(chunks)
    assert client.unload_adapter("customer-7") == {"id": "customer-7", "object": "model", "deleted": True}
    assert engine.status()["running"] == 1  # still streaming
    with pytest.raises(ModelNotFound):
        client.completions(model="customer-7", prompt="abc", max_tokens=2)
    assert "customer-7" not in adapter_ids(client)
    # loading it again under the same name waits until the old one has finished
    with pytest.raises(BadRequest, match="still finishing"):
        client.load_adapter("customer-7", str(root / "good"))
    rest = list(chunks)
    assert rest[-1]["choices"][0]["finish_reason"] == "length"
    assert len(rest) + 1 == 30 and first["id"] == rest[0]["id"]
    engine.runner.model.forward = forward
    deadline = time.monotonic() + 5
    while "customer-7" in client.status()["adapters_resident"]:
        assert time.monotonic() < deadline, "the unloaded adapter kept its pool pages"
        time.sleep(0.01)
    client.load_adapter("customer-7", str(root / "good"))  # and now the name is free again
    assert client.completions(model="customer-7", prompt="abc", max_tokens=2, ignore_eos=True)["usage"]["completion_tokens"] == 2


def test_registrations_survive_a_restart(demo_assets, roots, tmp_path):
    root, _ = roots
    state = tmp_path / "state"
    first = make_engine(demo_assets, roots, state_dir=state)
    first.load_adapter("kept", str(root / "good"))
    first.load_adapter("dropped", str(root / "good"))
    first.unload_adapter("dropped")
    with pytest.raises(LoradError):
        first.load_adapter("refused", str(root / "corrupt"))
    assert json.loads((state / "adapters.json").read_text()) == {"kept": str(root / "good")}

    second = make_engine(demo_assets, roots, state_dir=state)
    names = {entry["id"] for entry in second.models()}
    assert "kept" in names and "dropped" not in names and "refused" not in names
    request = GenerationRequest(second.tokenizer.encode("hello"), "kept", SamplingParams(max_tokens=3, temperature=0))
    reference = GenerationRequest(list(request.prompt_token_ids), "demo-r8", SamplingParams(max_tokens=3, temperature=0))
    kept, same = second.generate([request, reference])
    assert kept.token_ids == same.token_ids and len(kept.token_ids) == 3


def test_a_state_dir_that_is_a_file_or_holds_a_broken_adapters_json(demo_assets, roots, tmp_path, caplog):
    root, _ = roots
    (tmp_path / "file").write_text("")
    with pytest.raises(BadRequest, match=f"state_dir {tmp_path / 'file'} is not a directory"):
        make_engine(demo_assets, roots, state_dir=tmp_path / "file")
    state = tmp_path / "state"
    state.mkdir()
    for saved, why in (("[1]", "does not hold an object"), ('{"a": 5, "kept": "%s"}' % (root / "good"), "its path is not"),
                       ("\udcff", "cannot read")):
        (state / "adapters.json").write_text(saved, errors="surrogateescape")
        caplog.clear()
        engine = make_engine(demo_assets, roots, state_dir=state)  # starts, and says what it did not restore
        assert why in caplog.text
        assert ("kept" in {entry["id"] for entry in engine.models()}) == ("kept" in saved)
    # a registration that cannot be remembered is refused, and nothing of it stays
    (state / "adapters.json").unlink()
    (state / "adapters.tmp").mkdir()
    engine = make_engine(demo_assets, roots, state_dir=state)
    with pytest.raises(LoradError, match="'customer-7' was not loaded: it cannot be remembered in"):
        engine.load_adapter("customer-7", str(root / "good"))
    assert "customer-7" not in {entry["id"] for entry in engine.models()}


def test_no_roots_means_no_api_loads(demo_assets, roots, tmp_path):
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("LORAD_DEMO_DIR", str(demo_assets.model_dir.parent))
        engine = Engine(EngineConfig(demo=True, device="cpu", pool_bytes=8 << 20, max_model_len=64))
    _, outside = roots
    with pytest.raises(BadRequest, match="not under an adapter root"):
        engine.load_adapter("x", str(outside / "good"))


def test_concurrent_loads_and_requests(served, roots):
    """Loads and unloads while other adapters serve: every request is answered, no load is lost."""
    client, _, _ = served
    root, _ = roots
    errors = []

    def churn(index):
        try:
            for round_ in range(3):
                name = f"churn-{index}"
                client.load_adapter(name, str(root / "good"))
                assert client.completions(model=name, prompt="hi", max_tokens=2, ignore_eos=True)["usage"]["completion_tokens"] == 2
                client.unload_adapter(name)
        except Exception as error:  # collected: assertion errors in threads are otherwise lost
            errors.append(error)

    threads = [threading.Thread(target=churn, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    for _ in range(5):
        assert client.completions(model="demo-r1", prompt="hi", max_tokens=2, ignore_eos=True)["usage"]["completion_tokens"] == 2
    for thread in threads:
        thread.join(60)
    assert not errors, errors
    assert not [name for name in adapter_ids(client) if name.startswith("churn-")]


def test_files_inside_a_loaded_adapter_stay_inside_its_root(served, roots, demo_assets):
    client, engine, _ = served
    root, outside = roots
    for folder, fragment in ((root / "weights-link", "leads outside the adapter root"),
                             (root / "inner-link", "is a symlink"),
                             (root / "config-link", "leads outside the adapter root"),
                             (root / "huge-config", "more than the 1048576 allowed")):
        if not folder.exists():
            shutil.copytree(demo_assets.adapters["demo-r8"], folder)
            if folder.name == "weights-link":  # the weights themselves outside the root
                (folder / "adapter_model.safetensors").unlink()
                (folder / "adapter_model.safetensors").symlink_to(outside / "good" / "adapter_model.safetensors")
            elif folder.name == "inner-link":  # a link that stays inside the root: still not a plain file
                (folder / "adapter_model.safetensors").unlink()
                (folder / "adapter_model.safetensors").symlink_to(root / "good" / "adapter_model.safetensors")
            elif folder.name == "config-link":
                (folder / "adapter_config.json").unlink()
                (folder / "adapter_config.json").symlink_to(outside / "good" / "adapter_config.json")
            else:
                config = json.loads((folder / "adapter_config.json").read_text())
                (folder / "adapter_config.json").write_text(json.dumps({**config, "padding": "x" * (1 << 20)}))
        with pytest.raises(LoradError, match=fragment):
            client.load_adapter(folder.name, str(folder))
        assert folder.name not in adapter_ids(client)
    assert client.completions(model="demo-r8", prompt="hi", max_tokens=2)["usage"]["completion_tokens"] <= 2


def test_a_restored_registration_outside_the_roots_is_dropped(demo_assets, roots, tmp_path):
    _, outside = roots
    state = tmp_path / "state"
    state.mkdir()
    (state / "adapters.json").write_text(json.dumps({"sneaky": str(outside / "good")}))
    engine = make_engine(demo_assets, roots, state_dir=state)
    assert "sneaky" not in {entry["id"] for entry in engine.models()}
