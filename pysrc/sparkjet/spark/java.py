"""Finding a Java 17+ runtime for Spark, with an error that says what to install.

Spark's launcher only looks at ``JAVA_HOME`` and then ``java`` on ``PATH``, and when both
miss it fails with a message about a gateway that exited. :func:`find_java_home` looks in
the same places first, then in the folders where JDKs are usually installed, and raises
:class:`JavaNotFoundError` naming everything it looked at.
"""
from __future__ import annotations

import glob
import os
import re
import shutil
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path

from sparkjet.errors import (
    JavaNotFoundError,  # noqa: F401 (defined there; named here too)
    )

MIN_JAVA_VERSION = 17

#: Where JDKs are usually installed (glob patterns of Java homes), searched when neither
#: ``JAVA_HOME`` nor ``java`` on ``PATH`` gives a runtime.
JAVA_SEARCH_PATTERNS = (
    "/usr/lib/jvm/*",
    "/usr/java/*",
    "/opt/java/*",
    "/Library/Java/JavaVirtualMachines/*/Contents/Home",
    "~/.sdkman/candidates/java/*",
)

_INSTALL_HINT = (
    "install Java 17 or newer (e.g. `apt-get install openjdk-17-jre-headless`, "
    "`brew install openjdk@17`, or https://adoptium.net) and/or set JAVA_HOME to its folder"
)
_VERSION_RE = re.compile(r'version "([^"]+)"')


def java_version(java: str | os.PathLike) -> int:
    """The feature version (8, 11, 17, 21, ...) of the ``java`` executable, from
    ``java -version``; raises :class:`JavaNotFoundError` when it does not run or does not
    print a version."""
    try:
        done = subprocess.run(
            [os.fspath(java), "-version"], capture_output=True, text=True, timeout=30, check=False
        )
    except (OSError, subprocess.SubprocessError) as e:
        raise JavaNotFoundError(f"cannot run {java} -version: {e}") from e
    output = done.stderr + done.stdout
    version = parse_java_version(output)
    if version is None:
        first = output.strip().splitlines()[0] if output.strip() else "(no output)"
        raise JavaNotFoundError(
            f"{java} -version printed no version (exit code {done.returncode}): {first}"
        )
    return version


def parse_java_version(text: str) -> int | None:
    """The feature version in ``java -version`` output: ``"1.8.0_292"`` is 8,
    ``"17.0.2"`` is 17, ``"21-ea"`` is 21; None when there is none.

    >>> parse_java_version('openjdk version "17.0.15" 2025-04-15')
    17
    >>> parse_java_version('java version "1.8.0_292"')
    8
    """
    match = _VERSION_RE.search(text)
    if match is None:
        return None
    numbers = re.findall(r"\d+", match.group(1))
    if not numbers:
        return None
    major = int(numbers[0])
    if major == 1 and len(numbers) > 1:
        return int(numbers[1])
    return major


def find_java_home(
    *,
    environ: Mapping[str, str] | None = None,
    search_patterns: Sequence[str] = JAVA_SEARCH_PATTERNS,
) -> str:
    """The home folder of a Java 17+ runtime, for ``JAVA_HOME``.

    Looks, in order, at:

    1. ``JAVA_HOME``: when set it must hold ``bin/java`` of version 17 or newer, else this
       raises (Spark would use it, so silently picking another Java would mislead);
    2. ``java`` on ``PATH``, its symlinks resolved (``/usr/bin/java`` ->
       ``/usr/lib/jvm/java-17-openjdk-amd64/bin/java``), the home being the folder above
       ``bin``;
    3. the folders in ``search_patterns`` (:data:`JAVA_SEARCH_PATTERNS` by default), taking
       the newest version that is 17 or newer.

    ``environ`` defaults to ``os.environ``. Raises :class:`JavaNotFoundError`, listing
    what was looked at, when nothing fits.
    """
    env = os.environ if environ is None else environ
    java_home = env.get("JAVA_HOME")
    if java_home:
        return _check_java_home(java_home)

    looked: list[str] = []
    on_path = shutil.which("java", path=env.get("PATH", os.defpath))
    if on_path is None:
        looked.append("no `java` on PATH")
    else:
        home = Path(os.path.realpath(on_path)).parent.parent
        version = _version_or_none(home / "bin" / "java")
        if version is not None and version >= MIN_JAVA_VERSION:
            return str(home)
        looked.append(f"`java` on PATH ({on_path} -> {home}): {_describe(version)}")

    found: dict[Path, int | None] = {}
    for pattern in search_patterns:
        for candidate in sorted(glob.glob(os.path.expanduser(pattern))):
            java = Path(candidate) / "bin" / "java"
            if not java.is_file():
                continue
            home = Path(os.path.realpath(candidate))
            if home not in found:
                found[home] = _version_or_none(home / "bin" / "java")
    usable = [(v, h) for h, v in found.items() if v is not None and v >= MIN_JAVA_VERSION]
    if usable:
        return str(max(usable, key=lambda vh: (vh[0], str(vh[1])))[1])
    if found:
        looked.extend(f"{home}: {_describe(v)}" for home, v in found.items())
    looked.append(f"no other Java in {', '.join(search_patterns) or '(no folders)'}")
    raise JavaNotFoundError(
        f"no Java {MIN_JAVA_VERSION}+ runtime found (Spark needs one). JAVA_HOME is not set; "
        + "; ".join(looked)
        + f". To fix: {_INSTALL_HINT}."
    )


def ensure_java(**kwargs) -> str:
    """Find a Java 17+ runtime with :func:`find_java_home`, set ``os.environ["JAVA_HOME"]``
    to it (so Spark's launcher uses it) and return it."""
    home = find_java_home(**kwargs)
    os.environ["JAVA_HOME"] = home
    return home


def _check_java_home(java_home: str) -> str:
    java = Path(java_home) / "bin" / "java"
    if not java.is_file():
        raise JavaNotFoundError(
            f"JAVA_HOME is {java_home!r}, but {java} does not exist. "
            f"Point JAVA_HOME at a Java {MIN_JAVA_VERSION}+ home (the folder holding bin/java) "
            f"or unset it to let sparkjet search; or {_INSTALL_HINT}."
        )
    try:
        version = java_version(java)
    except JavaNotFoundError as e:
        raise JavaNotFoundError(f"JAVA_HOME is {java_home!r}, but {e}") from None
    if version < MIN_JAVA_VERSION:
        raise JavaNotFoundError(
            f"JAVA_HOME is {java_home!r}, which holds Java {version}; Spark needs Java "
            f"{MIN_JAVA_VERSION} or newer. Point JAVA_HOME at a newer Java or unset it to let "
            f"sparkjet search; or {_INSTALL_HINT}."
        )
    return java_home


def _version_or_none(java: Path) -> int | None:
    try:
        return java_version(java)
    except JavaNotFoundError:
        return None


def _describe(version: int | None) -> str:
    return "does not run or print a version" if version is None else f"Java {version}, too old"
