"""POST /v1/chat/completions: the chat template (daemon/engine/chat_template.py) renders the prompt transformers'
`apply_chat_template` renders, token for token; the official `openai` client drives the demo daemon over its
Unix socket (chat and completions, streamed and not, the error types); bad messages get a 400 naming the field."""

from __future__ import annotations

import json
import time

import pytest

from lorad.daemon.engine.chat_template import ChatTemplate, load_chat_template
from lorad.daemon.engine.tokenizer import Tokenizer
from lorad.daemon.model.demo import CHAT_TEMPLATE
from lorad.daemon.server.schemas import parse_chat
from lorad.errors import BadRequest, ModelError

from daemon_harness import serve_demo, serve_engine

# Chat formats written for these tests in the shapes instruct checkpoints use: turns between role headers
# (as Llama 3), ChatML-style markers (as Qwen2), and a template that refuses a role with raise_exception.
HEADER_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|role|>' + message['role'] + '<|end|>\\n\\n' + message['content'] | trim + eos_token }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|role|>assistant<|end|>\\n\\n' }}{% endif %}"
)
MARKER_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "{{ '<|start|>system\\nYou are helpful.<|stop|>\\n' }}{% endif %}"
    "{{ '<|start|>' + message['role'] + '\\n' + message['content'] + '<|stop|>' + '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start|>assistant\\n' }}{% endif %}"
)
STRICT_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] not in ['user', 'assistant'] %}"
    "{{ raise_exception('only user and assistant turns') }}{% endif %}"
    "[{{ message['role'] | upper }}] {{ message['content'] | tojson }}{% endfor %}"
)
MESSAGES = [
    {"role": "system", "content": "Answer briefly."},
    {"role": "user", "content": "Where is the lighthouse?"},
    {"role": "assistant", "content": "On the rocks, by the sea."},
    {"role": "user", "content": "How many steps does it have? Ünïcödé ✓"},
]


def write_checkpoint_config(directory, template, **extra) -> None:
    config = {"bos_token": "<s>", "eos_token": {"content": "</s>", "special": True}, "unk_token": "<unk>",
              "chat_template": template, **extra}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("template", [CHAT_TEMPLATE, HEADER_TEMPLATE, MARKER_TEMPLATE])
def test_the_rendered_prompt_equals_transformers_apply_chat_template(demo_assets, tmp_path, template):
    from transformers import PreTrainedTokenizerFast

    (tmp_path / "tokenizer.json").write_bytes((demo_assets.model_dir / "tokenizer.json").read_bytes())
    write_checkpoint_config(tmp_path, template)
    reference = PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "tokenizer.json"), bos_token="<s>",
                                        eos_token="</s>", unk_token="<unk>")
    reference.chat_template = template
    ours = load_chat_template(tmp_path)
    tokenizer = Tokenizer(tmp_path / "tokenizer.json")
    for messages in (MESSAGES, MESSAGES[1:2]):
        for generation_prompt in (True, False):
            want = reference.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=True)
            if not isinstance(want, list):  # a BatchEncoding where transformers returns a dict
                want = want["input_ids"]
            text = ours.render(checked(messages), add_generation_prompt=generation_prompt)
            assert tokenizer.encode(text, add_special_tokens=False) == want
            assert text == reference.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=False)


def test_where_the_template_comes_from(tmp_path):
    assert load_chat_template(tmp_path) is None and load_chat_template(None) is None
    write_checkpoint_config(tmp_path, [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}])
    assert load_chat_template(tmp_path).render([]) == "D"
    (tmp_path / "chat_template.jinja").write_text("{{ eos_token }}J")
    template = load_chat_template(tmp_path)
    assert template.render([]) == "</s>J" and template.source.endswith("chat_template.jinja")
    (tmp_path / "chat_template.jinja").write_text("{% for %}")
    with pytest.raises(ModelError, match="does not compile"):
        load_chat_template(tmp_path)


def test_a_template_that_refuses_is_a_400_with_its_message(tmp_path):
    write_checkpoint_config(tmp_path, STRICT_TEMPLATE)
    template = load_chat_template(tmp_path)
    assert template.render([{"role": "user", "content": 'say "hi"'}]) == '[USER] "say \\"hi\\""'
    with pytest.raises(BadRequest, match="only user and assistant turns"):
        template.render([{"role": "system", "content": "x"}])


def test_the_sandbox_keeps_templates_from_reaching_python(tmp_path):
    write_checkpoint_config(tmp_path, "{{ messages.__class__.__mro__ }}")
    with pytest.raises(BadRequest):
        load_chat_template(tmp_path).render([])


@pytest.mark.parametrize("messages, fragment", [
    ([], "non-empty list"),
    ("hello", "non-empty list"),
    ([{"role": "robot", "content": "x"}], "messages[0].role"),
    ([{"role": "user"}], "messages[0].content"),
    ([{"role": "user", "content": 5}], "messages[0].content"),
    ([{"role": "user", "content": "a"}, {"role": "user", "content": [{"type": "image_url", "image_url": {}}]}],
     "messages[1].content[0]"),
    ([{"role": "user", "content": "a", "tool_calls": []}], "messages[0]: unknown field(s): tool_calls"),
    ([{"role": "user", "content": "a", "name": 3}], "messages[0].name"),
    ([{"role": "user", "content": "a"}] * 1025, "at most 1024"),
])
def test_bad_messages_name_the_field(messages, fragment):
    with pytest.raises(BadRequest, match=fragment.replace("[", r"\[").replace("]", r"\]").replace("(", r"\(").replace(")", r"\)")):
        checked(messages)


def checked(messages) -> list[dict]:
    """The messages as a chat request's body brings them to the template (daemon/server/schemas.py)."""
    return parse_chat({"model": "m", "messages": messages}).messages


def test_text_parts_are_joined():
    parts = [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}]
    assert checked([{"role": "user", "content": parts, "name": "ann"}]) == [
        {"role": "user", "content": "one\ntwo", "name": "ann"}]


# --- the official openai client against the demo daemon ------------------------------------------------------


@pytest.fixture(scope="module")
def demo_daemon(demo_assets):
    with serve_demo(demo_assets, "chat.sock") as served:
        yield served


@pytest.fixture(scope="module")
def openai_client(demo_daemon):
    openai = pytest.importorskip("openai")
    import httpx2

    server, _ = demo_daemon
    http = httpx2.Client(transport=httpx2.HTTPTransport(uds=str(server.path)))
    client = openai.OpenAI(base_url="http://localhost/v1", api_key="unused", http_client=http, max_retries=0)
    yield client
    http.close()


def test_chat_with_the_openai_client(openai_client, demo_daemon):
    _, engine = demo_daemon
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Where is the lighthouse?"}]
    answer = openai_client.chat.completions.create(model="demo-r8", messages=messages, max_completion_tokens=12,
                                                   temperature=0, extra_body={"ignore_eos": True})
    assert answer.object == "chat.completion" and answer.id.startswith("chatcmpl-")
    choice = answer.choices[0]
    assert choice.message.role == "assistant" and choice.finish_reason == "length"
    rendered = load_chat_template(engine.model_dir).render(messages)
    assert rendered == "<s>system: Be brief.\nuser: Where is the lighthouse?\nassistant:"
    prompt_ids = engine.tokenizer.encode(rendered, add_special_tokens=False)
    assert answer.usage.prompt_tokens == len(prompt_ids) and answer.usage.completion_tokens == 12
    # greedy: the same tokens as a completion of the rendered prompt's ids
    plain = openai_client.completions.create(model="demo-r8", prompt=prompt_ids, max_tokens=12, temperature=0,
                                             extra_body={"ignore_eos": True})
    assert choice.message.content == plain.choices[0].text

    stream = openai_client.chat.completions.create(model="demo-r8", messages=messages, max_completion_tokens=12,
                                                   temperature=0, stream=True, stream_options={"include_usage": True},
                                                   extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(chunk.object == "chat.completion.chunk" for chunk in chunks)
    assert "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices) == choice.message.content
    assert [chunk.choices[0].finish_reason for chunk in chunks if chunk.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12


def test_models_with_the_openai_client(openai_client):
    openai = pytest.importorskip("openai")
    listed = [model.id for model in openai_client.models.list()]
    assert listed[0] == "lorad-demo" and "demo-r8" in listed
    model = openai_client.models.retrieve("demo-r8")
    assert model.id == "demo-r8" and model.object == "model" and model.owned_by == "lorad"
    with pytest.raises(openai.NotFoundError, match="'nope' does not exist"):
        openai_client.models.retrieve("nope")


def test_the_openai_clients_errors(openai_client):
    import openai

    with pytest.raises(openai.NotFoundError):
        openai_client.chat.completions.create(model="no-such-adapter", messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.BadRequestError, match=r"messages\[0\].role"):
        openai_client.chat.completions.create(model="demo-r8", messages=[{"role": "robot", "content": "hi"}])
    with pytest.raises(openai.BadRequestError, match="top_logprobs needs logprobs: true"):
        openai_client.chat.completions.create(model="demo-r8", messages=[{"role": "user", "content": "hi"}], top_logprobs=2)
    with pytest.raises(openai.BadRequestError, match="logprobs must be an integer from 0 to 20"):
        openai_client.chat.completions.create(model="demo-r8", messages=[{"role": "user", "content": "hi"}], logprobs=True,
                                              top_logprobs=21)
    hello = [{"role": "user", "content": "hi"}]
    with pytest.raises(openai.BadRequestError, match=r"plus max_completion_tokens \(100000\) is \d+ tokens, over"):
        openai_client.chat.completions.create(model="demo-r8", messages=hello, max_completion_tokens=100000)
    with pytest.raises(openai.BadRequestError, match=r"plus max_tokens \(100000\) is \d+ tokens, over"):
        openai_client.chat.completions.create(model="demo-r8", messages=hello, max_tokens=100000)
    answer = openai_client.completions.create(model="lorad-demo", prompt="The lighthouse", max_tokens=4)
    assert answer.object == "text_completion" and answer.usage.completion_tokens <= 4


def test_a_model_without_a_template_says_which_files(tmp_path):
    from lorad.client import Client

    from test_api import FakeEngine

    engine = FakeEngine()
    engine.model_dir = tmp_path
    with serve_engine(engine, "fake.sock") as server:
        with pytest.raises(BadRequest, match="chat_template.jinja"):
            Client(server.path).chat_completions(model="fake-base", messages=[{"role": "user", "content": "hi"}])
    write_checkpoint_config(tmp_path, CHAT_TEMPLATE)
    assert isinstance(load_chat_template(tmp_path), ChatTemplate)


def test_penalties_and_logit_bias_through_the_openai_client(openai_client, demo_daemon):
    import openai

    _, engine = demo_daemon
    token = engine.tokenizer.encode("the", add_special_tokens=False)[0]
    answer = openai_client.chat.completions.create(
        model="demo-r4", messages=[{"role": "user", "content": "Hello"}], max_completion_tokens=4, temperature=0,
        logit_bias={str(token): 100}, presence_penalty=0.5, frequency_penalty=0.5, extra_body={"ignore_eos": True})
    assert answer.choices[0].message.content == engine.tokenizer.decode([token] * 4)
    plain = openai_client.completions.create(model="demo-r4", prompt="The lighthouse", max_tokens=6, temperature=0,
                                             frequency_penalty=2, extra_body={"repetition_penalty": 1.5, "min_tokens": 2})
    assert plain.usage.completion_tokens >= 2
    with pytest.raises(openai.BadRequestError, match="logit_bias: token id"):
        openai_client.completions.create(model="demo-r4", prompt="x", logit_bias={str(engine.vocab_size): 1})
    with pytest.raises(openai.BadRequestError, match="presence_penalty"):
        openai_client.completions.create(model="demo-r4", prompt="x", presence_penalty=3)


def test_batch_prompts_n_and_seeds_through_the_openai_client(openai_client):
    prompts = ["The lighthouse", "A boat on the grey sea"]
    batch = openai_client.completions.create(model="demo-r16", prompt=prompts, n=2, max_tokens=5, temperature=0,
                                             extra_body={"ignore_eos": True})
    assert [choice.index for choice in batch.choices] == [0, 1, 2, 3]
    for prompt_index, prompt in enumerate(prompts):
        alone = openai_client.completions.create(model="demo-r16", prompt=prompt, max_tokens=5, temperature=0,
                                                 extra_body={"ignore_eos": True})
        assert [choice.text for choice in batch.choices[2 * prompt_index : 2 * prompt_index + 2]] == [alone.choices[0].text] * 2
    assert batch.usage.completion_tokens == 20
    echoed = openai_client.completions.create(model="demo-r16", prompt=prompts[0], max_tokens=3, echo=True)
    assert echoed.choices[0].text.startswith(prompts[0])

    def seeded():
        return [c.text for c in openai_client.completions.create(model="demo-r16", prompt=prompts[0], n=3, max_tokens=6,
                                                                 temperature=1.0, seed=7, extra_body={"ignore_eos": True}).choices]

    first = seeded()
    assert seeded() == first and len(set(first)) > 1  # the set repeats; its choices are distinct draws

    stream = openai_client.chat.completions.create(model="demo-r16", messages=[{"role": "user", "content": "Hi"}], n=2,
                                                   max_completion_tokens=4, temperature=0, stream=True,
                                                   extra_body={"ignore_eos": True})
    texts, roles = {0: "", 1: ""}, {0: 0, 1: 0}
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            roles[choice.index] += choice.delta.role == "assistant"
    whole = openai_client.chat.completions.create(model="demo-r16", messages=[{"role": "user", "content": "Hi"}], n=2,
                                                  max_completion_tokens=4, temperature=0, extra_body={"ignore_eos": True})
    assert texts == {0: whole.choices[0].message.content, 1: whole.choices[1].message.content}
    assert roles == {0: 1, 1: 1}  # the role in each choice's first delta only


def test_n_choices_prefill_the_prompt_once_through_the_openai_client(openai_client, demo_daemon):
    _, engine = demo_daemon

    def prompt_tokens_computed() -> int:
        return sum(kind["prompt_tokens"] for kind in engine.status()["step_time"]["by_kind"].values())

    messages = [{"role": "user", "content": "Tell me about the lighthouse on the rocks, by the grey sea."}]
    alone = openai_client.chat.completions.create(model="demo-r8", messages=messages, max_completion_tokens=6,
                                                  temperature=0, extra_body={"ignore_eos": True})
    before, forked = prompt_tokens_computed(), engine.status()["kv_sharing"]["forked_choices"]
    answer = openai_client.chat.completions.create(model="demo-r8", messages=messages, max_completion_tokens=6, n=4,
                                                   temperature=0, extra_body={"ignore_eos": True})
    assert [choice.message.content for choice in answer.choices] == [alone.choices[0].message.content] * 4
    assert prompt_tokens_computed() - before == alone.usage.prompt_tokens  # one prefill for the 4 choices
    assert engine.status()["kv_sharing"]["forked_choices"] - forked == 3
    assert answer.usage.prompt_tokens == alone.usage.prompt_tokens and answer.usage.completion_tokens == 24


def test_a_client_leaving_an_n_stream_gives_back_every_page(openai_client, demo_daemon):
    _, engine = demo_daemon
    idle, forked = engine.status()["pool"]["kv"], engine.status()["kv_sharing"]["forked_choices"]
    stream = openai_client.completions.create(model="demo-r8", prompt="The lighthouse keeper", n=3, max_tokens=100,
                                              stream=True, extra_body={"ignore_eos": True})
    next(iter(stream))
    assert engine.status()["kv_sharing"]["forked_choices"] == forked + 2  # the first chunk came from the fork's step
    stream.close()
    deadline = time.monotonic() + 10
    while engine.status()["running"] or engine.status()["pool"]["kv"] != idle:
        assert time.monotonic() < deadline, engine.status()["pool"]
        time.sleep(0.01)
    assert engine.status()["kv_sharing"] == {**engine.status()["kv_sharing"], "shared_blocks": 0, "pages_saved": 0}


def test_logprobs_through_the_openai_client(openai_client, demo_daemon):
    _, engine = demo_daemon
    answer = openai_client.completions.create(model="demo-r8", prompt="The lighthouse", max_tokens=5, temperature=0,
                                              logprobs=3, extra_body={"ignore_eos": True, "return_token_ids": True})
    choice = answer.choices[0]
    logprobs = choice.logprobs
    token_ids = choice.model_extra["token_ids"]
    assert logprobs.tokens == [engine.tokenizer.token_text(t) for t in token_ids]
    assert len(logprobs.token_logprobs) == 5 and all(value <= 0 for value in logprobs.token_logprobs)
    for token, value, top in zip(logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs):
        assert len(top) <= 3 and max(top.values()) == value and top[token] == value  # greedy: the best one
    assert logprobs.text_offset == [sum(len(t) for t in logprobs.tokens[:i]) for i in range(5)]

    # the same tokens and values, streamed
    streamed = openai_client.completions.create(model="demo-r8", prompt="The lighthouse", max_tokens=5, temperature=0,
                                                logprobs=3, stream=True, extra_body={"ignore_eos": True})
    values = [v for chunk in streamed for v in (chunk.choices[0].logprobs.token_logprobs if chunk.choices[0].logprobs else [])]
    assert values == pytest.approx(logprobs.token_logprobs, abs=1e-6)

    chat = openai_client.chat.completions.create(model="demo-r8", messages=[{"role": "user", "content": "Hi"}],
                                                 max_completion_tokens=4, temperature=0, logprobs=True, top_logprobs=2,
                                                 extra_body={"ignore_eos": True})
    content = chat.choices[0].logprobs.content
    assert len(content) == 4 and "".join(item.token for item in content) == chat.choices[0].message.content
    assert all(len(item.top_logprobs) == 2 and item.top_logprobs[0].logprob == item.logprob for item in content)
    assert all(bytes(item.bytes).decode() == item.token for item in content)
    plain = openai_client.chat.completions.create(model="demo-r8", messages=[{"role": "user", "content": "Hi"}],
                                                  max_completion_tokens=2)
    assert plain.choices[0].logprobs is None


def test_an_adapter_folder_with_its_own_template_uses_it(openai_client, demo_daemon, demo_assets):
    import shutil

    from lorad.client import Client

    server, engine = demo_daemon
    folder = demo_assets.adapters["demo-r8"].parent / "talker"  # under the adapter root loads are allowed from
    shutil.copytree(demo_assets.adapters["demo-r8"], folder)
    try:
        (folder / "chat_template.jinja").write_text("{% for m in messages %}<<{{ m['content'] }}>>{% endfor %}")
        Client(server.path).load_adapter("talker", str(folder))
        messages = [{"role": "user", "content": "Where is the lighthouse?"}]
        answer = openai_client.chat.completions.create(model="talker", messages=messages, max_completion_tokens=2)
        own = engine.tokenizer.encode("<<Where is the lighthouse?>>", add_special_tokens=False)
        assert answer.usage.prompt_tokens == len(own)
        base = openai_client.chat.completions.create(model="demo-r8", messages=messages, max_completion_tokens=2)
        assert base.usage.prompt_tokens != len(own)  # the base model's template for an adapter without one
        (folder / "chat_template.jinja").write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}!")
        changed = openai_client.chat.completions.create(model="talker", messages=messages, max_completion_tokens=2)
        assert changed.usage.prompt_tokens == len(engine.tokenizer.encode("Where is the lighthouse?!", add_special_tokens=False))
    finally:
        Client(server.path).unload_adapter("talker")
        shutil.rmtree(folder)
