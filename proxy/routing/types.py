"""The small vocabulary every routing plugin shares (the plugin contract).

A policy is a pipeline: filters narrow the candidates, scorers give each survivor a score in
[0, 1], and a picker orders the survivors (first = winner, the rest = retry order). Scorers and
pickers are pure: every input they need (load, prefix matches, time) is in the context.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Protocol, Self, TypeVar, runtime_checkable

from pydantic import BaseModel, ConfigDict


class PluginSettings(BaseModel):
    """A plugin's config block (`routing.plugins.<name>`), typed: each plugin declares its
    keys as a subclass named `Settings`, with their types and defaults. `warmroute serve
    --check` and startup check every block against them and report a misspelt key as they do
    any other (proxy.routing.setup.block_settings composes a block read by several parts)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    @classmethod
    def of(cls, block: Mapping[str, Any] | None) -> Self:
        """This plugin's settings from its block. Keys of the other parts that read the same
        block are left to them (the `prefix` block is the scorer's, the hasher's and the
        index's): the config check, not each part, reports a key no part reads."""
        fields = cls.model_fields
        return cls.model_validate({k: v for k, v in (block or {}).items() if k in fields})


class PromptUnreadable(ValueError):
    """Routing could not read the request's prompt (rendering, hashing, its token ids): the
    client's request is at fault, and gets a 400 that says what could not be read. Any other
    error in a decision is the router's own (Router.route falls back, and logs it)."""


class Verdict(StrEnum):
    """Why a filter set a backend aside. What is decided from a drop — a 429 when every
    backend is at its in-flight bound rather than a 503, the P/D flows taking back the
    backends only the role filter set aside — tests the verdict, never the reason's text."""

    AT_BOUND = "at_bound"  # at its configured in-flight bound: overload, not an outage
    UNHEALTHY = "unhealthy"
    ROLE = "role"  # a prefill- or decode-role backend kept from whole requests
    MODEL = "model"  # does not serve the requested model


class Dropped(str):
    """A filter's reason for setting a backend aside: the text operators read (explain, the
    span) and its verdict. A plain string from a third-party filter has no verdict."""

    verdict: Verdict

    def __new__(cls, verdict: Verdict, text: str) -> Dropped:
        self = super().__new__(cls, text)
        self.verdict = verdict
        return self

    def __reduce__(self) -> tuple[Any, ...]:
        return (Dropped, (self.verdict, str(self)))


def verdict_of(reason: str) -> Verdict | None:
    """The verdict behind a filter's reason (None: a filter that gave text alone)."""
    return reason.verdict if isinstance(reason, Dropped) else None


@dataclass(slots=True)
class EngineLoad:
    """Load signals scraped from an engine's own /metrics (None = unknown)."""

    waiting: float | None = None  # queued requests (vllm:num_requests_waiting ...)
    running: float | None = None  # running requests
    kv_usage: float | None = None  # 0..1 KV-cache usage
    kv_tokens: int | None = None  # KV pool size in tokens (vllm:cache_config_info)
    scraped_at: float = 0.0  # monotonic time of the scrape
    # Cumulative engine counters by short name (queue/prefill time sums and counts, prefix
    # cache queries and hits, preemptions): read by the doctor, not by routing.
    counters: Mapping[str, float] = field(default_factory=dict)


@dataclass(slots=True, eq=False)
class BackendView:
    """What routing may know about one backend at decision time (a read-only snapshot).

    Compared by identity: pickers test membership (`b in holders`) on lists of the same
    views, and a field-by-field __eq__ made that the single largest cost of a pick.
    """

    name: str
    url: str
    engine: str
    role: str
    weight: float
    healthy: bool
    inflight: int  # requests this proxy (and, with Redis, its peers) has open on it
    load: EngineLoad
    models: frozenset[str] | None  # None = not discovered yet
    prefill_tokens_per_s: float | None = None  # learned online from measured TTFT
    backlog_tokens: float = 0.0  # prompt tokens sent here, likely still being prefilled
    mean_prefill_s: float | None = None  # typical prefill of one request here (queue -> seconds)
    max_inflight: int | None = None  # its configured in-flight bound

    def serves(self, model: str) -> bool:
        return self.models is None or model in self.models


_T = TypeVar("_T")


class Epoch:
    """One state of what a fleet's views say that rarely changes: every view's name, weight,
    role, models, health and in-flight bound, in fleet order. `memo` holds what filters and the
    router derive from those alone (Views.fleetwide); a new Epoch starts empty."""

    __slots__ = ("memo",)

    def __init__(self) -> None:
        self.memo: dict[str, Any] = {}


class Views(list[BackendView]):
    """Every routable backend's view at one read, with what a decision reads of the whole fleet
    made ready by whoever read it (proxy.routing.views keeps these current in time proportional
    to the views that changed, not to the fleet). A snapshot: nothing here changes after the
    read, so a decision that waits (a Redis lookup) still reads one consistent fleet.

    `epoch` is the same object from one read to the next while no view's stable facts changed;
    `inflight` each view's in-flight count in order, `inflight_total` their sum,
    `inflight_least` the smallest, `inflight_counts` how many views have each count;
    `waiting_most` the longest queue an engine reported (unknown read as 0).

    A filter that drops nothing returns the list it was handed, so these still describe the
    candidates after it; one that drops a backend returns a plain list, and what follows reads
    the candidates themselves, as for any list.
    """

    epoch: Epoch
    inflight: list[int]
    inflight_total: int
    inflight_least: int
    inflight_counts: Mapping[int, int]
    waiting_most: float

    def fleetwide(self, key: str, derive: Callable[[Sequence[BackendView]], _T]) -> _T:
        """`derive(self)`, computed once per epoch: `derive` must read only the stable facts
        (name, weight, role, models, healthy, max_inflight), and `key` name what it derives."""
        memo = self.epoch.memo
        try:
            value: _T = memo[key]
        except KeyError:
            value = memo[key] = derive(self)
        return value


class Changes:
    """The backends whose view may have changed since its reader last took them: each source
    of what a view shows (the registry's backends, the in-flight board, the prefill learner)
    marks the names it changes, and the one reader (the proxy's ViewCache) takes them per
    read instead of comparing every backend's state. `mark_all` says the fleet itself
    changed (a backend joined, left or changed state): the reader reads it whole. Unread,
    the names are a set of the fleet's, bounded by it."""

    __slots__ = ("epoch", "everything", "names")

    def __init__(self) -> None:
        self.names: set[str] = set()
        self.everything = True  # (the first read is whole)
        self.epoch = 0  # bumps at each mark_all: a membership cache's key

    def mark(self, name: str) -> None:
        self.names.add(name)

    def mark_all(self) -> None:
        self.everything = True
        self.epoch += 1

    def take(self) -> set[str] | None:
        """The names marked since the last take, or None: read everything."""
        names, self.names = self.names, set()
        if self.everything:
            self.everything = False
            return None
        return names


_MODEL_LISTS: dict[frozenset[str], frozenset[str]] = {}
MODEL_LISTS_KEPT = 1024  # distinct model lists remembered (a fleet serves a few)


def one_copy(models: frozenset[str]) -> frozenset[str]:
    """The one object for this model list, whichever backend reported it: a fleet serves a
    few lists, and the model filter decides once per distinct object instead of once per
    backend (comparing equal sets held apart costs a set comparison each)."""
    found = _MODEL_LISTS.get(models)
    if found is None:
        if len(_MODEL_LISTS) >= MODEL_LISTS_KEPT:
            _MODEL_LISTS.clear()  # (engines making up lists: no more than a cold cache)
        found = _MODEL_LISTS[models] = models
    return found


@dataclass(slots=True)
class RouteContext:
    """What a routing decision is made from: the request's facts, and the prefix facts the
    router works out from them for the plugins (only the router writes those, during the
    decision). What the request path needs afterwards is in the Decision."""

    request_id: str
    model: str
    api: str  # "chat" | "completions" | "embeddings" | "responses"
    body: Mapping[str, Any]
    headers: Mapping[str, str]
    now: float
    session_key: str | None = None
    prompt_chars: int = 0
    # A tenant within its share while another's prompts over their share are being
    # prefilled (tenants.reserve_prefills): a cold prompt goes where its prefill starts soonest.
    quiet: bool = False
    # Filled by the router before scoring when a policy uses prefix matching (prompt_chars too):
    prefix_blocks: Sequence[int] = ()
    prefix_share: float = 0.0  # share of recent requests that began with this prompt's head
    block_chars: int = 64
    matched_blocks: dict[str, int] = field(default_factory=dict)  # backend name -> blocks
    token_keyed: bool = False  # prefix_blocks are blocks of token ids (comparable to KV events)
    # Backends whose match came from the engine's own KV events, not the learned index:
    exact: frozenset[str] = frozenset()
    # Of those, the ones holding more of the prompt in slower tiers than on the GPU: backend ->
    # {"CPU" | "DISK" | "REMOTE": leading blocks each on the GPU or in that tier or a faster
    # one}. A hit there is loaded, not recomputed: cheaper than a cold prefill, dearer than
    # the GPU (matched_blocks stays the GPU depth; the predicted-TTFT scorer prices the rest).
    tier_blocks: dict[str, dict[str, int]] = field(default_factory=dict)
    # Filled by the router when the picker follows the placement (proxy.routing.placement):
    homes: tuple[str, ...] = ()  # the backends this prompt's prefix is assigned to
    head: int | None = None  # the block that keys its prompt head (popularity, placement)
    full: frozenset[str] = frozenset()  # backends whose learned cache has no room for it
    shared_blocks: float = 0.0  # blocks its prefix's requests share (more: its own history)


@dataclass(frozen=True, slots=True)
class Recorded:
    """Where a request's prefix was recorded, and how the index stood there then: what the
    capacity learner checks the engine's own cached_tokens against once it answers."""

    backend: str
    age_s: float | None  # since the matched prefix was last recorded there (None: never)
    ghost_blocks: int  # leading blocks the index held or had trimmed on that backend


class Scores(Mapping[str, float]):
    """A decision's scorer results, computed the first time anything reads them.

    As a mapping it is the weighted total per backend (what a picker orders by). A picker that
    decides by prefix copies, load or hashing alone never reads it, and then no scorer runs
    before the request is on its way; the span and /admin/route/explain read the scores later.
    They get the values the picker would have seen: scorers are pure, and the context and
    the backend views are the decision's own snapshot.
    """

    __slots__ = ("_by_backend", "_candidates", "_ctx", "_scorers", "_totals")

    def __init__(
        self,
        scorers: Sequence[tuple[Scorer, float]],
        ctx: RouteContext,
        candidates: Sequence[BackendView],
    ) -> None:
        self._scorers = scorers
        self._ctx = ctx
        self._candidates = candidates
        self._totals: dict[str, float] | None = None
        self._by_backend: dict[str, dict[str, float]] = {}

    def _compute(self) -> dict[str, float]:
        by_backend: dict[str, dict[str, float]] = {b.name: {} for b in self._candidates}
        totals = dict.fromkeys(by_backend, 0.0)
        for scorer, weight in self._scorers:
            for name, value in scorer.score(self._ctx, list(self._candidates)).items():
                by_backend[name][scorer.name] = value
                totals[name] += weight * value
        self._by_backend = by_backend
        self._totals = totals
        self._ctx = self._candidates = None  # type: ignore[assignment]  # done with them
        return totals

    @property
    def computed(self) -> bool:
        """Whether the scorers have run (the picker, the span or explain read the scores)."""
        return self._totals is not None

    @property
    def totals(self) -> dict[str, float]:
        return self._totals if self._totals is not None else self._compute()

    @property
    def by_backend(self) -> dict[str, dict[str, float]]:
        """backend -> scorer -> score."""
        if self._totals is None:
            self._compute()
        return self._by_backend

    def get(self, name: str, default: Any = None) -> Any:
        return self.totals.get(name, default)

    def __getitem__(self, name: str) -> float:
        return self.totals[name]

    def __contains__(self, name: object) -> bool:
        return name in self.totals

    def __iter__(self) -> Iterator[str]:
        return iter(self.totals)

    def __len__(self) -> int:
        return len(self.totals)


class ScoresByBackend(Mapping[str, Mapping[str, float]]):
    """Scores.by_backend as a mapping that computes on first read (Decision.scores)."""

    __slots__ = ("_scores",)

    def __init__(self, scores: Scores) -> None:
        self._scores = scores

    def __getitem__(self, name: str) -> Mapping[str, float]:
        return self._scores.by_backend[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._scores.by_backend)

    def __len__(self) -> int:
        return len(self._scores.by_backend)


@dataclass(slots=True)
class Decision:
    """The outcome of one routing decision, kept for spans, headers and /admin explain.

    `scores` (backend -> scorer -> score) and `totals` may be lazy mappings (Scores): read
    them like dicts; as_dict() gives plain ones.
    """

    policy: str
    ranking: list[str]  # backend names, best first
    reason: str
    scores: Mapping[str, Mapping[str, float]] = field(default_factory=dict)
    totals: Mapping[str, float] = field(default_factory=dict)
    matched_blocks: dict[str, int] = field(default_factory=dict)
    prefix_blocks: int = 0
    block_chars: int = 64  # matched_blocks * block_chars ≈ predicted cached prompt chars
    prompt_chars: int = 0
    filtered_out: dict[str, str] = field(default_factory=dict)  # backend -> why
    decision_s: float = 0.0
    exact: frozenset[str] = frozenset()  # matches read from the engines' KV events
    blocks: Sequence[int] = ()  # the prompt's block chain (recorded where the request goes)
    recorded: Recorded | None = None  # where its prefix was recorded (Router.record)
    # (backend, uncached tokens) added to that backend's prefill backlog, until the request ends
    backlogged: tuple[str, float] | None = None

    def match_source(self, backend: str | None = None) -> str:
        """Where `backend`'s (default: the winner's) match came from: the engine's own KV
        events ("kv_events") or the learned prefix index ("index")."""
        name = backend or self.winner
        return "kv_events" if name in self.exact else "index"

    @property
    def winner(self) -> str | None:
        return self.ranking[0] if self.ranking else None

    def scored(self) -> bool:
        """Whether the scores are at hand: plain mappings, or lazy ones the picker read.

        A span records scores only then: running the scorers just to describe a decision that
        did not use them would cost every traced request the work the lazy scores save.
        """
        totals = self.totals
        return not isinstance(totals, Scores) or totals.computed

    def predicted_cached_chars(self, backend: str | None = None) -> int:
        """Prompt chars the index expects `backend` (default: the winner) to have cached."""
        name = backend or self.winner
        return self.matched_blocks.get(name, 0) * self.block_chars if name else 0

    def as_dict(self) -> dict[str, Any]:
        return {
            "policy": self.policy,
            "winner": self.winner,
            "ranking": self.ranking,
            "reason": self.reason,
            "scores": {name: dict(by) for name, by in self.scores.items()},
            "totals": dict(self.totals),
            "matched_blocks": self.matched_blocks,
            "prefix_blocks": self.prefix_blocks,
            "block_chars": self.block_chars,
            "prompt_chars": self.prompt_chars,
            "filtered_out": self.filtered_out,
            "match_source": {name: self.match_source(name) for name in self.matched_blocks},
            "decision_ms": round(self.decision_s * 1000, 4),
        }


@runtime_checkable
class Filter(Protocol):
    name: str

    def filter(
        self, ctx: RouteContext, candidates: list[BackendView], dropped: dict[str, str]
    ) -> list[BackendView]:
        """Return the candidates that may serve ctx; note each dropped one and why (a
        `Dropped`, whose verdict the proxy acts on; a plain string is shown, not acted on)."""
        ...


@runtime_checkable
class Scorer(Protocol):
    name: str

    def score(self, ctx: RouteContext, candidates: list[BackendView]) -> dict[str, float]:
        """Score each candidate in [0, 1] (higher is better), keyed by backend name."""
        ...


@runtime_checkable
class Picker(Protocol):
    name: str

    def pick(
        self, ctx: RouteContext, candidates: list[BackendView], totals: Mapping[str, float]
    ) -> tuple[list[str], str]:
        """Order candidates best first and say why the winner won.

        `totals` (weighted scores per backend) is computed on first read: a picker that
        does not need it should not touch it.
        """
        ...


@dataclass
class Policy:
    """A named composition: filters, weighted scorers and a picker."""

    name: str
    filters: list[Filter]
    scorers: list[tuple[Scorer, float]]
    picker: Picker
    uses_prefix: bool = False  # the router hashes the prompt and looks the index up first
    hints: PickerHints = field(default_factory=lambda: PickerHints())


@dataclass(frozen=True, slots=True)
class PickerHints:
    """What a policy's picker asks of the router around it. The defaults ask nothing: a
    third-party picker need not know of them.

    affinity_blocks: the prompt head whose popularity counts (and keys its rendezvous order);
    warm_blocks: the shortest prompt worth stickiness; placement: the settings of the
    placement that gives hot prefixes homes (proxy.routing.placement.Placement; None: none);
    shares_placement: with Redis, replicas exchange homes and learned capacities;
    load_bound: (epsilon, slack, choices) of the picker's load bound, when the router may hand
    it a shortlist drawn by its rules (proxy.routing.shortlist; None: every candidate)."""

    affinity_blocks: int = 8
    warm_blocks: int = 4
    placement: Mapping[str, Any] | None = None
    shares_placement: bool = True
    load_bound: tuple[float, int, int] | None = None
