"""How a config reader says no: :func:`refuse` for a key whose value needs model code the
runner does not have (``UnsupportedArchitecture``), :func:`malformed` for a value that is not
what the key must hold (``CorruptModelFile``); both name the key and the config file.

``runner.models.config`` and ``runner.models.rope_config`` share them, so the one config
reader words every refusal alike whichever part of a config it is reading.
"""

from __future__ import annotations

from typing import Any

from protocol.errors import CorruptModelFile, UnsupportedArchitecture


def refuse(key: str, value: Any, why: str, path: str | None) -> UnsupportedArchitecture:
    """The refusal of a config key we do not implement (raise it)."""
    return UnsupportedArchitecture(f"unsupported config key {key} = {value!r}: {why}", path=path)


def malformed(key: str, why: str, path: str | None) -> CorruptModelFile:
    """The error for a value that is not what ``key`` must hold (raise it)."""
    return CorruptModelFile(f"bad config key {key}: {why}", path=path)
