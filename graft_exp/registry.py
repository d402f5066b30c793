"""Name tables: a component, rule or loss by its config name, with the valid names in the error of a
wrong one. ``graft_exp.methods`` holds one table per method component, ``graft_exp.objective`` the
receiver losses."""

from __future__ import annotations


class UnknownName(ValueError):
    """A method, component or rule parameter the registry does not hold; the message lists the valid ones."""


class Registry(dict):
    """Entries of one kind by name. A method component's table (``graft_exp.methods``) holds factories
    ``build(method) -> component`` that receive the method's config (``cfg.method``); ``params`` of an
    entry: the keys under ``method.params`` it reads."""

    def __init__(self, key: str):
        super().__init__()
        self.key = key      # the config key that names a component of this kind, e.g. method.selection
        self.params: dict[str, tuple[str, ...]] = {}

    def register(self, name: str, factory=None, *, params: tuple[str, ...] = ()):
        """``REG.register(name, factory)``, or ``@REG.register(name)`` on a factory."""
        def add(factory):
            if name in self:
                raise ValueError(f"{self.key}: {name!r} is registered twice")
            self[name], self.params[name] = factory, tuple(params)
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
