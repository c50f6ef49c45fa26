"""daemon/engine/step_account.py: which kind each step is, how its wall time is charged (from the previous
step's landing, overlapped steps after the one ahead of them), and on the demo engine the summed bytes and
FLOPs of its steps against the step cost model worked out by hand in test_step_cost.py."""

from __future__ import annotations

import pytest

from lorad.daemon.engine.request import GenerationRequest, SamplingParams
from lorad.daemon.engine.step_account import StepAccount
from lorad.daemon.engine.step_cost import DeviceRates, SequenceInStep, StepCostModel
from lorad.daemon.model.checkpoint import load_spec

from step_fakes import FakeEvent, Seq, plan
from test_engine import make_engine


@pytest.fixture
def account(demo_assets):
    spec = load_spec(demo_assets.model_dir)
    return StepAccount(StepCostModel(spec, 4, adapter_ranks=lambda name: {}), DeviceRates(1e9, 1e9))


def test_each_step_has_its_kind_and_prompt_tokens(account):
    prompt, talker = Seq(prompt_len=10), Seq(prompt_len=4)
    account.begin(0.0)
    account.launched(plan([(prompt, 0, 6, False)]))  # a first prompt chunk: no row sampled
    account.launched(plan([(prompt, 6, 4, True), (talker, 7, 1, True)]))  # the prompt's end beside a decode row
    account.launched(plan([(prompt, 10, 1, True), (talker, 8, 1, True)]))
    for now in (1.0, 2.0, 3.0):
        account.landed(now)
    kinds = account.snapshot()["by_kind"]
    assert {kind: totals["steps"] for kind, totals in kinds.items()} == {"prefill": 1, "mixed": 1, "decode": 1}
    assert {kind: totals["prompt_tokens"] for kind, totals in kinds.items()} == {"prefill": 6, "mixed": 4, "decode": 0}
    assert {kind: totals["rows"] for kind, totals in kinds.items()} == {"prefill": 6, "mixed": 5, "decode": 2}
    # a one-token last chunk of a prompt is a prompt row, not a decode row
    account.launched(plan([(Seq(prompt_len=3), 2, 1, True), (talker, 9, 1, True)]))
    account.landed(4.0)
    assert account.snapshot()["by_kind"]["mixed"]["prompt_tokens"] == 5


def test_padding_rows_are_the_graph_buckets_rows_past_the_steps_own(account):
    prompt, talker = Seq(prompt_len=1000), Seq(prompt_len=4)
    account.begin(0.0)
    account.launched(plan([(prompt, 0, 1000, True), (talker, 7, 1, True)]), graph_rows=1024)  # a mixed step, 23 padding
    account.launched(plan([(prompt, 1000, 1, True), (talker, 8, 1, True)]), graph_rows=2)  # a decode graph's bucket 2
    account.launched(plan([(prompt, 1001, 1, True), (talker, 9, 1, True)]))  # eager: its own rows
    for now in (1.0, 2.0, 3.0):
        account.landed(now)
    kinds = account.snapshot()["by_kind"]
    assert (kinds["mixed"]["padding_rows"], kinds["mixed"]["padding_rows_per_step"]) == (23, 23.0)
    assert (kinds["decode"]["padding_rows"], kinds["decode"]["padding_rows_per_step"]) == (0, 0.0)
    assert kinds["prefill"]["padding_rows_per_step"] is None
    assert account.metrics()["mixed"]["padding_rows"] == 23
    with pytest.raises(ValueError, match="graph_rows 1000"):  # a bucket smaller than the step is a bug
        account.launched(plan([(prompt, 0, 1000, True), (talker, 7, 1, True)]), graph_rows=1000)


def test_wall_time_is_charged_from_the_previous_landing_and_idle_time_to_no_step(account):
    seq = Seq(prompt_len=1)
    decode = plan([(seq, 5, 1, True)])
    account.begin(10.0)
    account.launched(decode)
    account.landed(10.5)  # 0.5 s
    account.begin(10.6)  # the host's work between steps counts toward the next one
    account.launched(decode)
    account.launched(decode)  # overlapped: launched before the one ahead of it landed
    account.landed(11.0)  # 0.5 s
    account.begin(11.1)
    account.landed(11.2)  # 0.2 s: only after the one ahead of it
    account.idle()
    account.begin(20.0)  # woken after idling: the 8.8 s between are nobody's
    account.launched(decode)
    account.landed(20.25)
    decode_totals = account.snapshot()["by_kind"]["decode"]
    assert decode_totals["steps"] == 4
    assert decode_totals["busy_s"] == pytest.approx(0.5 + 0.5 + 0.2 + 0.25)
    histogram = account.metrics()["decode"]["seconds"]
    assert sum(histogram["counts"]) == 4 and histogram["sum"] == pytest.approx(1.45)


def test_host_time_before_each_launch_is_told_apart(account):
    """From the previous landing (or the start of work) to the launch is the host's; an overlapped step, launched
    before the one ahead of it landed, has none. No device clock on the cpu: device_s is None."""
    decode = plan([(Seq(prompt_len=1), 5, 1, True)])
    account.begin(10.0)
    account.launched(decode, now=10.1, parts=(10.01, 10.04, 10.08))  # 0.1 s before it: tokens, schedule, plan, launch
    account.landed(10.5)
    account.launched(decode, now=10.7)  # 0.2 s after the landing
    account.launched(decode, now=10.8)  # overlapped: launched before the one ahead of it landed
    account.landed(11.0)
    account.landed(11.3)
    account.launched(decode)  # no launch time given: none counted
    account.landed(11.4)
    totals = account.snapshot()
    assert totals["by_kind"]["decode"]["host_before_launch_s"] == pytest.approx(0.3)
    assert totals["host_before_launch_s"] == pytest.approx(0.3) and totals["busy_s"] == pytest.approx(1.4)
    assert totals["device_s"] is None and totals["by_kind"]["decode"]["device_s"] is None
    parts = totals["host_before_launch_by_part_s"]
    assert parts == pytest.approx({"tokens": 0.01, "schedule": 0.03, "plan": 0.04, "launch": 0.02})
    assert totals["by_kind"]["decode"]["host_before_launch_by_part_s"] == parts


def test_device_spans_are_read_once_the_device_has_passed_them(demo_assets):
    spec = load_spec(demo_assets.model_dir)
    account = StepAccount(StepCostModel(spec, 4, adapter_ranks=lambda name: {}), DeviceRates(1e9, 1e9),
                          device_clock=True, new_event=FakeEvent)
    FakeEvent.clock, FakeEvent.next_at = 0.0, 0.0
    prompt, talker = Seq(prompt_len=10), Seq(prompt_len=4)
    account.begin(0.0)
    account.before_forward()
    account.launched(plan([(prompt, 0, 6, False)]), now=0.0)  # a prompt chunk: events at 0.0 and 0.25
    account.landed(0.01)  # not waited for: the device is still at 0.0
    assert account.snapshot()["by_kind"]["prefill"]["device_s"] is None
    account.before_forward()
    account.launched(plan([(prompt, 6, 4, True), (talker, 7, 1, True)]), now=0.02)  # events at 0.5 and 0.75
    FakeEvent.clock = 0.75
    account.landed(0.8)
    kinds = account.snapshot()["by_kind"]
    assert kinds["prefill"]["device_s"] == pytest.approx(0.25) and kinds["mixed"]["device_s"] == pytest.approx(0.25)
    assert kinds["decode"]["device_s"] is None and account.snapshot()["device_s"] == pytest.approx(0.5)


def test_the_device_clock_splits_the_time_between_forwards_into_tokens_and_waits(demo_assets):
    """Events: forward start, forward end, tokens queued (each 250 ms after the one before on the fake clock); the
    tokens' work is end -> tokens, the wait before a forward is the previous tokens (or forward end) -> its start,
    and nothing is counted across an idle engine."""
    spec = load_spec(demo_assets.model_dir)
    account = StepAccount(StepCostModel(spec, 4, adapter_ranks=lambda name: {}), DeviceRates(1e9, 1e9),
                          device_clock=True, new_event=FakeEvent)
    FakeEvent.clock, FakeEvent.next_at = 0.0, 0.0
    talker = Seq(prompt_len=4)

    def decode_step(tokens: bool, at: float):
        account.before_forward()
        account.launched(plan([(talker, 7, 1, True)]), now=at)
        if tokens:
            account.tokens_queued()

    account.begin(0.0)
    decode_step(True, 0.0)  # events 0.0, 0.25, 0.5
    FakeEvent.next_at = 1.0  # the device waits 0.5 for the next launch
    decode_step(True, 0.1)  # 1.0, 1.25, 1.5
    FakeEvent.clock = 1.5
    account.landed(0.2)
    account.landed(0.3)
    decode = account.snapshot()["by_kind"]["decode"]
    assert decode["device_s"] == pytest.approx(0.5) and decode["tokens_device_s"] == pytest.approx(0.5)
    assert decode["before_forward_s"] == pytest.approx(0.5)  # the first step followed an idle engine: not counted
    decode_step(False, 0.4)  # 1.75, 2.0; no tokens told: its successor's wait counts from its forward's end
    decode_step(True, 0.5)  # 2.25, 2.5, 2.75
    FakeEvent.clock = 2.5
    account.landed(0.6)
    account.landed(0.7)
    assert account.snapshot()["device_s"] == pytest.approx(0.75)  # the last step's tokens are not passed yet
    account.idle()
    FakeEvent.next_at = 10.0
    decode_step(True, 5.0)  # after the idle engine: 10.0, 10.25, 10.5
    FakeEvent.clock = 10.5
    account.landed(5.1)
    snapshot = account.snapshot()
    decode = snapshot["by_kind"]["decode"]
    assert decode["device_s"] == pytest.approx(1.25) and decode["tokens_device_s"] == pytest.approx(1.0)
    assert decode["before_forward_s"] == pytest.approx(0.5 + 0.25 + 0.25)
    assert snapshot["before_forward_s"] == pytest.approx(1.0) and snapshot["tokens_device_s"] == pytest.approx(1.0)
    assert snapshot["by_kind"]["prefill"]["tokens_device_s"] is None


def test_the_step_log_writes_a_step_once_the_device_has_passed_it(demo_assets):
    from lorad.daemon.engine.step_account import StepLog

    class Lines(StepLog):
        def __init__(self):
            self.lines = []

        def write(self, record):
            self.lines.append(record)

    log = Lines()
    account = StepAccount(StepCostModel(load_spec(demo_assets.model_dir), 4, adapter_ranks=lambda name: {}),
                          DeviceRates(1e9, 1e9), device_clock=True, new_event=FakeEvent, step_log=log)
    FakeEvent.clock, FakeEvent.next_at = 0.0, 0.0
    account.begin(0.0)
    for at in (0.0, 1.0):  # forward 0.25, tokens 0.25; the second after the device waited 0.5
        FakeEvent.next_at = at
        account.before_forward()
        account.launched(plan([(Seq(prompt_len=4), 7, 1, True)]), now=at + 0.01, notes={"origin": "planned_ahead"})
        account.tokens_queued()
    account.note(read_at_once="keeps_logits")
    FakeEvent.clock = 0.5
    account.landed(0.6)
    account.landed(1.6)
    assert len(log.lines) == 1  # the second is not passed yet
    FakeEvent.clock = 2.0  # passed: read with the next landing
    account.before_forward()
    account.launched(plan([(Seq(prompt_len=4), 8, 1, True)]), now=2.0)
    account.landed(2.5)
    first, second = log.lines[:2]
    assert first["origin"] == "planned_ahead" and "read_at_once" not in first and first["wait_before_ms"] is None
    assert first["forward_ms"] == pytest.approx(250) and first["tokens_ms"] == pytest.approx(250)
    assert second["read_at_once"] == "keeps_logits" and second["wait_before_ms"] == pytest.approx(500)
    assert first["busy_ms"] == pytest.approx(600) and second["busy_ms"] == pytest.approx(1000)
    assert second["host_before_launch_ms"] == pytest.approx(410)  # launched at 1.01, the first landed at 0.6
    assert first["serial_floor_ms"] >= first["floor_ms"] > 0


def test_a_step_log_whose_writes_fail_stops_without_failing_the_step(demo_assets, tmp_path, caplog):
    from lorad.daemon.engine.step_account import StepLog

    log = StepLog(str(tmp_path / "steps.jsonl"))

    class Full:
        def write(self, text):
            raise OSError(28, "No space left on device")

        def close(self):
            pass

    log._file = Full()
    account = StepAccount(StepCostModel(load_spec(demo_assets.model_dir), 4, adapter_ranks=lambda name: {}),
                          DeviceRates(1e9, 1e9), step_log=log)
    account.begin(0.0)
    for at in (0.1, 0.2):
        account.launched(plan([(Seq(prompt_len=4), 7, 1, True)]), now=at)
        account.landed(at + 0.05)
    assert account.totals["decode"].steps == 2 and log._file is None
    assert [record.message for record in caplog.records].count(
        f"step log {log.path} stopped: [Errno 28] No space left on device") == 1


def test_a_failed_step_leaves_nothing_pending(account):
    account.begin(0.0)
    account.launched(plan([(Seq(prompt_len=1), 5, 1, True)]))
    account.drop_pending()
    account.idle()
    with pytest.raises(IndexError):
        account.landed(1.0)
    assert account.snapshot()["busy_s"] == 0


def test_the_engine_accounts_every_step_it_runs(demo_assets):
    engine = make_engine(demo_assets)
    prompt = list(range(3, 8))
    engine.generate([GenerationRequest(prompt, "demo-r8", SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))])
    status = engine.status()["step_time"]
    kinds = status["by_kind"]
    assert kinds["prefill"]["steps"] == 1 and kinds["decode"]["steps"] == 2 and kinds["mixed"]["steps"] == 0
    assert sum(kind["steps"] for kind in kinds.values()) == engine.steps
    # the same steps through the hand-checked cost model: a 5-token prompt, then decode rows at contexts 6 and 7
    model = engine.account.cost_model
    prefill = model.cost([SequenceInStep(5, 5, True, "demo-r8")])
    decodes = [model.cost([SequenceInStep(1, context, True, "demo-r8")]) for context in (6, 7)]
    assert kinds["prefill"]["bytes"] == prefill.bytes and kinds["prefill"]["flops"] == prefill.flops
    assert kinds["decode"]["bytes"] == sum(cost.bytes for cost in decodes)
    assert kinds["decode"]["flops"] == sum(cost.flops for cost in decodes)
    assert prefill.adapter_bytes == 4 * 10240  # demo-r8: its q, k, v A and B rows, float32 (test_step_cost.py)
    assert status["busy_s"] > 0 and status["floor_s"] > 0 and 0 < status["efficiency"]
    rates = engine.account.rates  # (status rounds them: a busy cpu's GEMM rate can show as 0.00 TFLOP/s)
    serial = [cost.serial_floor_s(rates.bandwidth_bytes_per_s, rates.flops_per_s) for cost in (prefill, *decodes)]
    assert kinds["prefill"]["serial_floor_s"] == pytest.approx(serial[0], abs=1e-6)
    assert kinds["decode"]["serial_floor_s"] == pytest.approx(serial[1] + serial[2], abs=1e-6)
    assert status["serial_floor_s"] == pytest.approx(sum(serial), abs=1e-5) and status["serial_floor_s"] >= status["floor_s"]
    assert rates.bandwidth_bytes_per_s > 0 and rates.flops_per_s > 0 and status["device_rates"]["hbm_gb_s"] >= 0
    assert 0 < status["host_before_launch_s"] < status["busy_s"] and status["device_s"] is None
    # the step loop gives each step's parts: they split the host's time before the launches
    assert sum(status["host_before_launch_by_part_s"].values()) == pytest.approx(status["host_before_launch_s"], abs=1e-5)
    assert status["host_before_launch_by_part_s"]["launch"] > 0  # the cpu's forward is its launch


class EagerAsGraphs:
    """Stands in for a runner's decode or prefill graphs on the CPU: every step fits a bucket of `rows` rows, and
    is computed eagerly; last_key names the bucket as DecodeGraphs and PrefillGraphs do."""

    def __init__(self, runner, rows: int):
        self.runner, self.rows, self.last_key = runner, rows, None

    def fits(self, *sizes) -> bool:
        return True

    def run(self, plan):
        self.last_key = (self.rows, "none", 0)
        runner = self.runner
        return runner.model.forward(runner.build_step(plan), runner.kv.view, runner.table)


def test_the_engine_counts_the_padding_rows_of_the_graph_each_step_replayed(demo_assets):
    # The runner says which bucket a step replayed (ModelRunner.graph_rows), the engine's account its padding rows.
    engine = make_engine(demo_assets)
    runner = engine.runner
    runner.graphs, runner.prefill_graphs = EagerAsGraphs(runner, 16), EagerAsGraphs(runner, 32)
    prompt = list(range(3, 8))
    engine.generate([GenerationRequest(prompt, "demo-r8", SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))])
    kinds = engine.account.snapshot()["by_kind"]
    assert (runner.prefill_graph_steps, runner.graph_steps) == (1, 2)
    assert kinds["prefill"]["padding_rows"] == 32 - 5  # the prompt's 5 rows in the 32-row bucket
    assert kinds["decode"]["padding_rows"] == 2 * (16 - 1)  # one row in the 16-row bucket, twice
    runner.graphs = runner.prefill_graphs = None  # eager: a step's own rows, none padding
    engine.generate([GenerationRequest(prompt, "demo-r8", SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))])
    kinds = engine.account.snapshot()["by_kind"]
    assert kinds["prefill"]["padding_rows"] == 32 - 5 and kinds["decode"]["padding_rows"] == 2 * (16 - 1)


def test_empty_running_slots_are_counted_by_cause(account):
    talker = Seq(prompt_len=4)
    account.begin(0.0)
    account.launched(plan([(talker, 7, 1, True)]), empty_slots=3, why_empty="adapter_staging")
    account.launched(plan([(talker, 8, 1, True)]), empty_slots=2, why_empty="ended_in_flight")
    account.launched(plan([(talker, 9, 1, True)]))  # full
    for now in (1.0, 2.0, 3.0):
        account.landed(now)
    snapshot = account.snapshot()
    assert snapshot["empty_slots"] == 5
    assert snapshot["empty_slots_by_cause"] == {"adapter_staging": 3, "ended_in_flight": 2}
    assert snapshot["by_kind"]["decode"]["empty_slots_by_cause"] == {"adapter_staging": 3, "ended_in_flight": 2}
    assert account.metrics()["decode"]["empty_slots"]["adapter_staging"] == 3
    with pytest.raises(ValueError, match="why_empty"):  # empty slots need a known cause
        account.launched(plan([(talker, 10, 1, True)]), empty_slots=1)


def test_the_engine_counts_the_slots_its_steps_leave_empty(demo_assets):
    # Two requests under a cap of 4: each step leaves 2 slots empty with nothing waiting; a third request that
    # waits behind a long prompt's chunks (the token budget) leaves its slot empty for that cause.
    engine = make_engine(demo_assets, max_running_requests=4, max_batch_tokens=16)
    greedy = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    engine.generate([GenerationRequest(list(range(3, 8)), "demo-r8", greedy),
                     GenerationRequest(list(range(3, 9)), None, greedy)])
    snapshot = engine.account.snapshot()
    steps = sum(kind["steps"] for kind in snapshot["by_kind"].values())
    assert snapshot["empty_slots_by_cause"] == {"no_request_waiting": 2 * steps}
    engine.generate([GenerationRequest(list(range(3, 33)), None, greedy), GenerationRequest(list(range(3, 8)), None, greedy)])
    # the 30-token prompt's first chunk spends the step's 16 tokens: the second request waits, 3 slots empty for it
    assert engine.account.snapshot()["empty_slots_by_cause"]["token_budget"] == 3


def test_the_step_log_notes_the_pinning_since_the_last_launch(tmp_path):
    """pin_ms: the staged adapters' pinning (any thread) summed into the next step's notes, then begun again; nothing
    counted while no step log is open."""
    from lorad.daemon.engine.step_account import HostSplit, StepLog, pin_clock

    log = StepLog(str(tmp_path / "steps.jsonl"))
    try:
        assert pin_clock.on
        pin_clock.take()
        pin_clock.add(0.004)
        pin_clock.add(0.0015)
        assert HostSplit(0.0).notes(0.01)["pin_ms"] == pytest.approx(5.5)
        assert HostSplit(0.0).notes(0.01)["pin_ms"] == 0
    finally:
        log.close()
    assert not pin_clock.on and "pin_ms" not in HostSplit(0.0).notes(0.01)
