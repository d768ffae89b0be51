"""Serving figures for `status.serving` from the engine pods' Prometheus `/metrics`.

mean accept length = 1 + accepted draft tokens / verify steps, summed over ready pods (each
counter is cumulative since its pod started, so this is the lifetime mean of the current pods);
tokens per second = generated tokens per second over the last RATE_WINDOW_S, from each pod's
cumulative generation counter between the oldest and newest scrape of it inside that window,
summed over the pods (TokenRate; a pod seen once contributes its own throughput gauge, a pod
whose counter went back restarted and starts afresh); prefix cache hit rate =
prompt tokens found in the cache / prompt tokens looked up, summed over the pods (lifetime).
An engine with adaptive speculation also reports the shape of its last decode step and its
measured per-depth acceptance: the status shows the shapes the pods run (one label, or the
distinct ones joined with '/') and the acceptance per depth averaged over the pods, and the
smallest crossover batch of the pods (where speculation stops paying); saturation (the
speculation-aware scaling signal) is the mean over the pods. Each sample keeps the metric names
the pod serves, so the operator can tell an autoscaler's target that no pod exports.

While an engine pod runs but is not ready, its /health says how much of the plan's weights it
has loaded (`{"loading": {"loaded_bytes", "total_bytes"}}`): `loading_progress` reads that for
the Ready condition's "X GiB of Y GiB of weights loaded" (desired/pods.py).
"""

from __future__ import annotations

import contextlib
import ipaddress
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import httpx
from specdeploy.operator.desired.render import ENGINE_PORT

ACCEPTED_TOKENS = "specdeploy_spec_decode_num_accepted_tokens_total"
VERIFY_STEPS = "specdeploy_spec_decode_num_steps_total"
TOKENS_PER_SECOND = "specdeploy_generation_tokens_per_second"
GENERATED_TOKENS = "specdeploy_generation_tokens_total"
# The window of status.serving.tokensPerSecond (the Tok/s column).
RATE_WINDOW_S = 60.0
ADAPTIVE = "specdeploy_spec_decode_adaptive"
SHAPE = "specdeploy_spec_decode_shape"
ACCEPTANCE_RATE = "specdeploy_spec_decode_acceptance_rate"
PREFIX_HITS = "specdeploy_prefix_cache_hits_total"
PREFIX_QUERIES = "specdeploy_prefix_cache_queries_total"
CROSSOVER = "specdeploy_spec_decode_crossover_batch_size"
SATURATION = "specdeploy_saturation"
SCRAPE_TIMEOUT_S = 2.0

# name{labels} value  (timestamps, if any, follow the value and are ignored)
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


@dataclass(frozen=True)
class EngineSample:
    accepted_tokens: float
    verify_steps: float
    tokens_per_second: float
    shape: str | None = None                        # adaptive engines: the last decode step's
    acceptance_rates: tuple[float, ...] = ()        # adaptive engines: depth 1, 2, ...
    prefix_hits: float = 0.0                        # prompt tokens found in the prefix cache
    prefix_queries: float = 0.0                     # prompt tokens looked up in it
    crossover_batch: float = 0.0                    # adaptive engines: 0 = none within its batch sizes
    saturation: float | None = None                 # None: the engine does not export it
    names: frozenset[str] = frozenset()             # every metric name the pod serves
    generated_tokens: float = 0.0                   # cumulative, since the pod started


def parse_engine_metrics(text: str) -> EngineSample:
    """Sum each wanted metric over its label sets; absent metrics count as 0."""
    totals = {ACCEPTED_TOKENS: 0.0, VERIFY_STEPS: 0.0, TOKENS_PER_SECOND: 0.0, PREFIX_HITS: 0.0, PREFIX_QUERIES: 0.0,
              GENERATED_TOKENS: 0.0}
    adaptive, shape, rates = False, None, {}
    crossover, saturation, names = 0.0, None, set()
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if not match:
            continue
        name = match.group(1)
        names.add(name)
        try:
            value = float(match.group(3))
        except ValueError:
            continue
        if name in totals:
            totals[name] += value
        elif name == ADAPTIVE:
            adaptive = value == 1
        elif name == CROSSOVER:
            crossover = value
        elif name == SATURATION:
            saturation = value
        elif name in (SHAPE, ACCEPTANCE_RATE):
            labels = dict(_LABEL.findall(match.group(2) or ""))
            if name == SHAPE and value == 1 and "shape" in labels:
                shape = labels["shape"]
            elif name == ACCEPTANCE_RATE and labels.get("depth", "").isdigit():
                rates[int(labels["depth"])] = value
    depths = tuple(rates[d] for d in sorted(rates))
    return EngineSample(totals[ACCEPTED_TOKENS], totals[VERIFY_STEPS], totals[TOKENS_PER_SECOND],
                        shape if adaptive else None, depths if adaptive else (),
                        totals[PREFIX_HITS], totals[PREFIX_QUERIES], crossover if adaptive else 0.0,
                        saturation, frozenset(names), totals[GENERATED_TOKENS])


class TokenRate:
    """Generated tokens per second over the last `window_s`, per pod, from its cumulative counter
    (the operator keeps one for all resources; pods are keyed by their metrics URL)."""

    def __init__(self, window_s: float = RATE_WINDOW_S):
        self.window_s = window_s
        self._seen: dict[str, list[tuple[float, float]]] = {}

    def rate(self, key: str, now_s: float, sample: EngineSample) -> float:
        seen = [(t, n) for t, n in self._seen.get(key, []) if now_s - t <= self.window_s and n <= sample.generated_tokens]
        seen.append((now_s, sample.generated_tokens))
        self._seen[key] = seen
        (t0, n0), (t1, n1) = seen[0], seen[-1]
        return (n1 - n0) / (t1 - t0) if t1 > t0 else sample.tokens_per_second

    def forget_except(self, keys: Iterable[str]) -> None:
        """Drop the pods not scraped any more."""
        keep = set(keys)
        for key in [k for k in self._seen if k not in keep]:
            del self._seen[key]


def summarize(samples: Iterable[EngineSample], rates: Iterable[float] | None = None) -> dict[str, float]:
    """The status.serving fields the samples support (none without samples or steps); `rates`:
    each pod's tokens per second over the window (TokenRate), else their throughput gauges."""
    samples = list(samples)
    if not samples:
        return {}
    steps = sum(s.verify_steps for s in samples)
    per_pod = list(rates) if rates is not None else [s.tokens_per_second for s in samples]
    result = {"tokensPerSecond": round(sum(per_pod), 1)}
    if steps > 0:
        result["meanAcceptLength"] = round(1 + sum(s.accepted_tokens for s in samples) / steps, 2)
    shapes = sorted({s.shape for s in samples if s.shape is not None})
    if shapes:
        result["speculativeShape"] = "/".join(shapes)
    queries = sum(s.prefix_queries for s in samples)
    if queries > 0:
        result["prefixCacheHitRate"] = round(sum(s.prefix_hits for s in samples) / queries, 3)
    crossovers = [s.crossover_batch for s in samples if s.crossover_batch > 0]
    if crossovers:
        result["crossoverBatchSize"] = int(min(crossovers))
    saturations = [s.saturation for s in samples if s.saturation is not None]
    if saturations:
        result["saturation"] = round(sum(saturations) / len(saturations), 3)
    rated = [s.acceptance_rates for s in samples if s.acceptance_rates]
    if rated:
        depth = min(len(r) for r in rated)
        result["acceptanceRates"] = [round(sum(r[d] for r in rated) / len(rated), 3) for d in range(depth)]
    return result


def _url_host(ip: str) -> str:
    """An IPv6 address goes in brackets in a URL (http://[fd00::1]:8000); anything else as is."""
    try:
        return f"[{ip}]" if ipaddress.ip_address(ip).version == 6 else ip
    except ValueError:
        return ip


def ready_pod_metrics_urls(pods: Iterable[dict[str, Any]]) -> list[str]:
    urls = []
    for pod in pods:
        st = pod.get("status") or {}
        ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in st.get("conditions") or [])
        if ready and st.get("podIP") and not pod["metadata"].get("deletionTimestamp"):
            urls.append(f"http://{_url_host(st['podIP'])}:{ENGINE_PORT}/metrics")
    return urls


def loading_pod_health_urls(pods: Iterable[dict[str, Any]]) -> dict[str, str]:
    """Pod name -> /health URL of each pod whose containers run but that is not ready (loading)."""
    urls = {}
    for pod in pods:
        st = pod.get("status") or {}
        ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in st.get("conditions") or [])
        running = any("running" in (c.get("state") or {}) for c in st.get("containerStatuses") or [])
        if running and not ready and st.get("podIP") and not pod["metadata"].get("deletionTimestamp"):
            urls[pod["metadata"]["name"]] = f"http://{_url_host(st['podIP'])}:{ENGINE_PORT}/health"
    return urls


def parse_loading(body: Any) -> dict[str, int] | None:
    """/health's loading figures, or None (loaded, or an answer of another shape)."""
    loading = body.get("loading") if isinstance(body, dict) else None
    if not isinstance(loading, dict):
        return None
    try:
        loaded, total = int(loading["loaded_bytes"]), int(loading["total_bytes"])
    except (KeyError, TypeError, ValueError):
        return None
    return {"loaded_bytes": loaded, "total_bytes": total} if 0 <= loaded and total > 0 else None


def http_client(timeout_s: float = SCRAPE_TIMEOUT_S) -> httpx.Client:
    """One client for a whole round of scrapes: making one builds a TLS context (the CA bundle
    read and parsed, 10-20 ms of CPU), even for the pods' plain-HTTP ports."""
    return httpx.Client(timeout=timeout_s)


@contextlib.contextmanager
def _client(client: httpx.Client | None, timeout_s: float):
    if client is not None:
        yield client
        return
    with http_client(timeout_s) as own:
        yield own


def loading_progress(urls: dict[str, str], *, timeout_s: float = SCRAPE_TIMEOUT_S,
                     client: httpx.Client | None = None) -> dict[str, dict[str, int]]:
    """Pod name -> its loading figures, of the pods that answered with them (a pod that does not
    answer is reported as loading without figures)."""
    found = {}
    with _client(client, timeout_s) as client:
        for name, url in urls.items():
            try:
                figures = parse_loading(client.get(url).json())
            except Exception:  # noqa: BLE001 - unreachable, or not JSON: no figures for this pod
                continue
            if figures is not None:
                found[name] = figures
    return found


def scrape(urls: Iterable[str], *, timeout_s: float = SCRAPE_TIMEOUT_S,
           answered: list[str] | None = None,
           client: httpx.Client | None = None) -> tuple[list[EngineSample], list[str]]:
    """(samples of the pods that answered, one error line per pod that did not); `answered`
    collects the URLs of the samples, in their order; `client`: a round's http_client()."""
    samples, errors = [], []
    with _client(client, timeout_s) as client:
        for url in urls:
            try:
                response = client.get(url)
                response.raise_for_status()
                samples.append(parse_engine_metrics(response.text))
                if answered is not None:
                    answered.append(url)
            # One pod's failure (unreachable, bad URL, garbled answer) must not end the round for
            # the others: InvalidURL and decoding errors are not HTTPErrors.
            except Exception as err:
                errors.append(f"GET {url}: {type(err).__name__}: {err}")
    return samples, errors
