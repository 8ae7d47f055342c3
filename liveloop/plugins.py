"""Finding plug-ins by name in an entry-point group, LiveLoop's own included.

LiveLoop declares its own plug-ins (judges, the demo's probe source) as entry points, which
exist only where the package is installed. A source checkout on PYTHONPATH has none, so each
lookup also knows LiveLoop's own by the value its package declares; an installed entry point
of the same name takes precedence.
"""

from __future__ import annotations

from collections.abc import Mapping
from importlib.metadata import EntryPoint, entry_points


def named_plugins(group: str, shipped: Mapping[str, str]) -> dict[str, EntryPoint]:
    """Every plug-in name of `group`, sorted, with the entry point that provides it:
    `shipped` (name -> `module:attribute`) overridden by the installed entry points."""
    found = {name: EntryPoint(name, value, group) for name, value in shipped.items()}
    for ep in entry_points(group=group):
        found[ep.name] = ep
    return dict(sorted(found.items()))
