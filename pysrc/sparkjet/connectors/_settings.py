"""The connectors' settings as typed data, as :class:`~sparkjet.runtime.config.JobConfig` is.

Each source and sink has a frozen dataclass of its constructor's arguments (same names,
order and defaults; ``tests/connectors/test_connector_settings.py`` holds them to the signature) whose
annotations are their schema, checked by :func:`sparkjet._checks.check_fields`. A bad
argument raises :class:`~sparkjet.errors.InvalidArgumentError` naming the connector, the
argument and the value (``"KafkaSource: timeout must be a finite number > 0, got -1"``);
a secret (a password, a connection string) is never shown. Rules between arguments, and values
derived from them (an absolute path, a default that depends on another argument), are the
settings' :meth:`Settings.check`. A connector's constructor builds its settings from its
arguments and takes the checked values as its attributes::

    def __init__(self, topic, bootstrap_servers=DEFAULT_BOOTSTRAP, *, ...):
        KafkaSourceSettings.of(locals()).apply(self)

The aliases below are the types most settings share.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Annotated

import pyarrow as pa
import pyarrow.fs as pafs
from msgspec import Meta

from sparkjet._checks import Finite, check_fields, field_message
from sparkjet.errors import InvalidArgumentError

#: A non-empty str.
Text = Annotated[str, Meta(min_length=1)]
#: A column name.
Column = Annotated[str, Meta(min_length=1, description="a column name")]
#: Key columns: one name, or a non-empty list of them (taken as a list).
Keys = Annotated[Annotated[str, Meta(min_length=1)]
                 | Annotated[list[Annotated[str, Meta(min_length=1)]], Meta(min_length=1)],
                 Meta(description="a column name or a non-empty list of them")]
#: A path: a non-empty str or an os.PathLike of one (taken as its str).
Path = Annotated[str, Meta(min_length=1,
                           description="a path (a non-empty str or os.PathLike)")]
#: A count of partitions, rows per batch and the like: 1 .. 2**31 - 1.
Count = Annotated[int, Meta(ge=1, le=2**31 - 1)]
#: A source's partitions: 1 .. MAX_SOURCE_PARTITIONS. Each is read, watermarked and saved
#: in every snapshot on its own; far more than any topic or stream has, the bound stops a
#: slip of the keyboard that would run for minutes.
MAX_SOURCE_PARTITIONS = 100_000
SourcePartitions = Annotated[int, Meta(ge=1, le=MAX_SOURCE_PARTITIONS, extra={"limit": (
    "each source partition is read, watermarked and saved in every snapshot on its own; a "
    "source needs no more of them than the processors reading it")})]
#: An int >= 1 (no upper bound but int64's).
PositiveInt = Annotated[int, Meta(ge=1)]
#: A number (an int, or a finite float: ints stay ints) > 0, and one >= 0: seconds, rates.
PositiveNumber = Annotated[Annotated[int, Meta(gt=0)] | Annotated[Finite, Meta(gt=0)],
                           Meta(description="a finite number > 0")]
NonNegativeNumber = Annotated[Annotated[int, Meta(ge=0)] | Annotated[Finite, Meta(ge=0)],
                              Meta(description="a finite number >= 0")]
#: The same where infinity is a value ("never"); NaN never is.
PositiveOrInfinite = Annotated[Annotated[int, Meta(gt=0)] | Annotated[float, Meta(gt=0)],
                               Meta(description="a number > 0")]
NonNegativeOrInfinite = Annotated[Annotated[int, Meta(ge=0)] | Annotated[float, Meta(ge=0)],
                                  Meta(description="a number >= 0")]
#: A pyarrow schema, and a pyarrow filesystem.
Schema = Annotated[pa.Schema, Meta(description="a pyarrow.Schema")]
FileSystem = Annotated[pafs.FileSystem, Meta(description="a pyarrow.fs.FileSystem")]
#: Settings handed on to a client library (librdkafka's, ...): a dict.
Options = Annotated[dict, Meta(description="a dict")]


@dataclass(frozen=True)
class Settings:
    """Base of the connectors' settings (see the module doc). A subclass is a frozen
    dataclass named ``<Connector>Settings``; errors name ``<Connector>``."""

    def __post_init__(self):
        # Every field against its annotation; frozen, so the checked values (plain Python
        # data: numpy scalars and paths converted) are stored with object.__setattr__.
        for name, value in check_fields(self, self.connector()).items():
            object.__setattr__(self, name, value)
        self.check()

    @classmethod
    def connector(cls) -> str:
        """The connector the settings are of, as errors name it."""
        return cls.__name__.removesuffix("Settings")

    @classmethod
    def of(cls, arguments: dict) -> Settings:
        """The settings of the arguments ``arguments`` (a constructor's ``locals()``: other
        names in it are ignored)."""
        return cls(**{f.name: arguments[f.name] for f in dataclasses.fields(cls)})

    def check(self) -> None:
        """Rules between fields, and derived values (:meth:`_derive`); none by default."""

    def apply(self, target, *, skip: tuple[str, ...] = ()) -> None:
        """Sets each field but those in ``skip`` as an attribute of ``target``."""
        for f in dataclasses.fields(self):
            if f.name not in skip:
                setattr(target, f.name, getattr(self, f.name))

    def as_dict(self) -> dict:
        """The fields and their values (not copied)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    def _derive(self, name: str, value) -> None:
        object.__setattr__(self, name, value)

    def _refuse(self, name: str, expected: str) -> InvalidArgumentError:
        """The error of field ``name`` not being ``expected`` (a rule's, worded as the
        annotations' are)."""
        return InvalidArgumentError(field_message(self.connector(), type(self), name,
                                                  expected, getattr(self, name)))

    def _error(self, text: str) -> InvalidArgumentError:
        """An error of a rule between fields: ``text``, after the connector's name."""
        return InvalidArgumentError(f"{self.connector()}: {text}")


class BySettings:
    """A connector that is its settings (``settings_type``): its ``config``, ``repr``,
    equality and hash are theirs (sources whose equal settings give equal events)."""

    settings_type: type[Settings]

    @property
    def config(self) -> dict:
        """The configuration as JSON-able data; ``Connector(**config)`` rebuilds it."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self.settings_type)}

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.config.items())
        return f"{type(self).__name__}({args})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, type(self)) and self.config == other.config

    def __hash__(self) -> int:
        return hash(tuple(self.config.items()))
