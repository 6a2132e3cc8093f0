"""Checks of numeric arguments, shared by the runtime, sources, sinks and configuration.

Each raises :class:`~sparkjet.errors.InvalidArgumentError` with a message that names the
parameter and the value refused (``"batch_size must be an int >= 1, got 0"``), and returns
the value as a plain Python number (numpy scalars are accepted and converted, so that what
is stored pickles and serialises as JSON). ``bool`` is never a number here: ``True`` as a
count is always a caller's mistake.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import os
import re
import sys
import types
import typing
from collections.abc import Iterable
from typing import Annotated

import msgspec
import numpy as np

from sparkjet.errors import InvalidArgumentError

__all__ = ["Finite", "check_bool", "check_distinct_ints", "check_fields", "check_int",
           "check_number", "check_path", "check_str", "field_message"]

# A float field's annotation: NaN fails every bound, infinity this one.
Finite = Annotated[float, msgspec.Meta(le=sys.float_info.max)]
_FINITE_TEXT = f"`float` <= {sys.float_info.max}"


def _bounds(low, high, above=None) -> str:
    if above is not None:
        return f" > {above}" + (f" and <= {high}" if high is not None else "")
    if low is not None and high is not None:
        return f" in {low}..{high}"
    if low is not None:
        return f" >= {low}"
    if high is not None:
        return f" <= {high}"
    return ""


def _is_int(value) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def check_int(name: str, value, *, min: int | None = None, max: int | None = None,
              none_ok: bool = False) -> int | None:
    """``value`` as an int, if it is one (not a bool) within ``min``..``max`` (each bound
    inclusive, None for none); None passes when ``none_ok``.

    >>> check_int("members", 0, min=1)
    Traceback (most recent call last):
    ...
    sparkjet.errors.InvalidArgumentError: members must be an int >= 1, got 0
    """
    if value is None and none_ok:
        return None
    if not _is_int(value) or (min is not None and value < min) or (
            max is not None and value > max):
        raise InvalidArgumentError(f"{name} must be {'None or ' if none_ok else ''}an int"
                                   f"{_bounds(min, max)}, got {value!r}")
    return int(value)


def check_number(name: str, value, *, min: float | None = None, above: float | None = None,
                 max: float | None = None, none_ok: bool = False,
                 finite: bool = True) -> float | int | None:
    """``value``, if it is an int or float (not a bool, never NaN; not infinite unless
    ``finite`` is false, as for a timeout where infinity means "never") that is at least
    ``min`` or more than ``above``, and at most ``max``; None passes when ``none_ok``. Ints
    stay ints.

    >>> check_number("stall_timeout", float("nan"), above=0, none_ok=True)
    Traceback (most recent call last):
    ...
    sparkjet.errors.InvalidArgumentError: stall_timeout must be None or a finite number > 0, got nan
    """
    if value is None and none_ok:
        return None
    ok = _is_int(value) or (isinstance(value, (float, np.floating)) and not math.isnan(value)
                            and (math.isfinite(value) or not finite))
    if not ok or (min is not None and value < min) or (above is not None and value <= above) or (
            max is not None and value > max):
        kind = "a finite number" if finite else "a number"
        raise InvalidArgumentError(f"{name} must be {'None or ' if none_ok else ''}{kind}"
                                   f"{_bounds(min, max, above)}, got {value!r}")
    return int(value) if _is_int(value) else float(value)


def check_str(name: str, value, *, none_ok: bool = False) -> str | None:
    """``value``, if it is a non-empty str (or None, when ``none_ok``)."""
    if value is None and none_ok:
        return None
    if not isinstance(value, str) or not value:
        raise InvalidArgumentError(f"{name} must be {'None or ' if none_ok else ''}a non-empty "
                                   f"str, got {value!r}")
    return value


def check_bool(name: str, value) -> bool:
    """``value``, if it is True or False (a numpy bool too): not 0, 1 or "yes"."""
    if not isinstance(value, (bool, np.bool_)):
        raise InvalidArgumentError(f"{name} must be True or False, got {value!r}")
    return bool(value)


def check_path(name: str, value) -> str:
    """``value`` as a str path, if it is a non-empty str or os.PathLike of one."""
    path = os.fspath(value) if isinstance(value, os.PathLike) else value
    if not isinstance(path, str) or not path:
        raise InvalidArgumentError(f"{name} must be a path (a non-empty str or os.PathLike), "
                                   f"got {value!r}")
    return path


def check_distinct_ints(name: str, values: Iterable, *, min: int | None = None,
                        max: int | None = None) -> list[int]:
    """``values`` as a list of distinct ints, each within ``min``..``max`` (such as the
    partitions a reader is given; the list may be empty)."""
    items = list(values)
    in_range = all(_is_int(v) and (min is None or v >= min) and (max is None or v <= max)
                   for v in items)
    if not in_range or len(set(items)) != len(items):
        raise InvalidArgumentError(f"{name} must be distinct ints{_bounds(min, max)}, "
                                   f"got {items!r}")
    return [int(v) for v in items]


def check_fields(obj, owner: str | None = None) -> dict:
    """Checks every field of a dataclass instance against its annotation (a type with
    ``msgspec.Meta`` bounds: ``Annotated[int, Meta(ge=1)]``, a ``Literal`` of the allowed
    values, ``str | None``, a class such as ``pyarrow.Schema``...) and returns the values as
    plain Python data (numpy scalars and paths converted). The annotations are the schema:
    a field cannot go unchecked.

    The message names ``owner`` and the field (``"KafkaSource: timeout must be ..."``;
    without an owner, ``"Config.field must be ..."``) and the value refused. A field whose
    annotation carries ``Meta(description=...)`` says that instead of msgspec's words for
    the type; ``Meta(extra={"secret": True})`` keeps the value out of the message; a
    number above a field's upper bound (``le``) whose ``Meta`` says why in
    ``extra={"limit": "..."}`` (what the limit protects, how to scale instead) has that
    said after the bound.

    >>> from dataclasses import dataclass
    >>> @dataclass
    ... class Config:
    ...     workers: Annotated[int, msgspec.Meta(ge=1)] = 1
    >>> check_fields(Config(workers=0))
    Traceback (most recent call last):
    ...
    sparkjet.errors.InvalidArgumentError: Config.workers must be `int` >= 1, got 0
    >>> check_fields(Config(workers=0), "Pool")
    Traceback (most recent call last):
    ...
    sparkjet.errors.InvalidArgumentError: Pool: workers must be `int` >= 1, got 0
    """
    cls = type(obj)
    values = {f.name: _plain(getattr(obj, f.name)) for f in dataclasses.fields(cls)}
    try:
        checked = msgspec.convert(values, _schema(cls), strict=True)
    except msgspec.ValidationError as e:
        text = str(e)
        where = re.search(r" - at `\$\.(\w+)[^`]*`$", text)
        name = where[1] if where else "?"
        description, secret = _described(cls, name)
        if description is not None:
            expected = description
        else:
            expected = text[: where.start()] if where else text
            expected = re.sub(r"^Expected (.*?)(, got `[^`]*`)?$", r"\1", expected)
            expected = expected.replace(_FINITE_TEXT, "a finite `float`").replace("null", "None")
            expected = re.sub(r"^Invalid enum value .*", "one of " + _choices(cls, name),
                              expected)
        why = _over_limit(cls, name, values.get(name))
        if why:
            expected += f" ({why})"
        raise InvalidArgumentError(field_message(owner, cls, name, expected, values.get(name),
                                                 secret)) from None
    return msgspec.structs.asdict(checked)


def field_message(owner: str | None, cls: type, name: str, expected: str, value,
                  secret: bool = False) -> str:
    """The message :func:`check_fields` gives for field ``name`` of a ``cls`` (named
    ``owner``, if given) whose ``value`` is not ``expected``; also for rules a field's
    annotation cannot say."""
    who = f"{owner}: {name}" if owner else f"{cls.__name__}.{name}"
    got = (f"a value of type {type(value).__name__} (not shown)" if secret
           else repr(value))
    return f"{who} must be {expected}, got {got}"


def _described(cls, name: str) -> tuple[str | None, bool]:
    """The ``Meta`` description of field ``name`` (``"... or None"`` when the described type
    is in a union with None) and whether its value is a secret."""
    hint = typing.get_type_hints(cls, include_extras=True).get(name)
    outer = _metas(hint)
    inner = [(m, arg) for arg in typing.get_args(hint)
             if typing.get_origin(hint) in (typing.Union, types.UnionType)
             for m in _metas(arg)]
    secret = any(m.extra and m.extra.get("secret") for m in outer + [m for m, _ in inner])
    for m in outer:
        if m.description:
            return m.description, secret
    for m, _ in inner:
        if m.description:
            optional = type(None) in typing.get_args(hint)
            return m.description + (" or None" if optional else ""), secret
    return None, secret


def _over_limit(cls, name: str, value) -> str | None:
    """Why field ``name`` has its upper bound (``Meta(le=..., extra={"limit": why})``), if
    ``value`` is a number above it."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return None
    hint = typing.get_type_hints(cls, include_extras=True).get(name)
    metas = _metas(hint) + [m for arg in typing.get_args(hint)
                            if typing.get_origin(hint) in (typing.Union, types.UnionType)
                            for m in _metas(arg)]
    for m in metas:
        if m.le is not None and value > m.le and m.extra and m.extra.get("limit"):
            return m.extra["limit"]
    return None


def _metas(hint) -> list:
    if typing.get_origin(hint) is Annotated:
        return [m for m in hint.__metadata__ if isinstance(m, msgspec.Meta)]
    return []


@functools.cache
def _schema(cls) -> type:
    hints = typing.get_type_hints(cls, include_extras=True)
    return msgspec.defstruct(f"{cls.__name__}Schema",
                             [(f.name, hints[f.name]) for f in dataclasses.fields(cls)])


def _choices(cls, name: str) -> str:
    """The values a ``Literal`` field (or one of a ``Literal`` or None) allows, for a message."""
    hint = typing.get_type_hints(cls).get(name)
    values = _literals(hint)
    optional = type(None) in typing.get_args(hint) or None in values
    return ", ".join(repr(v) for v in values if v is not None) + (" or None" if optional else "")


def _literals(hint) -> list:
    if typing.get_origin(hint) is typing.Literal:
        return list(typing.get_args(hint))
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return [v for arg in typing.get_args(hint) for v in _literals(arg)]
    return []


def _plain(value):
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    return value
