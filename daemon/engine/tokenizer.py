"""Text <-> token ids with the checkpoint's tokenizer.json, and incremental detokenization that
emits only whole characters and holds back text that may still become a stop string."""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer

from lorad.errors import BadRequest, ModelError


class Tokenizer:
    def __init__(self, path: Path):
        try:
            self._tokenizer = HFTokenizer.from_file(str(path))
        except Exception as error:  # the tokenizers package raises plain Exception on bad files
            raise ModelError(f"cannot read {path}: {error}") from error

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """add_special_tokens: the post-processor's (a BOS, for most); a chat template writes its own.

        Through encode_batch_fast, which releases the interpreter lock while the Rust code runs and skips the
        offsets lorad does not use: encode holds the lock throughout (on the CPU box 230 ms for a 259k-character
        prompt, about the longest a 4096-token context admits, while no other thread of the API process ran)."""
        return self._tokenizer.encode_batch_fast([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=True)

    def token_text(self, token_id: int) -> str:
        """One token as text, special tokens included (logprobs name tokens this way)."""
        return self._tokenizer.decode([token_id], skip_special_tokens=False)


class NoTokenizer:
    """For checkpoints without tokenizer.json: token ids in, token ids out."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        raise BadRequest("this model has no tokenizer.json: send the prompt as a list of token ids")

    def decode(self, ids: list[int]) -> str:
        return ""

    def token_text(self, token_id: int) -> str:
        return f"token_id:{token_id}"


def load_tokenizer(model_dir: Path | None) -> Tokenizer | NoTokenizer:
    """The checkpoint's tokenizer.json, or NoTokenizer where it has none (a model given by shape only)."""
    path = None if model_dir is None else model_dir / "tokenizer.json"
    return Tokenizer(path) if path is not None and path.exists() else NoTokenizer()


class Detokenizer:
    """Follows one request's generated ids and yields the new text after each token.

    Decodes a short window (a few tokens of context before the unread ones) so a step costs O(1),
    and waits while the tail is an incomplete UTF-8 sequence (decoded as U+FFFD)."""

    def __init__(self, tokenizer, stop: tuple[str, ...]):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0
        self.text = ""  # all text decoded so far
        self.emitted = 0  # characters of text already handed out
        self.stop = stop
        self.holdback = max((len(s) for s in stop), default=1) - 1
        self.stopped = False

    def add(self, token_id: int) -> bool:
        """Appends a token; True if a stop string now appears (text is cut before it)."""
        self.ids.append(token_id)
        prefix = self.tokenizer.decode(self.ids[self.prefix_offset : self.read_offset])
        full = self.tokenizer.decode(self.ids[self.prefix_offset :])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            new_text = full[len(prefix) :]
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.ids)
            search_from = max(0, len(self.text) - self.holdback)
            self.text += new_text
            found = [at for at in (self.text.find(stop, search_from) for stop in self.stop) if at >= 0]
            if found:
                self.text = self.text[: min(found)]
                self.stopped = True
                return True
        return False

    def _flush(self) -> None:
        """At the end, the bytes of an unfinished character decode as U+FFFD like decode() gives them."""
        if self.read_offset < len(self.ids) and not self.stopped:
            prefix = self.tokenizer.decode(self.ids[self.prefix_offset : self.read_offset])
            self.text += self.tokenizer.decode(self.ids[self.prefix_offset :])[len(prefix) :]
            self.read_offset = len(self.ids)

    def take(self, final: bool) -> str:
        """The text not yet handed out; while not final, the last characters that could still begin
        a stop string stay behind."""
        if final:
            self._flush()
        end = len(self.text) if final or not self.stop else max(self.emitted, len(self.text) - self.holdback)
        delta = self.text[self.emitted : end]
        self.emitted = end
        return delta
