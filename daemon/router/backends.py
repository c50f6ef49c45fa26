"""What `lorad router` knows of each backend engine: whether it answers, which models it serves at which
LoRA rank, and its batch. The batch is the router's own requests in flight there (exact, updated as
their tokens stream back) plus the requests others sent it, taken from the engine's last `/v1/status`
(polled every `poll_interval_s`). `Backend.view` turns that into the `EngineView` the routing policies
of scheduler/router.py read.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
from lorad.scheduler.router import EngineView

log = logging.getLogger(__name__)

STATUS_TIMEOUT_S = 2.0  # a poll not answered by then marks the backend down
MODELS_EVERY_S = 2.0  # /v1/models is re-read this often (adapters come and go through the admin routes)
DOWN_RETRY_S = 1.0  # a backend marked down is probed again this often
_BATCH_FIELDS = ("max_running_requests", "free_kv_tokens", "running_batch", "waiting_batch")
_in_flight_ids = itertools.count()


@dataclass(eq=False)
class InFlightRequest:
    """One request the router forwarded to a backend and has not seen end."""

    rank: int  # of its adapter (0: the base model)
    prompt_tokens: int  # exact for token-id prompts, estimated for text (the router has no tokenizer)
    max_tokens: int
    streamed: bool
    generated: int = 0  # tokens seen so far: from the stream, or from the last poll for non-streamed ones
    running: bool = False  # in the engine's running batch (not waiting for its prefill)
    started: float = field(default_factory=time.monotonic)
    id: int = field(default_factory=lambda: next(_in_flight_ids))


class Backend:
    """One lorad engine behind the router, reached over its Unix socket.

    `up` is False until the first poll answers, and again whenever a poll or a forwarded request fails
    to reach it (`down_reason` says why); polls go on, and the first that answers brings it back.
    """

    def __init__(self, index: int, socket_path: str):
        self.index = index
        self.socket_path = socket_path
        self.up = False
        self.down_reason: str | None = "not polled yet"
        self.down_since: float | None = time.time()
        self.base_model: str | None = None
        self.ranks: dict[str, int | None] = {}  # model id -> LoRA rank (0: base; None: unknown)
        self.models: list[dict] = []  # the backend's /v1/models entries
        self.status: dict | None = None  # its last /v1/status
        self.polled_at: float | None = None
        self.models_at: float = -1e9
        self.in_flight: dict[int, InFlightRequest] = {}
        self.foreign_running: list[tuple[int, int, int]] = []  # (rank, output tokens left, context tokens)
        self.foreign_waiting: list[tuple[int, int]] = []  # (rank, prompt tokens)
        self.routed = 0  # requests forwarded
        self.failed = 0  # forwarded requests that ended in a backend failure
        self.drops: dict[str, int] = {}  # requests it refused (admission_dropped, overloaded_error), by error type
        self.retries = 0  # requests forwarded here after another backend refused them
        self.session: aiohttp.ClientSession | None = None

    # --- the connection ---------------------------------------------------------------------------------

    def open(self) -> None:
        # A fresh connection per request (force_close): a pooled one that died with the backend would be
        # found out only after the request was written, when it is no longer clear whether it ran.
        connector = aiohttp.UnixConnector(self.socket_path, limit=0, force_close=True)
        self.session = aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None))

    async def close(self) -> None:
        if self.session is not None:
            await self.session.close()
            self.session = None

    # --- health -----------------------------------------------------------------------------------------

    def mark_down(self, reason: str) -> None:
        if self.up:
            log.warning("backend down socket=%s reason=%s in_flight=%d", self.socket_path, reason, len(self.in_flight))
            self.down_since = time.time()
        self.up = False
        self.down_reason = reason

    def _mark_up(self) -> None:
        if not self.up:
            log.info("backend up socket=%s base_model=%s models=%d", self.socket_path, self.base_model, len(self.ranks))
        self.up, self.down_reason, self.down_since = True, None, None

    def serves(self, model: str) -> bool:
        return model in self.ranks

    # --- polling ------------------------------------------------------------------------------------------

    async def poll_forever(self, interval_s: float) -> None:
        """Polls /v1/status every `interval_s` while up, every DOWN_RETRY_S while down; never returns."""
        while True:
            await self.poll()
            await asyncio.sleep(interval_s if self.up else max(interval_s, DOWN_RETRY_S))

    async def poll(self, refresh_models: bool = False) -> None:
        """One status poll (and a /v1/models read when due or asked); failures mark the backend down."""
        try:
            if refresh_models or not self.up or time.monotonic() - self.models_at >= MODELS_EVERY_S:
                await self._read_models()
            status = await self._get("/v1/status")
            missing = [name for name in _BATCH_FIELDS if name not in status]
            if missing:
                raise ValueError(f"its /v1/status lacks {', '.join(missing)} (a lorad older than the router?)")
        except (aiohttp.ClientError, OSError, asyncio.TimeoutError, ValueError) as error:
            self.mark_down(_describe(error))
            return
        self.status, self.polled_at = status, time.monotonic()
        self._find_foreign_requests(status["running_batch"], status["waiting_batch"])
        self._mark_up()

    async def _get(self, path: str) -> dict:
        timeout = aiohttp.ClientTimeout(total=STATUS_TIMEOUT_S)
        async with self.session.get(f"http://localhost{path}", timeout=timeout) as response:
            if response.status != 200:
                raise ValueError(f"GET {path} answered {response.status}: {(await response.text())[:200]}")
            return json.loads(await response.read())

    async def _read_models(self) -> None:
        entries = (await self._get("/v1/models"))["data"]
        ranks: dict[str, int | None] = {}
        for entry in entries:
            if entry.get("kind") == "base" or entry.get("parent") is None:
                self.base_model = entry["id"]
                ranks[entry["id"]] = 0
            else:
                ranks[entry["id"]] = entry.get("rank") if entry.get("rank") is not None else declared_rank(entry.get("path"))
        self.models, self.ranks, self.models_at = entries, ranks, time.monotonic()

    def _find_foreign_requests(self, running: list, waiting: list) -> None:
        """The polled batch less the router's own requests: those are matched to entries of their rank
        (oldest first, the running batch first for those that have produced tokens); what is left was sent
        by someone else. A non-streamed request matched in the running batch is marked running, with
        the tokens it has produced so far."""
        running = [list(entry) for entry in running]  # [rank, context tokens, output tokens left]
        waiting = [list(entry) for entry in waiting]  # [rank, tokens to prefill]
        for flight in sorted(self.in_flight.values(), key=lambda f: f.started):
            order = (running, waiting) if flight.generated or flight.running else (waiting, running)
            for entries in order:
                match = next((i for i, entry in enumerate(entries) if entry[0] == flight.rank), None)
                if match is not None:
                    entry = entries.pop(match)
                    if entries is running and not flight.streamed:
                        flight.running = True
                        flight.generated = max(flight.generated, entry[1] - flight.prompt_tokens)
                    break
        self.foreign_running = [(rank, left, context) for rank, context, left in running]
        self.foreign_waiting = [(rank, prompt) for rank, prompt in waiting]

    def dropped(self, flight: InFlightRequest, kind: str) -> None:
        """The backend refused `flight` (early abort, or no room to queue it): counted, and forgotten at once
        in this backend's view, so the policy does not count it here while it is routed elsewhere."""
        self.in_flight.pop(flight.id, None)
        self.drops[kind] = self.drops.get(kind, 0) + 1

    # --- the view the policies read -------------------------------------------------------------------------

    def engine_view(self) -> EngineView:
        """EngineView (engine_id = this backend's index) of the batch a new request would join; only for
        a backend that is up (it has answered a poll)."""
        status = self.status
        running, queued = list(self.foreign_running), list(self.foreign_waiting)
        for flight in self.in_flight.values():
            if flight.running or flight.generated:
                left = max(0, flight.max_tokens - flight.generated)
                running.append((flight.rank, left, flight.prompt_tokens + flight.generated))
            else:
                queued.append((flight.rank, flight.prompt_tokens))
        return EngineView.build(
            self.index, status["max_running_requests"], running=running, queued=queued,
            free_kv_tokens=status["free_kv_tokens"], tensor_parallel_size=self.tensor_parallel_size,
        )

    @property
    def tensor_parallel_size(self) -> int:
        """The GPUs the engine spans, from its /v1/status (`tensor_parallel.size`; a lorad that does not say: 1). A
        tensor-parallel engine is one backend: one batch, one KV capacity, its steps those of its size's profile."""
        return int(((self.status or {}).get("tensor_parallel") or {}).get("size", 1))

    def describe(self) -> dict:
        """This backend's entry in the router's /v1/status."""
        return {
            "socket": self.socket_path,
            "up": self.up,
            "down_reason": self.down_reason,
            "down_since": self.down_since,
            "base_model": self.base_model,
            "tensor_parallel_size": self.tensor_parallel_size,
            "gpus": ((self.status or {}).get("tensor_parallel") or {}).get("gpus"),
            "models": len(self.ranks),
            "routed": self.routed,
            "failed": self.failed,
            "drops": dict(self.drops),
            "retries": self.retries,
            "in_flight": len(self.in_flight),
            "foreign_running": len(self.foreign_running),
            "foreign_waiting": len(self.foreign_waiting),
            "status_age_s": None if self.polled_at is None else round(time.monotonic() - self.polled_at, 3),
            "status": self.status,
        }


def _describe(error: BaseException) -> str:
    if isinstance(error, asyncio.TimeoutError):
        return f"no answer within {STATUS_TIMEOUT_S:.0f} s"
    return f"{type(error).__name__}: {error}" if str(error) else type(error).__name__


_declared: dict[str, int | None] = {}


def declared_rank(adapter_dir: str | None) -> int | None:
    """The rank an adapter directory's adapter_config.json declares (the largest of `r` and its
    `rank_pattern`), for adapters a backend lists before reading them (rank null, location disk).
    None when there is no such file or it cannot be read; cached per directory."""
    if adapter_dir is None:
        return None
    if adapter_dir not in _declared:
        try:
            config = json.loads((Path(adapter_dir) / "adapter_config.json").read_text())
            ranks = [config.get("r", 8), *(config.get("rank_pattern") or {}).values()]  # PEFT's default r is 8
            _declared[adapter_dir] = max(int(rank) for rank in ranks)
        except (OSError, ValueError, TypeError, AttributeError) as error:
            log.warning("adapter rank unknown path=%s reason=%s", adapter_dir, error)
            _declared[adapter_dir] = None
    return _declared[adapter_dir]
