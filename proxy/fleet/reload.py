"""Re-reading the config file while running: on SIGHUP, and when `fleet.watch_config_s` is set,
whenever the file's content changes (a Kubernetes ConfigMap update, an edit).

The new file is validated exactly as at start (the same errors, naming the key and the fix);
an invalid one is refused with that error in the log and the running fleet is kept. Only
`backends:` is applied (proxy/fleet/reconciler.py says which other keys changed and need a
restart).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import signal
from collections.abc import Callable
from pathlib import Path

from proxy.config import Config, ConfigError

log = logging.getLogger("warmroute.fleet")


class ConfigReloader:
    def __init__(
        self,
        load: Callable[[], Config],
        apply: Callable[[Config], object],
        path: str | None = None,
        watch_s: float = 0.0,
    ) -> None:
        self.load = load  # the file, the environment and the flags, validated as at start
        self.apply = apply
        self.path = Path(path) if path else None
        self.watch_s = watch_s
        self.reloads = 0  # applied
        self.refused = 0  # invalid files turned down
        self._digest = self._read_digest()
        self._task: asyncio.Task[None] | None = None
        self._busy = asyncio.Lock()
        self._signal = False

    def _read_digest(self) -> bytes | None:
        if self.path is None:
            return None
        try:
            return hashlib.sha256(self.path.read_bytes()).digest()
        except OSError:
            return None

    async def reload(self, why: str) -> bool:
        """Read, validate and apply the config; False when it was refused."""
        async with self._busy:
            self._digest = self._read_digest()
            try:
                config = await asyncio.to_thread(self.load)
            except ConfigError as e:
                self.refused += 1
                log.error("config reload (%s) refused; the running fleet is kept: %s", why, e)
                return False
            log.info("config reload (%s)", why)
            self.apply(config)
            self.reloads += 1
            return True

    def install_signal(self) -> bool:
        """SIGHUP reloads (the main thread's loop only, as `warmroute serve` runs it)."""
        loop = asyncio.get_running_loop()
        try:
            loop.add_signal_handler(signal.SIGHUP, self._on_signal)
        except (RuntimeError, ValueError, NotImplementedError):
            return False
        self._signal = True
        return True

    def _on_signal(self) -> None:
        task = asyncio.get_running_loop().create_task(self.reload("SIGHUP"))
        task.add_done_callback(_log_failure)

    async def start(self) -> None:
        if self.path is not None and self.watch_s > 0:
            self._task = asyncio.create_task(self._watch(), name="config watch")

    async def close(self) -> None:
        if self._signal:
            with contextlib.suppress(Exception):
                asyncio.get_running_loop().remove_signal_handler(signal.SIGHUP)
            self._signal = False
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _watch(self) -> None:
        """Content, not mtime: a ConfigMap volume swaps a symlink, and editors rename."""
        while True:
            await asyncio.sleep(self.watch_s)
            digest = await asyncio.to_thread(self._read_digest)
            if digest is not None and digest != self._digest:
                await self.reload(f"{self.path} changed")


def _log_failure(task: asyncio.Task[bool]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("config reload failed", exc_info=task.exception())
