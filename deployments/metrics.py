"""Prometheus metrics of the coordinator, through ``ray.serve.metrics``.

Ray exports them with a ``ray_`` prefix (counters also get ``_total``) and adds the
deployment / replica / application tags. Rates are best derived by Prometheus from the
counters, e.g. acceptance rate = rate(accepted) / rate(proposed) and system efficiency =
rate(emitted) / rate(round_slots); per-request histograms and replica gauges are recorded too.

``CoordinatorMetrics`` is safe without Ray (unit tests, in-process engine): if
``ray.serve.metrics`` cannot be imported or a metric cannot be created, every call only
updates the plain-Python ``totals``.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

logger = logging.getLogger("specdec.metrics")

_ROUND_S = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0]
_TTFT_S = [0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0]
_TPOT_S = [0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0]
_LATENCY_S = [0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0]
_RATIO = [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0]

# name -> (kind, description, histogram boundaries)
_SPECS: dict[str, tuple[str, str, list[float] | None]] = {
    "specdec_proposed_tokens": ("counter", "Draft tokens proposed.", None),
    "specdec_accepted_tokens": ("counter", "Draft tokens accepted by the target.", None),
    "specdec_emitted_tokens": ("counter", "Tokens emitted (accepted + recovered / bonus).", None),
    "specdec_rounds": ("counter", "Request-rounds run (one per request per round).", None),
    "specdec_round_slots": ("counter", "Sum over request-rounds of (K + 1): the denominator of system efficiency.", None),
    "specdec_requests_finished": ("counter", "Requests finished, by finish_reason.", None),
    "specdec_acceptance_rate": ("gauge", "This replica's accepted / proposed since start.", None),
    "specdec_system_efficiency": ("gauge", "This replica's emitted / round slots since start.", None),
    "specdec_requests_in_flight": ("gauge", "Requests generating now.", None),
    "specdec_round_draft_seconds": ("histogram", "Draft time per round.", _ROUND_S),
    "specdec_round_target_seconds": ("histogram", "Target (verify) time per round.", _ROUND_S),
    "specdec_round_coordinator_seconds": ("histogram", "Coordinator work (rejection sampling, detokenizing) per round.", _ROUND_S),
    "specdec_round_seconds": ("histogram", "Whole round time.", _ROUND_S),
    "specdec_time_to_first_token_seconds": ("histogram", "Time to first token.", _TTFT_S),
    "specdec_time_per_output_token_seconds": ("histogram", "Time per output token after the first.", _TPOT_S),
    "specdec_request_seconds": ("histogram", "Request latency.", _LATENCY_S),
    "specdec_request_acceptance_rate": ("histogram", "Per-request acceptance rate.", _RATIO),
    "specdec_request_system_efficiency": ("histogram", "Per-request system efficiency.", _RATIO),
}
_COUNTERS = [n for n, (kind, _, _) in _SPECS.items() if kind == "counter"]


def _never_raises(method):
    """Metrics must never fail a request: a bad call is logged (once per method) instead."""
    warned = False

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        nonlocal warned
        try:
            method(self, *args, **kwargs)
        except Exception:
            if not warned:
                warned = True
                logger.exception("CoordinatorMetrics.%s failed; check the call", method.__name__)

    return wrapper


class CoordinatorMetrics:
    """What the coordinator records. Every method is cheap and never raises."""

    def __init__(self, model: str = "", enabled: bool = True):
        self.totals: dict[str, float] = {name: 0 for name in _COUNTERS}
        self.totals.update(in_flight=0)
        self._model = model
        self._metrics = _create(model) if enabled else {}

    @property
    def exporting(self) -> bool:
        return bool(self._metrics)

    # ---- what the coordinator calls ---------------------------------------------------

    @_never_raises
    def round(
        self,
        draft_s: float,
        target_s: float,
        coord_s: float,
        proposed: int,
        accepted: int,
        emitted: int,
        requests: int = 1,
    ) -> None:
        """One round; for a batched round pass the sums over its `requests` rows."""
        self._inc("specdec_proposed_tokens", proposed)
        self._inc("specdec_accepted_tokens", accepted)
        self._inc("specdec_emitted_tokens", emitted)
        self._inc("specdec_rounds", requests)
        self._inc("specdec_round_slots", proposed + requests)  # each row: its k plus one
        for name, seconds in (
            ("specdec_round_draft_seconds", draft_s),
            ("specdec_round_target_seconds", target_s),
            ("specdec_round_coordinator_seconds", coord_s),
            ("specdec_round_seconds", draft_s + target_s + coord_s),
        ):
            self._observe(name, seconds)
        self._set_ratios()

    @_never_raises
    def first_token(self, seconds: float) -> None:
        self._observe("specdec_time_to_first_token_seconds", seconds)

    @_never_raises
    def finished(
        self,
        stats: Any,
        seconds: Any,
        num_tokens: int,
        *,
        ttft_s: float | None = None,
        finish_reason: str | None = None,
    ) -> None:
        """A request ended. `stats`: SpeculationStats / SpecStats (or a dict) of the request;
        `seconds`: its latency, or a RoundTimes-like object whose fields are summed."""
        total = _seconds(seconds)
        self._observe("specdec_request_seconds", total)
        if num_tokens > 1 and ttft_s is not None:
            self._observe("specdec_time_per_output_token_seconds", (total - ttft_s) / (num_tokens - 1))
        elif num_tokens > 0:
            self._observe("specdec_time_per_output_token_seconds", total / num_tokens)
        for name, key in (
            ("specdec_request_acceptance_rate", "acceptance_rate"),
            ("specdec_request_system_efficiency", "system_efficiency"),
        ):
            value = _field(stats, key)
            if value is not None:
                self._observe(name, float(value))
        self._inc("specdec_requests_finished", 1, {"finish_reason": finish_reason or "unknown"})

    @_never_raises
    def in_flight(self, delta: int) -> None:
        self._gauge_add("in_flight", "specdec_requests_in_flight", delta)

    # ---- plumbing ---------------------------------------------------------------------

    def _inc(self, name: str, value: float, tags: dict | None = None) -> None:
        self.totals[name] += value
        metric = self._metrics.get(name)
        if metric is not None and value > 0:
            _safely(metric.inc, value, tags)

    def _observe(self, name: str, value: float) -> None:
        metric = self._metrics.get(name)
        if metric is not None and value == value and value >= 0:  # skip NaN / negative
            _safely(metric.observe, value)

    def _gauge_add(self, key: str, name: str, delta: int) -> None:
        self.totals[key] = max(0, self.totals[key] + delta)
        self._set(name, self.totals[key])

    def _set(self, name: str, value: float) -> None:
        metric = self._metrics.get(name)
        if metric is not None:
            _safely(metric.set, value)

    def _set_ratios(self) -> None:
        t = self.totals
        if t["specdec_proposed_tokens"]:
            self._set("specdec_acceptance_rate", t["specdec_accepted_tokens"] / t["specdec_proposed_tokens"])
        if t["specdec_round_slots"]:
            self._set("specdec_system_efficiency", t["specdec_emitted_tokens"] / t["specdec_round_slots"])


def _create(model: str) -> dict[str, Any]:
    try:
        from ray.serve import metrics as serve_metrics
    except Exception as exc:  # no Ray here: record nothing, keep working
        logger.info("ray.serve.metrics unavailable (%s); metrics are not exported", exc)
        return {}
    created = {}
    try:
        for name, (kind, description, boundaries) in _SPECS.items():
            tag_keys = ("model", "finish_reason") if name == "specdec_requests_finished" else ("model",)
            if kind == "counter":
                metric = serve_metrics.Counter(name, description, tag_keys=tag_keys)
            elif kind == "gauge":
                metric = serve_metrics.Gauge(name, description, tag_keys=tag_keys)
            else:
                metric = serve_metrics.Histogram(name, description, boundaries=boundaries, tag_keys=tag_keys)
            metric.set_default_tags({"model": model})
            created[name] = metric
    except Exception as exc:
        logger.warning("could not create Ray metrics (%s); metrics are not exported", exc)
        return {}
    return created


def _safely(method, value: float, tags: dict | None = None) -> None:
    try:
        method(value, tags=tags) if tags else method(value)
    except Exception as exc:  # metrics must never fail a request
        logger.debug("metric update failed: %s", exc)


def _field(stats: Any, key: str) -> Any:
    if isinstance(stats, dict):
        return stats.get(key)
    value = getattr(stats, key, None)
    return value() if callable(value) else value


def _seconds(value: Any) -> float:
    if isinstance(value, (int, float)):
        return float(value)
    return sum(float(getattr(value, f, 0.0)) for f in ("draft_s", "target_s", "coordinator_s"))
