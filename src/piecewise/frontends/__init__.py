"""Front-ends: how a forward becomes pieces the back half (``piecewise.capture``) captures and replays.

A front-end is built at the runner's first call from ``Parts`` (what it is given of the runtime) and meets
``Frontend`` (``base.py``); the registry maps each name of ``config.FRONTENDS`` but ``"auto"`` to its class. The
runtime never asks which front-end it has: what differs between them is in the interface.
"""

from __future__ import annotations

from typing import Any

from . import breakable, dynamo  # noqa: F401 - each registers its front-end
from .base import REGISTRY, Frontend, Parts, register

__all__ = ["REGISTRY", "Frontend", "Parts", "make_frontend", "register"]


def make_frontend(name: str, parts: Parts, **options: Any) -> Frontend:
    """The front-end registered as ``name``, built from ``parts`` with its own ``options``."""
    return REGISTRY[name](parts, **options)
