"""Small filesystems for storage failures: a read-only one, and one that fills up (tmpfs
mounts; as root, permissions do not stop writes, so only a mount makes them fail)."""
import contextlib
import os
import subprocess

import pytest


@contextlib.contextmanager
def tmpfs(path, size: str = "64k", read_only: bool = False):
    """A tmpfs of ``size`` mounted at ``path`` (made if missing) while the block runs; skips
    the test where mounting is refused (not root, a container without CAP_SYS_ADMIN)."""
    os.makedirs(path, exist_ok=True)
    options = f"size={size}" + (",ro" if read_only else "")
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({mounted.stderr.strip() or 'refused'}): "
                    "a read-only or full filesystem needs one (as root, chmod does not stop "
                    "writes)")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)
