"""Name tables: a component, rule or loss by its config name, with the valid names in the error of a
wrong one. ``graft_exp.methods`` holds one table per method component, ``graft_exp.methods.objective`` the
receiver losses."""

from __future__ import annotations

import math
from dataclasses import dataclass


class UnknownName(ValueError):
    """A method, component or rule parameter the registry does not hold (the message lists the valid ones), or a
    rule parameter's value outside what the rule declared (the message names the range)."""


@dataclass(frozen=True)
class RuleParam:
    """A rule's own setting under ``method.params``, declared at registration: its type (``float``, ``int`` or
    ``bool``) and the closed range its value must lie in (None: unbounded on that side)."""

    kind: type = float
    low: float | None = None
    high: float | None = None

    def describe(self) -> str:
        if self.kind is bool:
            return "true or false"
        what = "a number" if self.kind is float else "an integer"
        if self.low is not None and self.high is not None:
            return f"{what} in [{self.low:g}, {self.high:g}]"
        if self.low is not None:
            return f"{what} >= {self.low:g}"
        return f"{what} <= {self.high:g}" if self.high is not None else what

    def accepts(self, value) -> bool:
        if self.kind is bool:
            return isinstance(value, bool)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            return False
        if self.kind is int and not float(value).is_integer():
            return False
        return (self.low is None or value >= self.low) and (self.high is None or value <= self.high)


class Registry(dict):
    """Entries of one kind by name. A method component's table (``graft_exp.methods``) holds factories
    ``build(method) -> component`` that receive the method's config (``cfg.method``); ``params`` of an
    entry: the keys under ``method.params`` it reads, each with its ``RuleParam``."""

    def __init__(self, key: str):
        super().__init__()
        self.key = key      # the config key that names a component of this kind, e.g. method.selection
        self.params: dict[str, dict[str, RuleParam]] = {}

    def register(self, name: str, factory=None, *, params: dict[str, RuleParam] | None = None):
        """``REG.register(name, factory)``, or ``@REG.register(name)`` on a factory; ``params``: the settings it
        reads under ``method.params``, e.g. ``{"top_fraction": RuleParam(float, 0.0, 1.0)}``."""
        def add(factory):
            if name in self:
                raise ValueError(f"{self.key}: {name!r} is registered twice")
            if not all(isinstance(spec, RuleParam) for spec in (params or {}).values()):
                raise TypeError(f"{self.key}={name}: params maps each name to a RuleParam (its type and range)")
            self[name], self.params[name] = factory, dict(params or {})
            return factory
        return add if factory is None else add(factory)

    def get(self, name: str):
        if name not in self:
            raise UnknownName(f"{self.key}={name!r} is not one of {', '.join(self)}")
        return self[name]

    def chosen(self, method) -> str:
        """The name the method's config gives under this table's key (``method.selection`` -> its value)."""
        return method[self.key.split(".", 1)[1]]

    def build(self, method):
        """The component the method's config names under this table's key, built from that config."""
        return self.get(self.chosen(method))(method)


def fixed(component):
    """The factory of a component that no setting changes."""
    return lambda method: component
