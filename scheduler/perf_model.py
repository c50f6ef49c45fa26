"""Performance models of one engine: how long a decode step and a prefill take for a given batch.

CaraServe (§5) finds the LoRA kernels memory-bound and their latency linear in one number per batch:
BGMV pads every row to the batch's largest rank (alpha * |S| * max rank + beta), MBGMV does not
(alpha * sum of ranks + beta). The router and the simulator predict with these models; `lorad profile`
fits them from measurements and saves them as a `Profile` (JSON). Pure numpy: no torch, no I/O but JSON.
"""

from __future__ import annotations

import dataclasses

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np

from lorad.errors import BadRequest
from lorad.scheduler.json_file import read_json

KERNELS = ("bgmv", "mbgmv")


@dataclass(frozen=True)
class LinearModel:
    """y = coef . features + intercept, fitted by least squares; r2 is the fit's coefficient of
    determination on the samples it was fitted on (1: perfect, <= 0: no better than the mean)."""

    names: tuple[str, ...]
    coef: tuple[float, ...]
    intercept: float
    r2: float | None = None  # None: not fitted
    num_samples: int = 0

    @classmethod
    def fit(cls, names: Sequence[str], features, y, intercept: bool = True) -> "LinearModel":
        x = np.asarray(features, dtype=np.float64).reshape(len(y), len(names))
        y = np.asarray(y, dtype=np.float64)
        if len(y) < len(names) + int(intercept):
            raise BadRequest(f"{len(y)} samples cannot fit {len(names) + int(intercept)} coefficients")
        design = np.hstack([x, np.ones((len(y), 1))]) if intercept else x
        solution, *_ = np.linalg.lstsq(design, y, rcond=None)
        predicted = design @ solution
        residual = float(np.sum((y - predicted) ** 2))
        spread = float(np.sum((y - y.mean()) ** 2))
        r2 = 1.0 - residual / spread if spread > 0 else (1.0 if residual == 0 else 0.0)
        coef = tuple(float(c) for c in solution[: len(names)])
        return cls(tuple(names), coef, float(solution[-1]) if intercept else 0.0, r2, len(y))

    def predict(self, features) -> float:
        return float(np.dot(self.coef, features)) + self.intercept


@dataclass(frozen=True)
class BgmvModel:
    """Punica's padded BGMV: latency_s = alpha * batch_size * max_rank + beta."""

    alpha: float
    beta: float
    r2: float | None = None  # None: not fitted

    kernel = "bgmv"

    def predict(self, ranks: Sequence[int]) -> float:
        return self.from_stats(len(ranks), max(ranks, default=0), sum(ranks))

    def from_stats(self, batch_size: int, max_rank: int, rank_sum: int) -> float:
        return self.alpha * batch_size * max_rank + self.beta if batch_size else 0.0

    @staticmethod
    def feature(batch_size: int, max_rank: int, rank_sum: int) -> float:
        return batch_size * max_rank


@dataclass(frozen=True)
class MbgmvModel:
    """S-LoRA's unpadded MBGMV: latency_s = alpha * sum_ranks + per_row * batch_size + beta.

    CaraServe's form has no per_row term. lorad's MBGMV has a cost per row beside its rank (each row
    reads its activation and writes its output, and its expand programs span a whole rank tile), which
    that form cannot see: measured on an H100, 7B shape, it fits with R^2 0.84 alone and 0.996 with
    per_row (BENCHMARKS.md). `fit_mbgmv` fits both and keeps the second; r2_rank_sum_only is the first's.
    """

    alpha: float
    beta: float
    r2: float | None = None  # None: not fitted
    per_row: float = 0.0
    r2_rank_sum_only: float | None = None

    kernel = "mbgmv"

    def predict(self, ranks: Sequence[int]) -> float:
        return self.from_stats(len(ranks), max(ranks, default=0), sum(ranks))

    def from_stats(self, batch_size: int, max_rank: int, rank_sum: int) -> float:
        return self.alpha * rank_sum + self.per_row * batch_size + self.beta if batch_size else 0.0

    @staticmethod
    def feature(batch_size: int, max_rank: int, rank_sum: int) -> float:
        return rank_sum


KernelModel = BgmvModel | MbgmvModel


def fit_bgmv(samples: Iterable[tuple[Sequence[int], float]]) -> BgmvModel:
    """samples: (ranks of the batch's rows, measured kernel latency in seconds)."""
    samples = list(samples)
    x = [[len(r) * max(r, default=0)] for r, _ in samples]
    line = LinearModel.fit(["batch_x_max_rank"], x, [t for _, t in samples])
    return BgmvModel(line.coef[0], line.intercept, line.r2)


def fit_mbgmv(samples: Iterable[tuple[Sequence[int], float]]) -> MbgmvModel:
    """Fits alpha * sum_ranks + per_row * batch_size + beta, and reports CaraServe's alpha * sum_ranks
    + beta's R^2 beside it (r2_rank_sum_only)."""
    samples = list(samples)
    y = [t for _, t in samples]
    caraserve = LinearModel.fit(["sum_ranks"], [[sum(r)] for r, _ in samples], y)
    line = LinearModel.fit(["sum_ranks", "batch_size"], [[sum(r), len(r)] for r, _ in samples], y)
    return MbgmvModel(line.coef[0], line.intercept, line.r2, per_row=line.coef[1], r2_rank_sum_only=caraserve.r2)


def choose_kernel(ranks: Sequence[int], bgmv: BgmvModel, mbgmv: MbgmvModel) -> str:
    """The kernel predicted faster for this batch: BGMV for homogeneous ranks (no padding wasted, and
    MBGMV's per-row rank lookups cost extra), MBGMV when a few high ranks would pad many low ones."""
    return "bgmv" if bgmv.predict(ranks) <= mbgmv.predict(ranks) else "mbgmv"


@dataclass(frozen=True)
class DecodeStepModel:
    """One decode step of the whole engine (every running request gains one token):

        step_s = fixed_s + per_request_s * batch_size + per_context_token_s * context_tokens + lora

    The base model's weights are read once per step (fixed_s), each row adds its share of the linear
    layers and sampling (per_request_s), attention reads every cached token (per_context_token_s), and
    the LoRA kernel costs what its `KernelModel` says. When fitted jointly from step timings, the
    kernel's beta is folded into fixed_s (the two cannot be told apart) and kept at 0.
    """

    fixed_s: float
    per_request_s: float
    per_context_token_s: float
    lora: KernelModel
    r2: float | None = None  # None: not fitted

    def predict(self, ranks: Sequence[int], context_tokens: int = 0) -> float:
        return self.from_stats(len(ranks), max(ranks, default=0), sum(ranks), context_tokens)

    def from_stats(self, batch_size: int, max_rank: int, rank_sum: int, context_tokens: int) -> float:
        if batch_size == 0:
            return 0.0
        base = self.fixed_s + self.per_request_s * batch_size + self.per_context_token_s * context_tokens
        return base + self.lora.from_stats(batch_size, max_rank, rank_sum)

    def to_json(self) -> dict:
        """The model as a profile stores it: its fields, the LoRA model's with its kernel's name."""
        return {**asdict(self), "lora": {"kernel": self.lora.kernel, **asdict(self.lora)}}

    @classmethod
    def from_json(cls, data: dict) -> DecodeStepModel:
        """Inverse of `to_json` (KeyError / TypeError on a malformed entry)."""
        fields = dict(data)
        lora = dict(fields.pop("lora"))
        kernel_class = {"bgmv": BgmvModel, "mbgmv": MbgmvModel}[lora.pop("kernel")]
        return cls(lora=kernel_class(**lora), **fields)


def fit_decode_step(samples: Iterable[tuple[Sequence[int], int, float]], kernel: str) -> DecodeStepModel:
    """samples: (ranks of the step's rows, context tokens summed over rows, step latency in seconds)."""
    if kernel not in KERNELS:
        raise BadRequest(f"kernel must be one of {KERNELS}, not {kernel!r}")
    kernel_class = BgmvModel if kernel == "bgmv" else MbgmvModel
    samples = [s for s in samples if len(s[0])]
    x = [[len(r), ctx, kernel_class.feature(len(r), max(r), sum(r))] for r, ctx, _ in samples]
    line = LinearModel.fit(["batch_size", "context_tokens", "lora"], x, [t for *_, t in samples])
    per_request, per_context, alpha = line.coef
    return DecodeStepModel(line.intercept, per_request, per_context, kernel_class(alpha, 0.0, line.r2), line.r2)


@dataclass(frozen=True)
class PrefillModel:
    """One prefill step over a batch of prompts [(tokens, rank), ...]:

        prefill_s = per_token_s * sum(t) + per_rank_token_s * sum(r * t) + per_square_token_s * sum(t^2) + fixed_s

    The base model's linear layers cost per token; the LoRA shrink/expand (SGMV, MBGMM) costs per token
    per rank; causal attention costs per pair of tokens of one prompt; fixed_s is launch overhead.
    CaraServe leaves PrePerf's form open; this is the smallest linear form with those three terms.
    """

    per_token_s: float
    per_rank_token_s: float
    per_square_token_s: float
    fixed_s: float
    r2: float | None = None  # None: not fitted

    @staticmethod
    def features(prompts: Sequence[tuple[int, int]]) -> tuple[float, float, float]:
        return (
            float(sum(t for t, _ in prompts)),
            float(sum(t * r for t, r in prompts)),
            float(sum(t * t for t, _ in prompts)),
        )

    def predict(self, prompts: Sequence[tuple[int, int]]) -> float:
        return self.from_features(*self.features(prompts)) if prompts else 0.0

    def from_features(self, tokens: float, rank_tokens: float, square_tokens: float) -> float:
        return (
            self.per_token_s * tokens
            + self.per_rank_token_s * rank_tokens
            + self.per_square_token_s * square_tokens
            + self.fixed_s
        )


def fit_prefill(samples: Iterable[tuple[Sequence[tuple[int, int]], float]]) -> PrefillModel:
    """samples: (the step's prompts as (tokens, rank) pairs, prefill latency in seconds)."""
    samples = [s for s in samples if len(s[0])]
    x = [PrefillModel.features(prompts) for prompts, _ in samples]
    line = LinearModel.fit(["tokens", "rank_tokens", "square_tokens"], x, [t for _, t in samples])
    return PrefillModel(*line.coef, line.intercept, line.r2)


@dataclass(frozen=True)
class CollectiveModel:
    """The all-reduces of a tensor-parallel engine of `size` ranks: one all-reduce of [tokens, hidden] costs

        allreduce_s = fixed_s + per_token_s * tokens

    and a step runs `calls_per_step` of them (two a layer: after o and after down). A profile of such an
    engine fits its decode-step and prefill models on whole steps of every rank in step, so their coefficients
    hold this cost already (it is linear in the rows, as their per-row terms are); this model says what part
    of a step it is."""

    fixed_s: float
    per_token_s: float
    calls_per_step: int
    size: int
    r2: float | None = None  # None: not fitted

    def step_seconds(self, tokens: int) -> float:
        """Seconds of one step's all-reduces over `tokens` rows (a decode step: its batch; a prefill: its tokens)."""
        return self.calls_per_step * (self.fixed_s + self.per_token_s * tokens) if tokens else 0.0


def fit_collective(samples: Iterable[tuple[int, float]], calls_per_step: int, size: int) -> CollectiveModel:
    """samples: (rows of the all-reduced [rows, hidden] tensor, seconds of one all-reduce). Neither part of an
    all-reduce's time is negative: where noise pulls the least-squares line's intercept or slope below 0, the
    other is fitted alone (through the origin, or the mean)."""
    samples = list(samples)
    x, y = [[tokens] for tokens, _ in samples], [t for _, t in samples]
    line = LinearModel.fit(["tokens"], x, y)
    fixed, per_token, r2 = line.intercept, line.coef[0], line.r2
    if fixed < 0:
        through_origin = LinearModel.fit(["tokens"], x, y, intercept=False)
        fixed, per_token, r2 = 0.0, through_origin.coef[0], through_origin.r2
    elif per_token < 0:
        fixed, per_token, r2 = float(np.mean(y)), 0.0, 0.0
    return CollectiveModel(fixed, per_token, calls_per_step, size, r2)


@dataclass(frozen=True)
class Profile:
    """What `lorad profile` measured on one machine: the fitted models and how well they fit. A profile of a
    tensor-parallel engine (`tensor_parallel_size` > 1 in `machine`) holds the steps of all its ranks and
    their all-reduces (`collectives`)."""

    machine: dict  # e.g. {"gpu": "H100 80GB", "model": "Llama-2-7b", "dtype": "bfloat16", "measured": True}
    decode: DecodeStepModel
    prefill: PrefillModel
    bgmv: BgmvModel | None = None  # kernel-only fits, for choose_kernel
    mbgmv: MbgmvModel | None = None
    notes: dict = field(default_factory=dict)
    collectives: CollectiveModel | None = None  # tensor_parallel_size > 1 only

    @property
    def tensor_parallel_size(self) -> int:
        """The GPUs the profiled engine spans (profiles written before the field: 1)."""
        return int(self.machine.get("tensor_parallel_size", 1))

    def to_json(self) -> dict:
        return {
            "version": 1,
            "machine": self.machine,
            "decode": self.decode.to_json(),
            "prefill": asdict(self.prefill),
            "bgmv": asdict(self.bgmv) if self.bgmv else None,
            "mbgmv": asdict(self.mbgmv) if self.mbgmv else None,
            "collectives": asdict(self.collectives) if self.collectives else None,
            "notes": self.notes,
        }

    @classmethod
    def from_json(cls, data: dict) -> "Profile":
        try:
            if data.get("version") != 1:
                raise BadRequest(f"unknown profile version {data.get('version')!r}")
            return cls(
                machine=dict(data["machine"]),
                decode=DecodeStepModel.from_json(data["decode"]),
                prefill=PrefillModel(**data["prefill"]),
                bgmv=BgmvModel(**data["bgmv"]) if data.get("bgmv") else None,
                mbgmv=MbgmvModel(**data["mbgmv"]) if data.get("mbgmv") else None,
                notes=dict(data.get("notes") or {}),
                collectives=CollectiveModel(**data["collectives"]) if data.get("collectives") else None,
            )
        except (KeyError, TypeError, AttributeError) as error:
            raise BadRequest.malformed("profile", error) from None

    def decode_for(self, kernel: str) -> DecodeStepModel:
        """The decode-step model of engines whose steps run `kernel` (bgmv or mbgmv): `decode` when it is
        that kernel's, else the fit `lorad profile` keeps for the other one in `notes`."""
        if self.decode.lora.kernel == kernel:
            return self.decode
        other = self.notes.get(f"decode_{kernel}")
        if other is None:
            raise BadRequest(f"the profile has no decode model for {kernel} (run `lorad profile` again)")
        try:
            return DecodeStepModel.from_json(other)
        except (KeyError, TypeError) as error:
            raise BadRequest(f"malformed decode_{kernel} model in the profile: {error}") from None

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=2, allow_nan=False) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> "Profile":
        return cls.from_json(read_json(path, "profile"))


NOT_MEASURED = "NOT MEASURED: the example profile's illustrative coefficients (scheduler/perf_model.py), not this machine's"


def example_profile(kernel: str = "bgmv") -> Profile:
    """Illustrative coefficients, not a measurement: a Llama-2-7B-sized model on one A10-class GPU, in
    the range of CaraServe's Fig. 5 (a batch of 24 at rank 32 decodes in ~35 ms). For tests and for
    simulations until `lorad profile` has measured the real machine."""
    if kernel not in KERNELS:
        raise BadRequest(f"kernel must be one of {KERNELS}, not {kernel!r}")
    bgmv = BgmvModel(alpha=4.0e-6, beta=2.0e-4)
    mbgmv = MbgmvModel(alpha=5.0e-6, beta=4.0e-4)
    return Profile(
        machine={"description": "illustrative A10-class numbers for a 7B model", "measured": False},
        decode=DecodeStepModel(
            fixed_s=0.030,
            per_request_s=5.0e-5,
            per_context_token_s=2.0e-8,
            lora=bgmv if kernel == "bgmv" else mbgmv,
        ),
        prefill=PrefillModel(per_token_s=2.0e-4, per_rank_token_s=2.0e-8, per_square_token_s=1.0e-8, fixed_s=0.005),
        bgmv=bgmv,
        mbgmv=mbgmv,
    )


def profile_for(path: str | None, kernel: str | None = None) -> Profile:
    """The profile at `path` (the example one, NOT MEASURED, without), its decode model that of engines
    whose steps all run `kernel` (None: the measured profile's own choice; the example profile's
    default is bgmv)."""
    if path is None:
        return example_profile(kernel or "bgmv")
    profile = Profile.load(path)
    if kernel is None:
        return profile
    return dataclasses.replace(profile, decode=profile.decode_for(kernel))
