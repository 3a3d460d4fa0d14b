"""Kept for ``sitecustomize.py`` lines written by fakegrad_patch 0.3 and earlier.

Those lines call ``__import__("fakegrad_patch._startup")._startup.activate("sitecustomize")``
(``python -m fakegrad_patch sitecustomize --append`` wrote them into users' files). The start-up
logic now lives in :mod:`fakegrad_patch._activation.startup`; this module only forwards to it, so
an old line keeps activating exactly as a new one does (tests/test_layout.py runs one).
"""

from __future__ import annotations

from ._activation.startup import activate, hook_module, hook_ran, sitecustomize_line

__all__ = ["activate", "hook_module", "hook_ran", "sitecustomize_line"]
