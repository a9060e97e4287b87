"""Warnings of both faces that point at the user's line: attributed to the innermost frame outside torch's and cgdp's
source (``skip_file_prefixes`` from Python 3.12, the same walk by hand before), since no fixed ``stacklevel`` fits."""
from __future__ import annotations

import os
import sys
import warnings

import torch

_SKIP = (os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep,  # cgdp/engine/
         os.path.dirname(os.path.abspath(torch.__file__)) + os.sep)


def warn_user(message: str, category: type[Warning] = UserWarning) -> None:
    if sys.version_info >= (3, 12):
        warnings.warn(message, category, skip_file_prefixes=_SKIP)
        return
    level, frame = 2, sys._getframe(1)  # stacklevel 2: the caller of warn_user
    while frame is not None and frame.f_code.co_filename.startswith(_SKIP):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level)
