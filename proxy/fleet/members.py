"""The fleet's vocabulary and its pure core: what sources report, and the changes it means.

Every source of membership (the config file, the admin API, DNS, Kubernetes EndpointSlices)
reports its *whole* current set of engines each time it learns something (level-triggered, as
a Kubernetes controller reconciles): the diff against what it reported before is computed here,
never by the source. A source that cannot tell (a resolver timeout, an API server away) reports
nothing, so the fleet keeps what it last knew: a control-plane blip must never empty the fleet.

Pure: no I/O, no clock. `Membership.report()` takes a source's set and returns the changes to
apply; the shell (proxy/fleet/reconciler.py) applies them to the registry.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

from proxy.config import BackendConfig

# join: a new engine; update: the same address with other keys (role, weight, models...);
# drain: still listed but to get no new requests (Kubernetes: terminating; the admin's drain);
# resume: serving again after a drain; leave: no source lists it any more.
ChangeKind = Literal["join", "update", "drain", "resume", "leave"]

CONFIG_SOURCE = "config"  # backends: entries with a url, re-read on SIGHUP
ADMIN_SOURCE = "admin"  # POST /admin/backends


@dataclass(frozen=True, slots=True)
class Member:
    """One engine as a source reports it."""

    cfg: BackendConfig
    serving: bool = True  # False: still there but leaving (Kubernetes `serving`, not `ready`)

    @property
    def key(self) -> str:
        return self.cfg.key


Report = Callable[[Sequence[Member]], None]  # a source's whole current set


class Source(Protocol):
    """A source of membership: runs until cancelled, calling `report` with its whole set each
    time it learns it; a failure is logged (once, and once when it recovers) and reported as
    nothing, so the fleet keeps the last set it knew."""

    name: str

    async def run(self, report: Report) -> None: ...


@dataclass(frozen=True, slots=True)
class Change:
    kind: ChangeKind
    key: str
    source: str
    cfg: BackendConfig


@dataclass(slots=True)
class _Held:
    source: str
    member: Member
    serving: bool = True  # as last settled (the member's word, and no admin drain)


class Membership:
    """Who is in the fleet, merged from every source's last report.

    An address listed by two sources belongs to the first that listed it (the other's entry is
    shadowed, and takes over if the first drops it). An admin drain holds whatever the sources
    say until the admin resumes it."""

    def __init__(self) -> None:
        self._reports: dict[str, dict[str, Member]] = {}  # source -> key -> member
        self._owner: dict[str, _Held] = {}  # key -> the source it belongs to, and its member
        self.held_drained: set[str] = set()  # drained by the admin
        self.epoch = 0  # bumped by every change: spans carry it

    def members(self) -> dict[str, tuple[str, Member]]:
        return {k: (h.source, h.member) for k, h in self._owner.items()}

    def source_of(self, key: str) -> str | None:
        held = self._owner.get(key)
        return None if held is None else held.source

    def reported(self, source: str) -> Sequence[Member]:
        return list(self._reports.get(source, {}).values())

    def report(self, source: str, members: Iterable[Member]) -> list[Change]:
        """`source` now lists exactly `members`: the changes that makes to the fleet."""
        new: dict[str, Member] = {}
        for m in members:
            new.setdefault(m.key, m)  # a source listing an address twice: its first entry
        self._reports[source] = new
        return self._settle()

    def drain(self, key: str) -> list[Change]:
        """The admin's drain: no new requests until resume(), whatever the sources say."""
        if key not in self._owner:
            return []
        self.held_drained.add(key)
        return self._settle()

    def resume(self, key: str) -> list[Change]:
        self.held_drained.discard(key)
        return self._settle()

    def _serving(self, key: str, m: Member) -> bool:
        return m.serving and key not in self.held_drained

    def _settle(self) -> list[Change]:
        wanted: dict[str, _Held] = {}
        for source, listed in self._reports.items():  # in the order sources first reported
            for key, m in listed.items():
                wanted.setdefault(key, _Held(source, m))
        changes: list[Change] = []
        for key, was in list(self._owner.items()):
            now = wanted.get(key)
            if now is None:
                del self._owner[key]
                self.held_drained.discard(key)
                changes.append(Change("leave", key, was.source, was.member.cfg))
                continue
            if now.member.cfg != was.member.cfg or now.source != was.source:
                changes.append(Change("update", key, now.source, now.member.cfg))
            now.serving = self._serving(key, now.member)
            if now.serving != was.serving:
                kind: ChangeKind = "resume" if now.serving else "drain"
                changes.append(Change(kind, key, now.source, now.member.cfg))
            self._owner[key] = now
        for key, now in wanted.items():
            if key not in self._owner:
                now.serving = self._serving(key, now.member)
                self._owner[key] = now
                changes.append(Change("join", key, now.source, now.member.cfg))
                if not now.serving:
                    changes.append(Change("drain", key, now.source, now.member.cfg))
        if changes:
            self.epoch += 1
        return changes

    def serving(self, key: str) -> bool:
        held = self._owner.get(key)
        return held is not None and held.serving
