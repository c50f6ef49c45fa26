"""A checkpoint's chat template: messages -> the prompt text the model was tuned on, rendered as transformers'
`apply_chat_template` renders it (jinja2 in a sandbox, trim_blocks and lstrip_blocks, the `tojson` filter and
`raise_exception`, the tokenizer's special tokens as variables), for POST /v1/chat/completions.

The template comes from `chat_template.jinja` beside the checkpoint, else from `chat_template` in its
`tokenizer_config.json` (a string, or a list of named templates of which "default" is taken). A checkpoint
without one has none: lorad never makes one up, and a chat request to it gets a 400 naming the files.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from lorad.errors import BadRequest, ModelError

TEMPLATE_FILE = "chat_template.jinja"
TOKENIZER_CONFIG = "tokenizer_config.json"
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token")
ROLES = ("system", "developer", "user", "assistant")  # the roles requests may send


@dataclass(frozen=True)
class ChatTemplate:
    source: str  # the file it came from
    template: object  # the compiled jinja2 template
    special_tokens: dict[str, str]

    def render(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """The prompt text for `messages` ([{role, content: str[, name]}], checked by daemon/server/schemas.py); a
        template that fails is a 400 with its own message."""
        from jinja2 import TemplateError

        try:
            return self.template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                        **self.special_tokens)
        except TemplateError as error:
            raise BadRequest(f"the chat template ({self.source}) refused the messages: {error}") from None


def load_chat_template(directory: Path | None) -> ChatTemplate | None:
    """The template of the checkpoint (or adapter) in `directory`; None where it ships none. A template that
    does not compile is the checkpoint's error (ModelError), said at start-up."""
    if directory is None:
        return None
    config = {}
    config_path = directory / TOKENIZER_CONFIG
    if config_path.exists():
        try:
            config = json.loads(config_path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as error:
            raise ModelError(f"cannot read {config_path}: {error}") from None
        if not isinstance(config, dict):
            raise ModelError(f"{config_path} is not a JSON object")
    template_path = directory / TEMPLATE_FILE
    if template_path.exists():
        text, source = template_path.read_text(encoding="utf-8"), str(template_path)
    else:
        text, source = config.get("chat_template"), f"{config_path} chat_template"
        if isinstance(text, list):  # named templates: [{"name": ..., "template": ...}]
            text = next((entry.get("template") for entry in text
                         if isinstance(entry, dict) and entry.get("name") == "default"), None)
        if text is None:
            return None
        if not isinstance(text, str):
            raise ModelError(f"{source} is not a string")
    special = {}
    for name in SPECIAL_TOKENS:
        token = config.get(name)
        if isinstance(token, dict):  # an AddedToken as transformers saves it
            token = token.get("content")
        special[name] = token if isinstance(token, str) else ""
    return ChatTemplate(source, _compile(text, source), special)


class AdapterTemplates:
    """The chat templates adapter folders ship, read once per folder and again when their files change; an
    adapter without one uses the base model's."""

    def __init__(self):
        self._cache: dict[str, tuple[tuple, ChatTemplate | None]] = {}

    def get(self, directory: str) -> ChatTemplate | None:
        path = Path(directory)
        stamp = tuple(_mtime(path / name) for name in (TEMPLATE_FILE, TOKENIZER_CONFIG))
        cached = self._cache.get(directory)
        if cached is not None and cached[0] == stamp:
            return cached[1]
        template = load_chat_template(path) if any(stamp) else None
        self._cache[directory] = (stamp, template)
        return template


def _mtime(path: Path) -> float | None:
    try:
        return path.stat().st_mtime_ns
    except OSError:
        return None


def _compile(text: str, source: str):
    from jinja2 import TemplateError
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise TemplateError(message)

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    environment.filters["tojson"] = tojson
    environment.globals["raise_exception"] = raise_exception
    environment.globals["strftime_now"] = lambda format: datetime.now().strftime(format)
    try:
        return environment.from_string(text)
    except TemplateError as error:
        raise ModelError(f"the chat template in {source} does not compile: {error}") from None

