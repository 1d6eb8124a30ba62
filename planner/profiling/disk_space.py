"""Free space on the disk spill files go to: one rule for ``megatrain-plan`` and ``megatrain-train``. Pure stdlib."""
from __future__ import annotations

import os
import shutil


def free_bytes(path: str) -> int:
    """Free bytes on the disk that holds ``path``, or will hold it once it is made: the disk of its nearest
    folder that exists (``path`` itself, else its parent, and so on up to the root)."""
    folder = os.path.abspath(path)
    while not os.path.isdir(folder):
        folder = os.path.dirname(folder)
    return int(shutil.disk_usage(folder).free)
