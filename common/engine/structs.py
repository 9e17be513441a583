"""``Struct`` and ``convert``: msgspec's where msgspec is installed, a frozen-dataclass stand-in where not.

The engine's value types that also travel on the wire (``SamplingParams``, ``KVLayout``) are
msgspec structs, so the services decode and validate them straight from a peer's message. The
engine itself never touches the wire, and the GPU check runs it where msgspec is absent (see the
README's "GPU check"). There the stand-in makes each subclass a dataclass with the same fields,
defaults, ``__post_init__`` validation, equality and ``__struct_fields__``; the msgspec-only class
options (``forbid_unknown_fields``, ``tag``, ...) only matter to decoding and are accepted and ignored.
"""
from __future__ import annotations

import dataclasses
from typing import Any

try:
    import msgspec
except ImportError:  # the GPU check's environment: no wire, no msgspec
    msgspec = None

if msgspec is not None:
    Struct = msgspec.Struct

    def convert(fields: dict[str, Any], cls: type) -> Any:
        """Build ``cls`` from untrusted ``fields``; unknown or mistyped fields raise ``ValueError``."""
        try:
            return msgspec.convert(fields, cls)
        except msgspec.ValidationError as exc:
            raise ValueError(str(exc)) from None

else:

    class Struct:
        """Stand-in for ``msgspec.Struct`` (see the module docstring)."""

        __struct_fields__: tuple[str, ...] = ()

        def __init_subclass__(cls, frozen: bool = False, kw_only: bool = False, **_msgspec_only) -> None:
            super().__init_subclass__()
            dataclasses.dataclass(frozen=frozen, kw_only=kw_only)(cls)
            cls.__struct_fields__ = tuple(f.name for f in dataclasses.fields(cls))

    def convert(fields: dict[str, Any], cls: type) -> Any:
        """Build ``cls`` from ``fields``; unknown fields raise ``ValueError``, lists become tuples."""
        if not isinstance(fields, dict):
            raise ValueError(f"expected an object, got {type(fields).__name__}")
        unknown = sorted(set(fields) - set(cls.__struct_fields__))
        if unknown:
            raise ValueError(f"Object contains unknown field `{unknown[0]}`")
        values = {k: tuple(v) if isinstance(v, list) else v for k, v in fields.items()}
        try:
            return cls(**values)
        except TypeError as exc:
            raise ValueError(str(exc)) from None


def replace(value: Any, **changes: Any) -> Any:
    """A copy of the struct ``value`` with ``changes`` (msgspec's ``structs.replace`` or the stand-in's)."""
    if msgspec is not None:
        return msgspec.structs.replace(value, **changes)
    return dataclasses.replace(value, **changes)
