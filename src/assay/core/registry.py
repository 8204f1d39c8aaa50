"""One registry for every extension point found by name: environments, rollout backends, metrics sinks.

A `Registry[T]` maps names to entries of type T. Built-ins register when their module is imported
(`builtins`, imported on first lookup); third-party entries are found through an entry-point group,
listed once per registry and loaded either by name when first looked up (`get`) or all at once
(`load_all`, for registries whose plugins name themselves, as environments do). The same name
registered twice from two places is refused, naming both; registering the same object again (a
module imported twice, a plugin that is also a built-in) is not a clash."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from importlib.metadata import EntryPoint, entry_points
from typing import Generic, TypeVar

from assay.core.errors import AssayError

T = TypeVar("T")
F = TypeVar("F")


def qualname(obj: object) -> str:
    """Where an object was defined, `module.qualified.name`: what tells two registrations apart."""
    return f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', type(obj).__qualname__)}"


@dataclass
class Registry(Generic[T]):
    """Named entries of one kind. `what` names the kind in errors ("rollout backend"), `plural` its
    list ("backends"), `group` the entry-point group plugins use; `adopt(registry, ep, obj)`
    registers what the plugin's entry point `ep` loaded (checking it first); `fix` says how to resolve a clash;
    `unknown` is the error type a failed lookup raises."""

    what: str
    plural: str
    group: str
    adopt: Callable[[Registry[T], EntryPoint, object], None]
    builtins: str | None = None  # the module whose import registers the built-ins
    fix: str = "rename one"
    unknown: type[AssayError] = AssayError
    _entries: dict[str, T] = field(default_factory=dict)
    _origins: dict[str, str] = field(default_factory=dict)
    _plugins: dict[str, EntryPoint] | None = None  # the group's entry points by name, listed once
    _loaded: bool = False  # every plugin adopted (load_all)

    def add(self, name: str, entry: T, origin: str | None = None) -> T:
        """Register `entry` as `name`; `origin` (default: where `entry` was defined) tells a re-registration
        of the same thing, allowed, from a clash, refused naming both."""
        self.check_name(name)
        origin = origin or qualname(entry)
        old = self._origins.get(name)
        if old is not None and old != origin:
            raise AssayError(f"{self.what} {name!r} is registered twice ({old} and {origin}); {self.fix}")
        self._entries[name], self._origins[name] = entry, origin
        return entry

    def check_name(self, name: str) -> None:
        if not name or name != name.strip():
            raise AssayError(f"a {self.what} needs a non-empty name without surrounding spaces, got {name!r}")

    def register(self, name: str) -> Callable[[F], F]:
        """Decorator: register the decorated object itself as `name` (for registries whose entries are
        the objects they decorate)."""
        self.check_name(name)

        def add(obj: F) -> F:
            self.add(name, obj)  # type: ignore[arg-type]  # F is T here: the caller's decorator types it
            return obj
        return add

    def origin(self, name: str) -> str | None:
        """Where the entry `name` was defined, if registered."""
        return self._origins.get(name)

    def get(self, name: str) -> T:
        """The entry `name`: a registered one, else the plugin of that name (loaded and adopted now)."""
        self._import_builtins()
        if name not in self._entries and (ep := self.plugins().get(name)) is not None:
            self.adopt(self, ep, self._load(ep))
        if name not in self._entries:
            raise self.unknown(f"unknown {self.what} {name!r}; known {self.plural}: {', '.join(self.names()) or 'none'} "
                               f"(a plugin adds one through the {self.group!r} entry-point group)")
        return self._entries[name]

    def names(self) -> list[str]:
        """Every name a lookup may find: the registered ones and the installed plugins' (not imported here)."""
        self._import_builtins()
        return sorted({*self._entries, *self.plugins()})

    def entries(self) -> dict[str, T]:
        """The registered entries (a copy), built-ins included; plugins only once loaded."""
        self._import_builtins()
        return dict(self._entries)

    def load_all(self) -> None:
        """Adopt every plugin, once; one that fails to load is an error each time, never silently dropped."""
        if self._loaded:
            return
        self._import_builtins()
        for ep in self.plugins().values():
            self.adopt(self, ep, self._load(ep))
        self._loaded = True

    def plugins(self) -> dict[str, EntryPoint]:
        """The group's entry points by name, listed once per registry."""
        if self._plugins is None:
            self._plugins = {ep.name: ep for ep in entry_points(group=self.group)}
        return self._plugins

    def copy(self, plugins: Sequence[EntryPoint] | None = None) -> Registry[T]:
        """The same entries in a registry of their own, a scratch one for a test: its plugins are `plugins`
        (default: the group's installed entry points), none of them loaded yet."""
        self._import_builtins()
        listed = None if plugins is None else {ep.name: ep for ep in plugins}
        return Registry(self.what, self.plural, self.group, self.adopt, self.builtins, self.fix, self.unknown,
                        dict(self._entries), dict(self._origins), listed)

    def plugin_error(self, ep: EntryPoint, problem: str) -> AssayError:
        """An error about the plugin `ep`, naming its entry point's target."""
        return AssayError(f"{self.what} plugin {ep.name!r} ({ep.value}) {problem}")

    def _load(self, ep: EntryPoint) -> object:
        try:
            return ep.load()
        except Exception as e:  # a broken plugin is named, not a crash deep inside a worker
            raise self.plugin_error(ep, f"failed to load: {e}") from e

    def _import_builtins(self) -> None:
        if self.builtins is not None:
            importlib.import_module(self.builtins)  # once: Python caches it; it registers into this registry
