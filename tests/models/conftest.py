"""Make `tests.tiny_checkpoints` importable however pytest was started.

With rootdir-relative imports pytest puts only this folder on `sys.path`; the shared builder
lives one level up, so the repository root is added here.
"""

import sys
from pathlib import Path

_ROOT = str(Path(__file__).resolve().parents[2])
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)
