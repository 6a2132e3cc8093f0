"""A downstream extension cimports sparkjet's nogil C API from the installed package,
builds against sparkjet.get_include(), and gets the same partitions as Python."""
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pyarrow as pa

import sparkjet

PYX = '''
from libc.stdint cimport int32_t, int64_t
from libc.string cimport memset
from sparkjet.libsparkjet cimport sj_column, sj_status, SJ_KEY_INT64, SJ_OK
from sparkjet.hash cimport murmur3_32, partition_column

def partitions(const int64_t[::1] values, int32_t count):
    cdef sj_column col
    memset(&col, 0, sizeof(col))
    col.kind = SJ_KEY_INT64
    col.length = values.shape[0]
    col.values = &values[0]
    col.values_size = values.shape[0] * 8
    out = bytearray(values.shape[0] * 4)
    cdef unsigned char[::1] view = out
    cdef int64_t err = -1
    cdef sj_status st
    with nogil:
        st = partition_column(&col, count, <int32_t *>&view[0], &err)
    if st != SJ_OK:
        raise ValueError(st)
    return bytes(out)

def hello_hash():
    return murmur3_32(b"hello", 5, 0)
'''

SETUP = '''
import sparkjet
from Cython.Build import cythonize
from setuptools import Extension, setup
setup(name="downstream", ext_modules=cythonize(
    [Extension("downstream", ["downstream.pyx"], include_dirs=[sparkjet.get_include()])],
    compiler_directives={"language_level": "3"}))
'''


def test_get_include_has_the_headers():
    include = Path(sparkjet.get_include())
    assert (include / "sparkjet" / "hash.h").is_file()
    assert (include / "sparkjet" / "status.h").is_file()


def test_downstream_extension_cimports_the_c_api(tmp_path):
    (tmp_path / "downstream.pyx").write_text(textwrap.dedent(PYX))
    (tmp_path / "setup.py").write_text(SETUP)
    build = subprocess.run(
        [sys.executable, "setup.py", "build_ext", "--inplace"],
        cwd=tmp_path, capture_output=True, text=True, timeout=600,
    )
    assert build.returncode == 0, build.stdout[-3000:] + build.stderr[-3000:]
    values = np.arange(-500, 500, dtype=np.int64) * 1_000_003
    code = (
        "import sys, numpy as np; sys.path.insert(0, '.'); import downstream;"
        "v = np.arange(-500, 500, dtype=np.int64) * 1_000_003;"
        "sys.stdout.buffer.write(downstream.partitions(v, 271));"
        "print(downstream.hello_hash(), file=sys.stderr)"
    )
    run = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, timeout=120)
    assert run.returncode == 0, run.stderr.decode()
    got = np.frombuffer(run.stdout, dtype=np.int32).tolist()
    assert got == sparkjet.partition_ids(pa.array(values)).to_pylist()
    assert int(run.stderr.decode().strip()) == 0x248BFA47
