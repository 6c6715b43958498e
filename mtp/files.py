"""File modes of the weights we write.

safetensors (0.8) writes every file owner-only (0600), whatever the umask, while the JSON and tokenizer files
beside it follow the umask. A checkpoint exported by one user and served by another (a service account, a
container with its own uid, a shared model directory) then fails on the weights alone, with a permission
error far from the export that caused it. So after writing, weights get the mode any other new file would get.
"""

from __future__ import annotations

import os
from pathlib import Path


def current_umask() -> int:
    """The process umask, read without changing it where /proc says it (os.umask can only set and return)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def share_weights(directory: str | Path) -> None:
    """Give every *.safetensors file under `directory` the umask's mode for new files (only ever widening)."""
    mode = 0o666 & ~current_umask()
    for path in Path(directory).rglob("*.safetensors"):
        if path.is_file() and not path.is_symlink():
            old = path.stat().st_mode & 0o777
            if old | mode != old:
                path.chmod(old | mode)
