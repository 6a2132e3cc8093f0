"""Declares the extension modules; everything else lives in pyproject.toml.

SPARKJET_DEBUG=1 builds without optimisation and with assertions;
SPARKJET_SANITIZE=address (or address,undefined) adds the sanitizers.
"""
import os
import shutil
from pathlib import Path

from Cython.Build import cythonize
from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext
from setuptools.command.build_py import build_py

ROOT = Path(__file__).parent
NATIVE_SOURCES = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "native" / "src").glob("*.c"))


def compiler_flags():
    flags = ["-std=c99", "-Wall", "-Wno-unused-function"]
    link = []
    sanitize = os.environ.get("SPARKJET_SANITIZE", "").strip()
    if os.environ.get("SPARKJET_DEBUG") == "1" or sanitize:
        flags += ["-O1", "-g", "-fno-omit-frame-pointer", "-UNDEBUG"]
    else:
        flags += ["-O3"]
    if sanitize:
        flags.append(f"-fsanitize={sanitize}")
        link.append(f"-fsanitize={sanitize}")
    return flags, link


class build_py_with_headers(build_py):
    """Ships the C headers and the Cython declarations inside the package, so
    that sparkjet.get_include() and `cimport sparkjet.hash` work once installed."""

    def run(self):
        super().run()
        package = Path(self.build_lib) / "sparkjet"
        include = package / "include" / "sparkjet"
        include.mkdir(parents=True, exist_ok=True)
        for header in (ROOT / "native" / "include" / "sparkjet").glob("*.h"):
            shutil.copy(header, include / header.name)
        for pxd in (ROOT / "bindings" / "sparkjet").glob("*.pxd"):
            shutil.copy(pxd, package / pxd.name)


class build_ext_always(build_ext):
    """Rebuilds every time: pip builds in the source tree, and objects left in build/ by
    an optimised build must not stand in for a debug or sanitizer one (or the reverse)."""

    def initialize_options(self):
        super().initialize_options()
        self.force = True


cflags, ldflags = compiler_flags()
# One extension holds the whole C core: _native.pyx includes a .pxi per area of native/,
# so the core is compiled once and every binding shares its state (the hash kernel chosen
# by select_kernel reaches Merkle hashing too).
extensions = [
    Extension(
        "sparkjet._native",
        ["bindings/sparkjet/_native.pyx", *NATIVE_SOURCES],
        include_dirs=["native/include", "native/src", "bindings"],
        extra_compile_args=cflags,
        extra_link_args=ldflags,
    )
]

setup(
    ext_modules=cythonize(
        extensions,
        include_path=["bindings"],
        compiler_directives={"language_level": "3", "boundscheck": False, "wraparound": False},
    ),
    cmdclass={"build_py": build_py_with_headers, "build_ext": build_ext_always},
)
