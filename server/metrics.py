"""Prometheus metrics (prometheus-client), one registry per app: GET /metrics.

Request-level counters and histograms are recorded per finished request, and every refused or failed request
is counted by route, status and error code; cache sizes and eviction counters are read from the cache's own
stats at scrape time (a custom collector), so they never drift: entries, bytes and budget per tier come from
each tier's own `stats()`.
"""

from __future__ import annotations

from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from orchestrator.cache.snapshots import CacheStats
from orchestrator.request import Result
from orchestrator.reuse import AfterGenerationStats

_SECONDS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class _CacheCollector:
    def __init__(self, stats: Callable[[], CacheStats]) -> None:
        self.stats = stats

    def collect(self):
        s = self.stats()
        tiers = {t.name: t for t in s.tiers}
        names = ["ram", "disk"] + [n for n in tiers if n not in ("ram", "disk")]  # a missing tier reads 0
        for name, doc, value in (("entries", "Snapshot entries held, per tier", lambda t: t.entries),
                                 ("bytes", "Snapshot bytes held, per tier", lambda t: t.bytes),
                                 ("budget_bytes", "Snapshot byte budget, per tier", lambda t: t.budget_bytes)):
            family = GaugeMetricFamily(f"orchestrator_cache_{name}", doc, labels=["tier"])
            for tier in names:
                family.add_metric([tier], value(tiers[tier]) if tier in tiers else 0)
            yield family
        for name, value, doc in (
                ("evictions", s.evictions, "Entries that left the RAM tier"),
                ("spills", s.spills, "Evicted entries written to the disk tier"),
                ("promotions", s.promotions, "Disk-tier hits copied back to RAM"),
                ("dropped", s.dropped, "Entries lost (no room on disk, or corrupt)"),
                ("inserts", s.inserts, "Entries stored"),
                ("shared_found", s.shared_found, "Entries a shared tier listed beyond what this replica held"),
                ("shared_skipped", s.shared_skipped, "Restores from a shared tier not taken: recomputing was "
                                                     "faster than fetching (both measured)")):
            c = CounterMetricFamily(f"orchestrator_cache_{name}", doc)
            c.add_metric([], value)
            yield c
        for name, doc, value in (
                ("hits", "Entries read from a lower tier", lambda t: t.hits),
                ("misses", "Reads of a lower tier that found nothing usable", lambda t: t.misses),
                ("writes", "Entries written to a lower tier", lambda t: t.inserts),
                ("invalid", "Entries found corrupt or of another model, deleted", lambda t: t.rejected_invalid),
                ("errors", "Operations of a tier that failed (connection, timeout, refused), served as misses",
                 lambda t: t.errors),
                ("dropped_writes", "Writes not made: write-behind queue full, or the tier unreachable",
                 lambda t: t.dropped)):
            c = CounterMetricFamily(f"orchestrator_cache_tier_{name}", doc, labels=["tier"])
            for t in s.tiers[1:]:
                c.add_metric([t.name], value(t))
            yield c
        up = GaugeMetricFamily("orchestrator_cache_tier_up", "1 while a lower tier takes writes (0: disabled "
                               "after a failure, or unreachable and reconnecting)", labels=["tier"])
        for t in s.tiers[1:]:
            up.add_metric([t.name], 0 if t.disabled else 1)
        yield up


class _AfterGenerationCollector:
    """The after-generation counters of the reuse rules (`AfterGenerationStats`), read at scrape time."""

    def __init__(self, stats: Callable[[], AfterGenerationStats]) -> None:
        self.stats = stats

    def collect(self):
        s = self.stats()
        outcome = CounterMetricFamily("orchestrator_after_generation", "Finished requests by what was done after "
                                      "generation: answer (state after the answer stored), prompt_end, "
                                      "unrestorable (the next request would not restore the answer's state)",
                                      labels=["outcome"])
        for name in ("answer", "prompt_end", "unrestorable"):
            outcome.add_metric([name], getattr(s, name))
        yield outcome
        for name, value, doc in (
                ("preempted", s.preempted, "After-generation re-prefills dropped for a waiting request"),
                ("taken_over", s.taken_over, "After-generation re-prefills continued by the request extending them"),
                ("answer_repeat", s.answer_repeat, "After-generation re-prefills that also stored a checkpoint "
                 "min_segment before the answer's end, for a next request that adds fewer tokens"),
                ("tokens", s.tokens, "Tokens re-prefilled after generation"),
                ("seconds", s.seconds, "Worker seconds spent re-prefilling after generation")):
            c = CounterMetricFamily(f"orchestrator_after_generation_{name}", doc)
            c.add_metric([], value)
            yield c


class Metrics:
    """Counters and histograms of one server."""

    def __init__(self, cache_stats: Callable[[], CacheStats],
                 after_stats: Callable[[], AfterGenerationStats] | None = None) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.prompt_tokens = Counter("orchestrator_prompt_tokens", "Prompt tokens received", registry=r)
        self.cached_tokens = Counter("orchestrator_cached_tokens", "Prompt tokens restored instead of computed",
                                     registry=r)
        self.requests = Counter("orchestrator_requests", "Finished requests by where their prefix came from "
                                "(live, ram, disk, remote; none = miss)", ["cache_tier"], registry=r)
        self.restore = Histogram("orchestrator_restore_seconds", "Time to restore a snapshot", buckets=_SECONDS,
                                 registry=r)
        self.prefill = Histogram("orchestrator_prefill_seconds", "Time to prefill the uncached part of a prompt",
                                 buckets=_SECONDS, registry=r)
        self.ttft = Histogram("orchestrator_ttft_seconds", "Time to first token", buckets=_SECONDS, registry=r)
        self.phase = Histogram("orchestrator_request_phase_seconds", "Where a request's time went, by phase: "
                               "render, tokenize, boundaries (building the prompt), queue, restore, prefill "
                               "(snapshot saves excluded), snapshot, sample (first token), decode", ["phase"],
                               buckets=_SECONDS, registry=r)
        self.drafted_tokens = Counter("orchestrator_drafted_tokens", "Speculative decoding: drafted tokens "
                                      "verified (all choices)", registry=r)
        self.accepted_tokens = Counter("orchestrator_accepted_tokens", "Speculative decoding: drafted tokens "
                                       "accepted (sampled equal to the draft)", registry=r)
        self.errors = Counter("orchestrator_request_errors", "Requests refused or failed, by route, HTTP status "
                              "(499: the client disconnected) and error code", ["route", "status", "code"],
                              registry=r)
        r.register(_CacheCollector(cache_stats))
        if after_stats is not None:
            r.register(_AfterGenerationCollector(after_stats))

    def observe(self, r: Result, drafted: int = 0, accepted: int = 0) -> None:
        """A served request: choice 0's result `r`; `drafted`/`accepted`: speculative tokens of all its choices."""
        self.drafted_tokens.inc(drafted)
        self.accepted_tokens.inc(accepted)
        self.prompt_tokens.inc(r.prompt_tokens)
        self.cached_tokens.inc(r.cached_tokens)
        self.requests.labels(r.restore_source).inc()
        if r.cached_tokens:
            self.restore.observe(r.restore_s)
        self.prefill.observe(r.prefill_s)
        self.ttft.observe(r.ttft_s)
        for name, seconds in r.phases.items():
            self.phase.labels(name).observe(max(0.0, seconds))

    def failed(self, route: str, status: int, code: str) -> None:
        self.errors.labels(route, str(status), code).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
