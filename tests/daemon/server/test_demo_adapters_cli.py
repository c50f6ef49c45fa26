"""`lorad demo adapters`: random PEFT adapters for a model shape, which lorad then serves."""

from lorad.config import EngineConfig
from lorad.daemon.model.adapters import load_peft_adapter
from lorad.daemon.model.checkpoint import MODEL_CONFIGS, ModelSpec
from lorad.daemon.server.cli import main
from lorad.daemon.engine.engine import Engine
from lorad.daemon.engine.request import GenerationRequest, SamplingParams


def test_writes_servable_adapters_with_ranks_round_robin(tmp_path):
    out = tmp_path / "adapters"
    assert main(["demo", "adapters", "--model-config", "tiny-llama", "--count", "5", "--ranks", "4,8",
                 "--targets", "q,v,down", "--out", str(out)]) == 0
    spec = ModelSpec.from_hf_config(MODEL_CONFIGS["tiny-llama"])
    names = sorted(path.name for path in out.iterdir())
    assert names == [f"adapter-{i:04d}" for i in range(5)]
    adapters = [load_peft_adapter(out / name, spec, 256) for name in names]
    assert [a.rank for a in adapters] == [4, 8, 4, 8, 4]
    assert adapters[0].targets == ("q_proj", "v_proj", "down_proj")
    engine = Engine(EngineConfig(model_config="tiny-llama", dummy_weights=True, adapter_dirs=(str(out),), device="cpu"))
    greedy = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    results = engine.generate([GenerationRequest([1, 2], adapter=name, sampling=greedy) for name in names])
    assert all(len(r.token_ids) == 3 for r in results)


def test_bad_arguments_exit_2_with_a_message(tmp_path, capsys):
    assert main(["demo", "adapters", "--model-config", "tiny-llama", "--count", "2", "--targets", "lm_head", "--out", str(tmp_path)]) == 2
    assert "targets must name projections" in capsys.readouterr().err
    assert main(["demo", "adapters", "--model-config", "gpt-9", "--count", "2", "--out", str(tmp_path)]) == 2
    assert main(["demo", "adapters", "--model-config", "tiny-llama", "--count", "0", "--out", str(tmp_path)]) == 2
