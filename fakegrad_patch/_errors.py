"""Exception and warning types (standard library only)."""

from __future__ import annotations


class FakeGradPatchWarning(UserWarning):
    """fakegrad_patch could not do something it was asked to; the program continues."""


class FakeGradError(RuntimeError):
    """A fake gradient reached a real leaf without real values under ``on_missing="error"``.

    Raised from inside backward; the leaf keeps the gradient it had before.
    """
