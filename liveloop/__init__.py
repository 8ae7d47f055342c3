"""LiveLoop: shared code for the four loops (contracts, config, bus, registry, models) and the CLI.

Nothing in this package imports a loop package (`liveloop.server`, `.prm`, `.collector`,
`.trainer`; symlinks to the folders at the repository root)
except `liveloop.cli`, which composes them.
"""

__version__ = "0.1.0"
