"""pytest integration for fakegrad_patch (registered through the ``pytest11`` entry point).

Inert unless used: importing this module imports neither torch nor structlog.
"""

from __future__ import annotations
