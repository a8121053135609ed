"""Log each reason once per process: hooks run on every call, and their fall-backs must not flood the log."""
from __future__ import annotations

import logging


class OnceLog:
    """``note(reason)`` logs ``prefix + reason`` the first time that reason is seen; ``clear()`` forgets."""

    def __init__(self, logger: logging.Logger, prefix: str):
        self.logger, self.prefix = logger, prefix
        self.seen: set[str] = set()

    def __call__(self, reason: str) -> None:
        if reason not in self.seen:
            self.seen.add(reason)
            self.logger.info("%s%s", self.prefix, reason)

    def clear(self) -> None:
        self.seen.clear()
