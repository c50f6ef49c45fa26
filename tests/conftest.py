"""Shared fixtures: the demo model, tiny random HF checkpoints with PEFT adapters (built once per session
with transformers and peft, see hf_fixtures.py), and the HF + PEFT reference they are compared with.

transformers and peft are imported only by the fixtures that need them, so tests that use none of
these do not pay for the import.
"""

from __future__ import annotations

import pytest

# pytest puts this directory on sys.path when it loads this file (no __init__.py in tests/). The interpreter's
# switch first: a test module that imports transformers or peft at collection (pytest.importorskip) imports
# triton, and Triton decorates its own library (tl.sum, ...) for the interpreter only if TRITON_INTERPRET is set
# by then; otherwise every interpreted kernel collected after it fails in tl.sum.
import triton_interpreter  # noqa: F401
import hf_fixtures  # noqa: E402
import torch  # noqa: E402


@pytest.fixture(autouse=True)
def free_gpu_memory(request):
    """After each GPU test: collect the engines it left (an engine and its scheduler refer to each
    other, so only the cycle collector frees its page pool, sized from the free memory), so that the
    next test's engine finds the memory free."""
    yield
    if request.node.get_closest_marker("gpu") is not None:
        import gc

        import torch

        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


@pytest.fixture
def short_tmp():
    """A fresh directory under /tmp: AF_UNIX paths are limited to 107 bytes, and pytest's tmp_path can be longer."""
    import shutil
    import tempfile
    from pathlib import Path

    directory = tempfile.mkdtemp(prefix="lorad-", dir="/tmp")
    yield Path(directory)
    shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture(scope="session")
def demo_assets(tmp_path_factory):
    """The built-in demo (daemon/model/demo.py) in a session temporary directory."""
    from lorad.daemon.model.demo import build_demo

    return build_demo(tmp_path_factory.mktemp("demo") / "demo")


@pytest.fixture(scope="session")
def hf_architectures() -> tuple[str, ...]:
    """Names accepted by `hf_checkpoint`: the keys of hf_fixtures.ARCHITECTURES (llama, ..., gemma3_multimodal)."""
    return tuple(hf_fixtures.ARCHITECTURES)


@pytest.fixture(scope="session")
def hf_checkpoint(tmp_path_factory):
    """`hf_checkpoint(arch)` -> Checkpoint(arch, model_dir, adapters: {name: dir}, vocab_size).

    A random checkpoint saved by transformers (with the demo's tokenizer.json) and the PEFT adapters of
    hf_fixtures.ADAPTERS on it, built on first use and shared by the whole session.
    """
    built: dict[str, hf_fixtures.Checkpoint] = {}

    def get(arch: str) -> hf_fixtures.Checkpoint:
        if arch not in built:
            directory = tmp_path_factory.mktemp(f"hf-{arch}")
            built[arch] = hf_fixtures.build_checkpoint_with_adapters(directory, arch)
        return built[arch]

    return get


@pytest.fixture(scope="session")
def hf_reference():
    """`hf_reference(model_dir, adapters, dtype=float32)` -> HFReference with `.greedy(prompt, adapter, max_tokens)`
    returning (token ids, per-step [vocab] float32 logits); models and results are cached."""
    built: dict = {}

    def get(model_dir, adapters: dict, dtype: torch.dtype = torch.float32):
        key = (str(model_dir), tuple(sorted((name, str(path)) for name, path in adapters.items())), dtype)
        if key not in built:
            built[key] = hf_fixtures.HFReference(model_dir, adapters, dtype)
        return built[key]

    return get


@pytest.fixture(scope="session")
def write_hf_adapter():
    """`write_hf_adapter(model_dir, directory, lora_config_kwargs, seed)`: one more PEFT adapter, saved
    by peft with random A and B."""
    return hf_fixtures.build_adapter


@pytest.fixture
def no_leftover_segments():
    """Fails a test that leaves POSIX shared-memory segments of this process behind (and removes them).
    Only this process's names: other test sessions may be creating theirs at the same time."""
    import os

    import posix_ipc

    from lorad.shm.segment import lorad_segments

    mine = f"/lorad-{os.getpid()}x"
    before = set(lorad_segments(mine))
    yield
    leaked = set(lorad_segments(mine)) - before
    for name in leaked:
        posix_ipc.unlink_shared_memory(name)
    assert not leaked, f"test left segments behind: {sorted(leaked)}"
