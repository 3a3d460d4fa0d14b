"""Failures that wait for a fix outside these tests (issue 38): one reason per cause, named
after the op and the run that showed it. A test marks itself ``xfail(strict=False)`` with one
of them for the devices and kernels the cause applies to (:func:`xfail`), so a fix shows as
XPASS rather than failing, and the entry can then be removed here.

Observed on one NVIDIA H200 with torch 2.11.0+cu130 (the issue's first GPU run) or on the CPU
with torch 2.13.0 and 2.14.1; "expected" marks a case that takes the same op as an observed one
and has not run yet. ``tests/cuda_check.py`` lists every XFAIL and XPASS of a GPU run with its
reason.
"""

from __future__ import annotations

import pytest

H200 = "H200, torch 2.11.0+cu130"

#: buffers="write_back" of BatchNorm's running statistics on CUDA.
BN_WRITE_BACK_CUDA = (
    "buffers=\"write_back\" on CUDA: BatchNorm's running_mean ends about 1.5x eager's update "
    f"({H200})"
)


def xfail(request: pytest.FixtureRequest, reason: str) -> None:
    """Mark the running test ``xfail(strict=False)`` with ``reason`` (call it before the part
    that fails)."""
    request.applymarker(pytest.mark.xfail(strict=False, reason=reason))
