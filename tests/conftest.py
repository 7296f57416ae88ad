"""Shared test helpers in this folder (such as ``lisp_cases``) import by name from any area."""

import sys
from pathlib import Path

_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)
