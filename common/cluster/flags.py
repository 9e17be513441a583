"""Command-line flags that also read ``PDSERVE_<FLAG>``: one rule for every service's parser.

``--some-flag`` reads ``PDSERVE_SOME_FLAG`` when it is not given on the command line; an empty
variable means unset (compose files often write them so).  A few older names stay as aliases.
Precedence: the flag, then ``PDSERVE_<FLAG>``, then an alias, then the default.  Values from the
environment go through the flag's own ``type`` and ``choices``, so a bad one is reported by name.

Secrets (``add_secret``) also read a file, and ``--help`` never shows their value: a default taken
from the environment would otherwise be printed by ``--help`` (see ``common.cluster.secret_sources``
for the sources and checks; ``secret_value`` resolves one after parsing).

Every parser that takes a secret is a ``FlagParser``: it takes no abbreviated flag (argparse would
read ``--api=VALUE`` as ``--api-key`` -- or, with two candidates, print "ambiguous option:
--api=VALUE") and its error messages name flags, never a value given on the command line
(argparse prints "unrecognized arguments: --api-kye VALUE" for a typo).
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Any, Callable, Mapping

from common.cluster.secret_sources import read_secret_file

TRUE = ("1", "true", "yes", "on")
FALSE = ("0", "false", "no", "off")
ARGV_SECRETS = "_secrets_on_command_line"  # namespace attribute: {dest: flag} of secrets given as arguments
log = logging.getLogger("pdserve.config")
NOT_SHOWN = "(value not shown)"


def module_prog(argv0: str | None = None, main_module: str | None = None) -> str | None:
    """``python -m PACKAGE`` where the program runs as a package's ``__main__`` (argparse's default
    would say ``__main__.py``), else None (argparse's own)."""
    argv0 = sys.argv[0] if argv0 is None else argv0
    if main_module is None:
        spec = getattr(sys.modules.get("__main__"), "__spec__", None)
        main_module = getattr(spec, "name", None) or ""
    if os.path.basename(argv0) != "__main__.py" or not main_module.endswith(".__main__"):
        return None
    return f"python -m {main_module.removesuffix('.__main__')}"


class FlagParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose errors never repeat a value from the command line (it may be a
    secret given to a mistyped flag) and that takes flags only by their full names.

    Errors name the flags (an unknown ``--flag=VALUE`` as ``--flag=(value not shown)``) and count
    the values left over; an invalid value (a bad number, a choice not offered) is reported by its
    flag and the choices, without the value.  Sub-commands (``add_subparsers().add_parser``) are
    FlagParsers too."""

    def __init__(self, *args, **kwargs):
        kwargs["allow_abbrev"] = False
        if not args and "prog" not in kwargs:
            kwargs["prog"] = module_prog()
        super().__init__(*args, **kwargs)
        self._given: tuple[str, ...] = ()

    def parse_known_args(self, args=None, namespace=None):
        args = list(sys.argv[1:] if args is None else args)
        self._given = tuple(args)
        return super().parse_known_args(args, namespace)

    def parse_args(self, args=None, namespace=None):
        namespace, extras = self.parse_known_args(args, namespace)
        if extras:
            self.error(unrecognized(extras))
        return namespace

    def error(self, message: str):
        super().error(self._without_values(message))

    def _without_values(self, message: str) -> str:
        """``message`` with every argument given that is not a flag or a sub-command's name taken out."""
        names = set(self._option_string_actions)
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction):
                names.update(action.choices)
        for arg in sorted(self._given, key=len, reverse=True):  # longest first: one may contain another
            flag, eq, value = arg.partition("=")
            if arg.startswith("-") and eq:
                message = message.replace(arg, f"{flag}={NOT_SHOWN}").replace(repr(value), NOT_SHOWN)
            elif arg not in names:
                message = message.replace(repr(arg), NOT_SHOWN)
        return message


def unrecognized(extras: list[str]) -> str:
    """argparse's "unrecognized arguments" error, naming the flags only."""
    flags = [arg.partition("=")[0] + (f"={NOT_SHOWN}" if "=" in arg else "") for arg in extras if arg.startswith("-")]
    values = sum(1 for arg in extras if not arg.startswith("-"))
    shown = " ".join(flags)
    if values:
        shown += f"{' and ' if flags else ''}{values} value{'s' if values > 1 else ''} (not shown)"
    return f"unrecognized arguments: {shown}"


def env_name(dest: str) -> str:
    return f"PDSERVE_{dest.upper()}"


class _ShownDefaults:
    """Help-formatter mixin: an action with a ``shown_default`` shows that text as its default
    instead of its value (a secret's source, a URL without its password)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        shown = getattr(action, "shown_default", None)
        if shown is None:
            return super()._get_help_string(action)
        # argparse %-formats help strings: a literal '%' in the shown text must be doubled.
        return f"{action.help or ''} (default: {shown.replace('%', '%%')})".lstrip()


def _with_shown_defaults(formatter: type) -> type:
    if issubclass(formatter, _ShownDefaults):
        return formatter
    return type(f"ShownDefaults{formatter.__name__}", (_ShownDefaults, formatter), {})


class RecordsCommandLine(argparse.Action):
    """Stores a value and records that it came from the command line (for flags that may carry a
    secret: ``secret_value`` and ``given_on_command_line`` read the record)."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, values)
        given = dict(getattr(namespace, ARGV_SECRETS, None) or {})
        given[self.dest] = option_string or self.option_strings[0]
        setattr(namespace, ARGV_SECRETS, given)


class RemovedFlag(argparse.Action):
    """A flag no longer taken (hidden from ``--help``): giving it is an error that names the flag and
    why, never its value (argparse's "unrecognized arguments" would echo a secret given with it)."""

    def __init__(self, option_strings, dest, why: str = "", **kwargs):
        kwargs.update(nargs="?", help=argparse.SUPPRESS, default=argparse.SUPPRESS)
        super().__init__(option_strings, dest, **kwargs)
        self.why = why

    def __call__(self, parser, namespace, values, option_string=None):
        parser.error(f"{option_string} is no longer taken: {self.why}")


def given_on_command_line(args: argparse.Namespace, dest: str) -> str | None:
    """The flag that set ``dest`` on the command line (a ``RecordsCommandLine`` flag), else None."""
    return (getattr(args, ARGV_SECRETS, None) or {}).get(dest)


def secret_value(args: argparse.Namespace, dest: str, what: str) -> str | None:
    """The secret ``dest`` after parsing (see the module docstring for the order of sources): the
    command line (logged as a warning naming the flag), else its file, else ``PDSERVE_<DEST>``.
    None when none is set; "" for an empty file (refused by the strength check)."""
    flag = given_on_command_line(args, dest)
    if flag is not None:
        log.warning("%s was given on the command line (%s): every user of this machine can read a process's "
                    "command line; pass it in %s or a file (%s-file) instead", what, flag, env_name(dest), flag)
        return getattr(args, dest)
    path = getattr(args, f"{dest}_file", None)
    if path:
        return read_secret_file(path, what)
    return getattr(args, dest, None) or None


class EnvFlags:
    """Adds flags to ``parser`` whose defaults come from ``env`` (``os.environ`` by default)."""

    def __init__(self, parser: argparse.ArgumentParser, env: Mapping[str, str] | None = None,
                 aliases: Mapping[str, tuple[str, ...]] | None = None):
        self.parser = parser
        self.env = os.environ if env is None else env
        self.aliases = dict(aliases or {})
        parser.formatter_class = _with_shown_defaults(parser.formatter_class)

    def lookup(self, dest: str) -> str | None:
        for name in (env_name(dest), *self.aliases.get(dest, ())):
            value = self.env.get(name)
            if value not in (None, ""):
                return value
        return None

    def add(self, flag: str, default: Any = None, type: Callable | None = str, *,
            show: Callable[[Any], str] | None = None, **kw) -> None:
        """A valued flag; argparse applies ``type`` (and checks ``choices``) to an environment value.
        ``show``: how ``--help`` shows the default (e.g. a URL without its password)."""
        dest = flag.lstrip("-").replace("-", "_")
        value = self.lookup(dest)
        value = default if value is None else value
        kw.setdefault("help", "(default: %(default)s)")  # argparse shows no default for a flag without help
        action = self.parser.add_argument(flag, default=value, type=type, **kw)
        if show is not None:
            action.shown_default = show(value)

    def add_secret(self, flag: str, what: str, help: str = "", file_flag: bool = True) -> None:
        """A secret: ``PDSERVE_<FLAG>``, a file (``--<flag>-file``/``PDSERVE_<FLAG>_FILE``, unless
        ``file_flag`` is False), or the flag itself (with a warning).  ``--help`` shows where it is
        read from, never its value; read it with ``secret_value(args, dest, what)``.  The parser must
        be a ``FlagParser`` (whose errors never show a value)."""
        if not isinstance(self.parser, FlagParser):
            raise TypeError(f"{flag}: a parser that takes a secret must be a FlagParser "
                            "(argparse's errors echo values)")
        dest = flag.lstrip("-").replace("-", "_")
        sources = env_name(dest) + (f" or the file {flag}-file" if file_flag else "")
        action = self.parser.add_argument(
            flag, default=self.lookup(dest), action=RecordsCommandLine, metavar="VALUE",
            help=f"{help} (discouraged on the command line, where other users of the machine can read it)".lstrip())
        action.shown_default = f"{sources}; never shown"
        if file_flag:
            self.add(f"{flag}-file", help=f"file holding {what} (Docker/Kubernetes secrets)")

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
