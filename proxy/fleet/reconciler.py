"""The reconciler: applies membership changes to the backend registry and its lifecycle.

One owner for every change, whichever source reported it (config file, admin API, DNS,
Kubernetes): `members.Membership` says what changed, this applies it:

- join: a new record, `joining` until its health check and model list answered (no request
  goes to it before), then `serving`;
- update: the same address with other keys (role, weight, models);
- drain: no new requests; its requests finish, for up to `fleet.drain_grace_s`, then each is
  cut with a clean error (a stream gets an error event; one still waiting for its head is
  retried elsewhere); then `drained`, still listed;
- leave: a drain, then the record is removed and everything kept per backend (prefix index,
  learners, placement homes, breaker, KV-event view, doctor window, metric series) forgotten.

A source that fails keeps the last fleet it reported (members.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from proxy.config import BackendConfig, Config, DiscoveryConfig
from proxy.fleet.members import ADMIN_SOURCE, CONFIG_SOURCE, Change, Member, Membership, Source

if TYPE_CHECKING:
    from proxy.upstream.backends import Backend, BackendRegistry

log = logging.getLogger("warmroute.fleet")

CUT_WAIT_S = 5.0  # after cutting a drained backend's requests, how long they get to end
SOURCE_RESTART_S = 5.0  # a source whose task failed unexpectedly starts again after this


class Lifecycle(Protocol):
    """What the app does when a backend comes and goes (app.py composes it)."""

    def joined(self, backend: Backend) -> None:
        """A backend entered the registry (joining): per-backend resources may start."""
        ...

    async def forget(self, backend: Backend) -> None:
        """A backend left (its record is out of the registry): release everything kept for it."""
        ...

    def reset(self, name: str) -> None:
        """A new engine at a known address: what was learned of its cache is wrong now."""
        ...


class Counter(Protocol):
    def fleet_change(self, change: str, source: str) -> None: ...


class Cuttable(Protocol):
    """A request on a backend (forward.py's Exchange): cut ends it with a clean error."""

    def cut(self, code: str, reason: str) -> None: ...


class AdminError(Exception):
    """An admin request the fleet cannot apply; `status` is the HTTP status to answer with."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


class Reconciler:
    def __init__(
        self,
        config: Config,
        registry: BackendRegistry,
        lifecycle: Lifecycle,
        counter: Counter | None = None,
        make_source: Callable[[DiscoveryConfig], Source] | None = None,
    ) -> None:
        self.config = config
        self.registry = registry
        self.lifecycle = lifecycle
        self.counter = counter
        self.make_source = make_source or default_source(config)
        self.membership = Membership()
        # What the registry starts with is the config's listing: no change to apply.
        self.membership.report(CONFIG_SOURCE, [Member(b) for b in config.listed])
        self.membership.epoch = 0
        self.changed_at = -float("inf")
        self._drains: dict[str, asyncio.Task[None]] = {}
        self._sources: dict[str, tuple[DiscoveryConfig, asyncio.Task[None]]] = {}
        registry.on_serving = self._serving
        registry.on_restart = self._restarted

    # -- sources --------------------------------------------------------------------------
    async def start(self) -> None:
        self._follow(self.config.discovered)

    async def close(self) -> None:
        tasks = [t for _, t in self._sources.values()] + list(self._drains.values())
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t
        self._sources.clear()
        self._drains.clear()

    def _follow(self, discovered: Iterable[DiscoveryConfig]) -> None:
        """Run a source for each discovered fleet; stop those no longer configured (their
        members leave)."""
        wanted = {d.source: d for d in discovered}
        for name, (cfg, task) in list(self._sources.items()):
            if wanted.get(name) != cfg:
                task.cancel()
                del self._sources[name]
                self.report(name, [])
        for name, cfg in wanted.items():
            if name not in self._sources:
                task = asyncio.create_task(self._run_source(cfg), name=f"fleet source {name}")
                self._sources[name] = (cfg, task)

    async def _run_source(self, cfg: DiscoveryConfig) -> None:
        def report(members: Sequence[Member]) -> None:
            self.report(cfg.source, members)

        while True:
            try:
                source = self.make_source(cfg)
                await source.run(report)
                return
            except asyncio.CancelledError:
                raise
            except Exception:
                # A bug in a source must not stop the fleet from following it; the fleet it
                # last reported is kept meanwhile.
                log.exception("fleet source %s failed; restarting it", cfg.source)
                await asyncio.sleep(SOURCE_RESTART_S)

    # -- changes --------------------------------------------------------------------------
    def report(self, source: str, members: Sequence[Member]) -> list[Change]:
        """A source's whole current set (members.Source calls this)."""
        changes = self.membership.report(source, members)
        for c in changes:
            self._apply(c)
        return changes

    def reload(self, config: Config) -> list[Change]:
        """A re-read config file (SIGHUP): its `backends:` replace the listed and followed
        ones; everything else it says needs a restart, and is logged as such."""
        changed = _other_changes(self.config, config)
        if changed:
            log.warning(
                "config reload: %s changed; these take effect at the next restart (only "
                "`backends:` is applied while running)",
                ", ".join(changed),
            )
        self.config = self.config.model_copy(update={"backends": config.backends})
        changes = self.report(CONFIG_SOURCE, [Member(b) for b in config.listed])
        self._follow(config.discovered)
        log.info(
            "config reload: %d change(s) to the fleet (%s)",
            len(changes),
            ", ".join(f"{c.kind} {c.key}" for c in changes) or "none",
        )
        return changes

    def _apply(self, c: Change) -> None:
        self.changed_at = time.monotonic()
        b = self.registry.get(c.key)
        if c.kind == "join":
            if b is not None:  # back while it was leaving: keep the record, stop the leave
                self._stop_drain(c.key)
                b.reconfigure(c.cfg)
                b.source = c.source
                b.set_state("joining" if not b.healthy else "serving")
                log.info("backend %s is listed again by %s; kept", c.key, c.source)
            else:
                b = self.registry.add(c.cfg, c.source)
                self.lifecycle.joined(b)
                log.info(
                    "backend %s joins from %s; it gets requests once it answers its health "
                    "check and model list",
                    c.key,
                    c.source,
                )
        elif b is None:
            return
        elif c.kind == "update":
            b.reconfigure(c.cfg)
            b.source = c.source
            log.info("backend %s updated by %s (%s)", c.key, c.source, _describe(c.cfg))
        elif c.kind == "drain":
            b.set_state("draining")
            log.info("backend %s draining (%s): no new requests", c.key, c.source)
            self._start_drain(b, leave=False)
        elif c.kind == "resume":
            self._stop_drain(c.key)
            b.set_state("serving" if b.healthy else "joining")
            log.info("backend %s resumes serving (%s)", c.key, c.source)
        elif c.kind == "leave":
            b.set_state("draining")
            log.info(
                "backend %s leaves (no longer listed by %s): no new requests; %d in flight",
                c.key,
                c.source,
                len(b.streams),
            )
            self._start_drain(b, leave=True)
        if self.counter is not None and c.kind in ("join", "update", "drain", "leave"):
            self.counter.fleet_change(c.kind, c.source)

    def _start_drain(self, b: Backend, *, leave: bool) -> None:
        self._stop_drain(b.name)
        task = asyncio.create_task(self._drain(b, leave), name=f"drain {b.name}")
        self._drains[b.name] = task

    def _stop_drain(self, name: str) -> None:
        task = self._drains.pop(name, None)
        if task is not None:
            task.cancel()

    async def _drain(self, b: Backend, leave: bool) -> None:
        grace = self.config.fleet.drain_grace_s
        started = time.monotonic()
        try:
            await asyncio.wait_for(b.idle(), grace)
        except TimeoutError:
            open_now = list(b.streams)
            log.warning(
                "backend %s: %d request(s) still open after the %gs drain grace; cutting them",
                b.name,
                len(open_now),
                grace,
            )
            why = f"backend {b.name} left the fleet; the request was cut after the drain grace"
            for request in open_now:
                request.cut("backend_drained", why)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(b.idle(), CUT_WAIT_S)
        took = time.monotonic() - started
        self._drains.pop(b.name, None)
        self.changed_at = time.monotonic()
        if not leave:
            b.set_state("drained")
            log.info("backend %s drained in %.1fs", b.name, took)
            return
        self.registry.remove(b.name)
        await self.lifecycle.forget(b)
        log.info(
            "backend %s left the fleet (drained in %.1fs); its state is forgotten", b.name, took
        )

    def _serving(self, b: Backend) -> None:
        self.changed_at = time.monotonic()
        log.info(
            "backend %s joined (%s): serving %s",
            b.name,
            b.source,
            ", ".join(sorted(b.models or ())) or "the models it is asked for",
        )

    def _restarted(self, b: Backend, why: str) -> None:
        """Same address, new engine: treat its cache as cold."""
        self.changed_at = time.monotonic()
        log.warning("backend %s restarted (%s): its cache is cold; forgetting it", b.name, why)
        self.lifecycle.reset(b.name)
        if self.counter is not None:
            self.counter.fleet_change("restart", b.source)

    # -- the admin's verbs ------------------------------------------------------------------
    def admin_add(self, cfg: BackendConfig) -> Change | None:
        source = self.membership.source_of(cfg.key)
        if source is not None and source != ADMIN_SOURCE:
            raise AdminError(409, f"backend {cfg.key} is already listed by {source}")
        kept = [m for m in self.membership.reported(ADMIN_SOURCE) if m.key != cfg.key]
        changes = self.report(ADMIN_SOURCE, [*kept, Member(cfg)])
        return changes[0] if changes else None

    def admin_remove(self, key: str) -> None:
        source = self.membership.source_of(key)
        if source is None:
            raise AdminError(404, f"no backend {key!r} in the fleet")
        if source != ADMIN_SOURCE:
            raise AdminError(
                409,
                f"backend {key} is listed by {source}: remove it there (or drain it here, "
                "which holds until resumed)",
            )
        kept = [m for m in self.membership.reported(ADMIN_SOURCE) if m.key != key]
        self.report(ADMIN_SOURCE, kept)

    def admin_drain(self, key: str) -> None:
        if self.membership.source_of(key) is None:
            raise AdminError(404, f"no backend {key!r} in the fleet")
        for c in self.membership.drain(key):
            self._apply(c)

    def admin_resume(self, key: str) -> None:
        if self.membership.source_of(key) is None:
            raise AdminError(404, f"no backend {key!r} in the fleet")
        for c in self.membership.resume(key):
            self._apply(c)

    # -- what requests and views read -------------------------------------------------------
    def changing(self, now: float) -> bool:
        """Whether a request routed now is routed during a membership change: one happened
        (a join, a leave, a restart, a joiner's first answer) within fleet.change_window_s,
        or a drain is under way. O(1): asked for every request."""
        return now - self.changed_at < self.config.fleet.change_window_s or bool(self._drains)

    @property
    def epoch(self) -> int:
        return self.membership.epoch

    def info(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "sources": [CONFIG_SOURCE, *self._sources, ADMIN_SOURCE],
            "admin_drained": sorted(self.membership.held_drained),
            "draining": sorted(self._drains),
        }


def default_source(config: Config) -> Callable[[DiscoveryConfig], Source]:
    """DNS or Kubernetes, by the entry's key (each imported only when used)."""

    def make(cfg: DiscoveryConfig) -> Source:
        if cfg.dns is not None:
            from proxy.fleet.dns import DnsSource

            return DnsSource(cfg, config.fleet.nameservers)
        from proxy.fleet.kube import KubernetesSource

        return KubernetesSource(cfg)

    return make


def _describe(cfg: BackendConfig) -> str:
    return f"engine {cfg.engine}, role {cfg.role}, weight {cfg.weight:g}"


def _other_changes(old: Config, new: Config) -> list[str]:
    """The top-level keys besides `backends` that differ between two configs."""
    return [
        name
        for name in type(old).model_fields
        if name != "backends" and getattr(old, name) != getattr(new, name)
    ]
