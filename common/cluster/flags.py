"""Command-line flags that also read ``PDSERVE_<FLAG>``: one rule for every service's parser.

``--some-flag`` reads ``PDSERVE_SOME_FLAG`` when it is not given on the command line; an empty
variable means unset (compose files often write them so).  A few older names stay as aliases.
Precedence: the flag, then ``PDSERVE_<FLAG>``, then an alias, then the default.  Values from the
environment go through the flag's own ``type`` and ``choices``, so a bad one is reported by name.
"""
from __future__ import annotations

import argparse
import os
from typing import Any, Callable, Mapping

TRUE = ("1", "true", "yes", "on")
FALSE = ("0", "false", "no", "off")


def env_name(dest: str) -> str:
    return f"PDSERVE_{dest.upper()}"


class EnvFlags:
    """Adds flags to ``parser`` whose defaults come from ``env`` (``os.environ`` by default)."""

    def __init__(self, parser: argparse.ArgumentParser, env: Mapping[str, str] | None = None,
                 aliases: Mapping[str, tuple[str, ...]] | None = None):
        self.parser = parser
        self.env = os.environ if env is None else env
        self.aliases = dict(aliases or {})

    def lookup(self, dest: str) -> str | None:
        for name in (env_name(dest), *self.aliases.get(dest, ())):
            value = self.env.get(name)
            if value not in (None, ""):
                return value
        return None

    def add(self, flag: str, default: Any = None, type: Callable | None = str, **kw) -> None:
        """A valued flag; argparse applies ``type`` (and checks ``choices``) to an environment value."""
        dest = flag.lstrip("-").replace("-", "_")
        value = self.lookup(dest)
        kw.setdefault("help", "(default: %(default)s)")  # argparse shows no default for a flag without help
        self.parser.add_argument(flag, default=default if value is None else value, type=type, **kw)

    def add_switch(self, flag: str, default: bool = False, **kw) -> None:
        """An on/off flag: ``--flag`` turns it on; ``PDSERVE_<FLAG>`` may say 1/true/yes/on or 0/false/no/off.
        A switch that is on by default also takes ``--no-<flag>``."""
        dest = flag.lstrip("-").replace("-", "_")
        value = self.lookup(dest)
        action = argparse.BooleanOptionalAction if default else "store_true"
        if value is not None:
            if value.lower() not in TRUE + FALSE:
                raise ValueError(f"{env_name(dest)}={value!r}: expected one of {', '.join(TRUE + FALSE)}")
            default = value.lower() in TRUE
        self.parser.add_argument(flag, action=action, default=default, **kw)

    def names(self) -> set[str]:
        """Every environment variable these flags read (for checks of deployment files)."""
        names = set()
        for action in self.parser._actions:
            if action.dest != "help":
                names.add(env_name(action.dest))
                names.update(self.aliases.get(action.dest, ()))
        return names
