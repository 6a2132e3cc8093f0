"""The C core's own tests (native/tests), built and run without Python, as CI runs them."""
import os
import shutil
import subprocess
from pathlib import Path

import pytest

NATIVE = Path(__file__).resolve().parent.parent / "native"


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make and a C compiler")
@pytest.mark.skipif(os.environ.get("SPARKJET_CI") == "1",
                    reason="CI ran these tests just before, under AddressSanitizer and UBSan "
                           "(make -C native asan in .ci/run)")
def test_native_suite(tmp_path):
    build = tmp_path / "build"
    result = subprocess.run(
        ["make", "-C", str(NATIVE), "test", f"BUILD={build}"],
        capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert "0 failed" in result.stdout
