"""One way to add a fast path: a Registry maps each config name to a factory and the package it needs.

Every fast-path family (expert kernels, routing, attention, loss) is a Registry: a new backend is
one `Entry` in its family's registry, chosen by one config field, never an `if` in a forward.

  Entry(name, target, package=None, extra=None)
    target   "module:attribute" (or "module"), imported on first use, so a backend's optional
             dependency is only needed by those who pick it
    package  the importable module it needs beyond Sonic's own dependencies (e.g. "triton")
    extra    what installs that package (a pip extra of Sonic, or a pip package name)

`Registry.load(name)` returns the target. An unknown name is a ValueError that lists the choices;
a missing package is a ValueError that names what to install. Whether a backend can run on a
device is the family's own question (each family asks its backends, e.g. `unavailable_reason`).
"""
from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Entry:
    name: str
    target: str
    package: str | None = None
    extra: str | None = None


class Registry:
    def __init__(self, setting: str, entries: list[Entry]):
        self.setting = setting  # the config field that names a backend, for messages
        self.entries = {e.name: e for e in entries}
        assert len(self.entries) == len(entries), "duplicate backend names"

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self.entries)

    def __iter__(self):
        return iter(self.entries)

    def __contains__(self, name: str) -> bool:
        return name in self.entries

    def check(self, name: str, extra_choices: tuple[str, ...] = ()) -> None:
        """A ValueError listing the choices when `name` is none of them (config time)."""
        if name not in self.entries and name not in extra_choices:
            raise ValueError(f"{self.setting}={name!r} is not one of {', '.join(extra_choices + self.names)}")

    def missing(self, name: str) -> str | None:
        """Why `name`'s package cannot be imported here (with what installs it), or None."""
        entry = self.entries[name]
        if entry.package is None:
            return None
        try:
            found = importlib.util.find_spec(entry.package) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            return f"it needs the package {entry.package!r}; install it: pip install {entry.extra or entry.package}"
        return None

    def load(self, name: str) -> Any:
        """The target of `name`, imported now; a ValueError names an unknown name or a missing package."""
        self.check(name)
        reason = self.missing(name)
        if reason is not None:
            raise ValueError(f"{self.setting}={name!r} cannot run here: {reason}")
        module, _, attr = self.entries[name].target.partition(":")
        loaded = importlib.import_module(module)
        return getattr(loaded, attr) if attr else loaded
