"""How long one engine step takes, from the shape of the batch the scheduler produced.

A step is described by the five numbers of ``common.engine.step_log.step_shape`` (tokens, seqs,
samples, attention pairs, context tokens), taken from a ``SchedulerOutput``.

Two models turn them into seconds:

- ``LinearCostModel``: ``t = c0 + c_tok*tokens + c_seq*seqs + c_smp*samples + c_pair*pairs +
  c_ctx*context``, fitted by ``fit_linear`` (non-negative least squares on relative error) to steps
  measured by ``pdctl calibrate`` on this machine.
- ``RooflineCostModel``: a GPU profile and a model's FLOPs/bytes:
  ``t = overhead + max(FLOPs / (peak * mfu), bytes / (bandwidth * mbu))`` where FLOPs are the
  matmuls of every token, the logits of every sample and the attention pairs, and bytes are the
  weights (read once per step) plus the KV read and written.  With ``tp`` ranks each computes and
  reads its share (its heads' KV: a replicated head is read on every rank holding it), and the
  step adds its collectives on the worker's interconnect: two all-reduces of the hidden states per
  layer and one for the embedding, plus the sampled rows' logits gathered on rank 0.
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Sequence

import numpy as np

from pdctl.planner.hardware import GPUS, LINKS, MODELS, GPUProfile, LinkProfile, ModelSpec, all_reduce_seconds

FEATURES = ("const", "tokens", "seqs", "samples", "pairs", "context")


class CostModel:
    """Seconds per engine step; subclasses say how."""

    kind = "abstract"

    def step_time(self, tokens: int, seqs: int, samples: int, pairs: float, context: int) -> float:
        raise NotImplementedError

    def step_times(self, shapes: np.ndarray) -> np.ndarray:
        """Vectorised ``step_time`` over rows of ``(tokens, seqs, samples, pairs, context)``."""
        return np.array([self.step_time(*row) for row in shapes])

    def describe(self) -> str:
        raise NotImplementedError

    def to_dict(self) -> dict:
        raise NotImplementedError


@dataclass
class LinearCostModel(CostModel):
    """``t = coefficients . (1, tokens, seqs, samples, pairs, context)``; see the module docstring."""

    coefficients: tuple[float, ...]
    fit: dict = field(default_factory=dict)  # quality of the fit and where the points came from
    kind = "linear"

    def __post_init__(self) -> None:
        if len(self.coefficients) != len(FEATURES):
            raise ValueError(f"a linear cost model has {len(FEATURES)} coefficients {FEATURES}, "
                             f"got {len(self.coefficients)}")
        if any(not math.isfinite(c) or c < 0 for c in self.coefficients):
            raise ValueError(f"cost coefficients must be finite and >= 0, got {self.coefficients}")
        self.coefficients = tuple(float(c) for c in self.coefficients)

    def step_time(self, tokens, seqs, samples, pairs, context) -> float:
        c0, ct, cs, cm, cp, cc = self.coefficients
        return c0 + ct * tokens + cs * seqs + cm * samples + cp * pairs + cc * context

    def step_times(self, shapes: np.ndarray) -> np.ndarray:
        shapes = np.asarray(shapes, dtype=float)
        return self.coefficients[0] + shapes @ np.asarray(self.coefficients[1:])

    def describe(self) -> str:
        c = dict(zip(FEATURES, self.coefficients))
        return (f"linear (calibrated): {c['const'] * 1e3:.3g} ms/step + {c['tokens'] * 1e6:.3g} us/token + "
                f"{c['seqs'] * 1e6:.3g} us/seq + {c['samples'] * 1e6:.3g} us/sample + "
                f"{c['pairs'] * 1e9:.3g} ns/attention pair + {c['context'] * 1e9:.3g} ns/context token")

    def to_dict(self) -> dict:
        return {"kind": self.kind, "features": list(FEATURES), "coefficients": list(self.coefficients),
                "fit": self.fit}


@dataclass
class RooflineCostModel(CostModel):
    """A GPU profile and a model's FLOPs and bytes; see the module docstring."""

    gpu: GPUProfile
    model: ModelSpec
    tp: int = 1  # GPUs per worker (tensor parallelism)
    interconnect: LinkProfile | None = None  # between a worker's GPUs (default: the GPU's NVLink)
    kind = "roofline"

    def with_tp(self, tp: int) -> "RooflineCostModel":
        """The same GPU and model on workers of ``tp`` GPUs."""
        return replace(self, tp=tp)

    def __post_init__(self) -> None:
        self._rank_kv_bytes = self.model.rank_kv_bytes_per_token(self.tp)  # refuses a TP that does not split it
        self._link = self.interconnect or LINKS[self.gpu.default_link]

    def step_time(self, tokens, seqs, samples, pairs, context) -> float:
        m, g, tp = self.model, self.gpu, self.tp
        flops = m.flops_per_token * tokens + m.flops_per_logit_row * samples + m.attention_flops_per_pair * pairs
        nbytes = m.weight_bytes / tp + self._rank_kv_bytes * (context + tokens)
        seconds = g.step_overhead_s + max(flops / tp / (g.bf16_flops * g.mfu), nbytes / (g.hbm_bandwidth * g.mbu))
        return seconds + self.collective_seconds(tokens, samples) if tp > 1 else seconds

    def step_times(self, shapes: np.ndarray) -> np.ndarray:
        s = np.asarray(shapes, dtype=float)
        m, g, tp = self.model, self.gpu, self.tp
        flops = m.flops_per_token * s[:, 0] + m.flops_per_logit_row * s[:, 2] + m.attention_flops_per_pair * s[:, 3]
        nbytes = m.weight_bytes / tp + self._rank_kv_bytes * (s[:, 4] + s[:, 0])
        seconds = g.step_overhead_s + np.maximum(flops / tp / (g.bf16_flops * g.mfu), nbytes / (g.hbm_bandwidth * g.mbu))
        if tp > 1:
            seconds = seconds + np.array([self.collective_seconds(t, n) for t, n in zip(s[:, 0], s[:, 2])])
        return seconds

    def collective_seconds(self, tokens: float, samples: float) -> float:
        """A step's collectives: two all-reduces of the hidden states per layer and one for the
        vocabulary-parallel embedding, then the sampled rows' logits (fp32) gathered on rank 0."""
        m, link, tp = self.model, self._link, self.tp
        hidden = all_reduce_seconds(tokens * m.hidden_size * m.dtype_bytes, tp, link)
        gather = (tp - 1) * (link.latency_s + samples * m.vocab_size * 4.0 / tp / link.bandwidth)
        return (2 * m.num_layers + 1) * hidden + gather

    def describe(self) -> str:
        g, m = self.gpu, self.model
        tp = f" x TP {self.tp}" if self.tp > 1 else ""
        return (f"roofline: {g.name}{tp} ({g.bf16_flops / 1e12:.0f} TFLOP/s bf16 x mfu {g.mfu:g}, "
                f"{g.hbm_bandwidth / 1e12:.2f} TB/s x mbu {g.mbu:g}, {g.step_overhead_s * 1e3:g} ms/step) running "
                f"{m.name} ({m.num_params / 1e9:.2f}B params, {m.kv_bytes_per_token / 1024:.0f} KiB KV/token)")

    def to_dict(self) -> dict:
        return {"kind": self.kind, "gpu": asdict(self.gpu), "model": asdict(self.model), "tp": self.tp}


@dataclass
class ServingCostModel(CostModel):
    """An engine cost model as a serving worker runs it now: prefill steps (any prompt tokens)
    ``prefill_speed`` times the engine's time, decode-only steps ``decode_speed`` times, plus
    ``step_overhead_s`` per step and ``sample_overhead_s`` per token streamed (what serving adds).

    Two speeds, because on a shared host a prompt's compute and a decode step's latency-bound work
    do not slow down alike (and ``pdctl calibrate`` times decode steps in-process, without the
    worker's event loop around them)."""

    base: CostModel
    prefill_speed: float = 1.0
    decode_speed: float = 1.0
    step_overhead_s: float = 0.0
    sample_overhead_s: float = 0.0
    kind = "serving"

    def __post_init__(self) -> None:
        if not (self.prefill_speed > 0 and self.decode_speed > 0):
            raise ValueError(f"speeds must be > 0, got {self.prefill_speed}, {self.decode_speed}")
        if not (self.step_overhead_s >= 0 and self.sample_overhead_s >= 0):
            raise ValueError("overheads must be >= 0 s")

    def step_time(self, tokens, seqs, samples, pairs, context) -> float:
        speed = self.prefill_speed if tokens > seqs else self.decode_speed
        return (speed * self.base.step_time(tokens, seqs, samples, pairs, context) + self.step_overhead_s
                + self.sample_overhead_s * samples)

    def step_times(self, shapes: np.ndarray) -> np.ndarray:
        s = np.asarray(shapes, dtype=float)
        speed = np.where(s[:, 0] > s[:, 1], self.prefill_speed, self.decode_speed)
        return speed * self.base.step_times(s) + self.step_overhead_s + self.sample_overhead_s * s[:, 2]

    def describe(self) -> str:
        return (f"{self.base.describe()}; serving: prefill x{self.prefill_speed:.3g}, decode x{self.decode_speed:.3g}, "
                f"+{self.step_overhead_s * 1e3:.3g} ms/step, +{self.sample_overhead_s * 1e3:.3g} ms/token streamed")

    def to_dict(self) -> dict:
        return {"kind": self.kind, "base": self.base.to_dict(), "prefill_speed": self.prefill_speed,
                "decode_speed": self.decode_speed, "step_overhead_s": self.step_overhead_s,
                "sample_overhead_s": self.sample_overhead_s}


# ---- fitting ---------------------------------------------------------------------------------


def nnls(a: np.ndarray, b: np.ndarray, max_iter: int = 200) -> np.ndarray:
    """Non-negative least squares, min ||a x - b|| with x >= 0 (Lawson-Hanson active set)."""
    n = a.shape[1]
    x = np.zeros(n)
    passive = np.zeros(n, dtype=bool)
    for _ in range(max_iter):
        grad = a.T @ (b - a @ x)
        candidates = ~passive & (grad > 1e-12 * max(1.0, np.abs(grad).max()))
        if not candidates.any():
            break
        passive[np.argmax(np.where(candidates, grad, -np.inf))] = True
        while True:
            z = np.zeros(n)
            z[passive] = np.linalg.lstsq(a[:, passive], b, rcond=None)[0]
            if (z[passive] > 0).all():
                x = z
                break
            bad = passive & (z <= 0)
            alpha = np.min(x[bad] / (x[bad] - z[bad]))
            x = x + alpha * (z - x)
            passive &= x > 1e-15
            x[~passive] = 0.0
    return x


def fit_linear(shapes: Sequence[Sequence[float]], seconds: Sequence[float], source: dict | None = None
               ) -> LinearCostModel:
    """Fit a ``LinearCostModel`` to measured steps, minimising the relative error of each step.

    ``shapes`` are ``(tokens, seqs, samples, pairs, context)`` rows; ``seconds`` their measured times.
    Columns are scaled before solving so the coefficients' very different magnitudes do not matter.
    """
    x = np.asarray(shapes, dtype=float)
    y = np.asarray(seconds, dtype=float)
    if x.ndim != 2 or x.shape[1] != len(FEATURES) - 1 or len(y) != len(x):
        raise ValueError(f"expected rows of {len(FEATURES) - 1} features and one time per row")
    if len(y) < len(FEATURES):
        raise ValueError(f"need at least {len(FEATURES)} measured steps to fit, got {len(y)}")
    if not (y > 0).all():
        raise ValueError("measured step times must be > 0")
    design = np.hstack([np.ones((len(x), 1)), x])
    weights = 1.0 / y  # relative error: a 1 ms decode step matters as much as a 1 s prefill
    scale = np.abs(design).max(axis=0)
    scale[scale == 0] = 1.0
    coef = nnls(design * weights[:, None] / scale, y * weights) / scale
    predicted = design @ coef
    rel = np.abs(predicted - y) / y
    fit = {"num_steps": int(len(y)), "median_rel_error": round(float(np.median(rel)), 4),
           "p90_rel_error": round(float(np.quantile(rel, 0.9)), 4), "max_rel_error": round(float(rel.max()), 4)}
    if source:
        fit.update(source)
    return LinearCostModel(tuple(coef), fit)


# ---- files -----------------------------------------------------------------------------------


def cost_model_from_dict(data: dict) -> CostModel:
    kind = data.get("kind") if isinstance(data, dict) else None
    if kind == "linear":
        if list(data.get("features", FEATURES)) != list(FEATURES):
            raise ValueError(f"calibration features {data.get('features')} differ from {list(FEATURES)}: "
                             "re-run pdctl calibrate")
        return LinearCostModel(tuple(data["coefficients"]), dict(data.get("fit") or {}))
    if kind == "roofline":
        return RooflineCostModel(GPUProfile(**data["gpu"]), ModelSpec(**data["model"]), data.get("tp", 1))
    if kind == "serving":
        return ServingCostModel(cost_model_from_dict(data["base"]), float(data["prefill_speed"]),
                                float(data["decode_speed"]), float(data.get("step_overhead_s", 0.0)),
                                float(data.get("sample_overhead_s", 0.0)))
    raise ValueError(f"unknown cost model kind {kind!r} (expected 'linear', 'roofline' or 'serving')")


def load_cost_model(path: str | Path) -> CostModel:
    """A cost model saved by ``pdctl calibrate`` (its JSON file)."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot read the calibration {str(path)!r}: {exc}") from None
    if isinstance(data, dict) and "cost_model" in data:
        data = data["cost_model"]
    try:
        return cost_model_from_dict(data)
    except (KeyError, TypeError) as exc:
        raise ValueError(f"calibration {str(path)!r} is malformed: {type(exc).__name__}: {exc}") from None


def roofline(gpu: str, model: ModelSpec | str, efficiency: float | None = None) -> RooflineCostModel:
    if gpu not in GPUS:
        raise ValueError(f"unknown GPU {gpu!r}: expected one of {', '.join(GPUS)}")
    spec = MODELS[model] if isinstance(model, str) else model
    return RooflineCostModel(GPUS[gpu].with_efficiency(efficiency), spec)
