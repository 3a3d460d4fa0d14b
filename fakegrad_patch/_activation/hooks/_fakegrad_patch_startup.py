"""Start-up activation: ``FAKEGRAD_PATCH=1 python app.py`` with no change to the program.

Installed at the root of site-packages as the top-level module ``_fakegrad_patch_startup`` (hatch
``force-include``), next to ``fakegrad_patch.pth`` and ``fakegrad_patch.start`` which call
:func:`init`. Why not a module inside the package: importing ``fakegrad_patch.<anything>`` first
runs ``fakegrad_patch/__init__``, which imports wrapt and installs the patch, while a PEP 829
``.start`` entry point (Python 3.15+) is imported on every start, so the check of the variable has
to live in a module that imports nothing of ours. Standard library only (``os``, ``sys``: both
already loaded by ``site``). ``fakegrad_patch._activation.startup`` gives the package access to this
module
(and loads it from this file when the package is reached through PYTHONPATH).

The ``.pth`` line checks the variable itself before importing even this module, so with the
variable unset, empty or off an interpreter start costs reading one short ``.pth`` line.

With the variable on, nothing but this module is loaded until torch's import begins: the hook
arms a tiny ``sys.meta_path`` finder (:class:`TorchImportHook`) that, on ``find_spec("torch")``,
removes itself, imports ``fakegrad_patch`` (which registers wrapt's post-import hook for torch) and
resolves torch through the meta path as it is then, so wrapt's finder wraps torch's loader and
the patch applies when torch has finished importing. ``FAKEGRAD_PATCH=1`` is often exported for a
whole shell or job: a process that never imports torch must not pay for wrapt (which imports
asyncio and importlib.metadata) or the package.

Guarantees (docs/activation.md): values are parsed strictly; anything unknown prints one line on
stderr and activates nothing; an invalid setting (``FAKEGRAD_ON_MISSING``, ``FAKEGRAD_TRACE_*``)
is reported at start; no exception leaves :func:`init`; a ``.pth`` seen twice (or the variable
plus an explicit ``import fakegrad_patch``) applies the patch once; nothing is ever written to
stdout.
"""

import os
import sys

#: The switch. Values are case-insensitive and stripped of surrounding blanks.
ENV = "FAKEGRAD_PATCH"
ON_VALUES = ("1", "true", "yes", "on")
OFF_VALUES = ("", "0", "false", "no", "off")

#: This module's name at the root of site-packages (see the module docstring).
TOPLEVEL_MODULE = "_fakegrad_patch_startup"
#: Start-up hook file names at the root of site-packages. PEP 829: a ``.start`` file with the
#: same stem as a ``.pth`` file disables the ``.pth``'s import lines on Python 3.15+, so the
#: two never both run.
PTH_NAME = "fakegrad_patch.pth"
START_NAME = "fakegrad_patch.start"

#: The single line of ``fakegrad_patch.pth``. ``os`` is already imported by ``site``; with the
#: switch off nothing else is imported. tests/test_activation.py pins the shipped file to this.
PTH_LINE = (
    f'import os; os.environ.get("{ENV}", "").strip().lower() in {OFF_VALUES!r} '
    f'or __import__("{TOPLEVEL_MODULE}").init()'
)
#: The entry point of ``fakegrad_patch.start`` (PEP 829 ``pkg.mod:callable``).
START_ENTRY = f"{TOPLEVEL_MODULE}:init"

#: Marker ending the sitecustomize line, so ``--append`` can find (and upgrade) it.
SITECUSTOMIZE_MARKER = "# fakegrad_patch start-up hook"

#: ``FAKEGRAD_ON_MISSING`` and its valid values, duplicated from ``fakegrad_patch._config`` (this
#: module may not import the package); tests/test_settings_validation.py pins the two to each
#: other.
ENV_ON_MISSING = "FAKEGRAD_ON_MISSING"
ON_MISSING_VALUES = ("drop", "zeros", "error", "keep")
#: The other environment settings the package validates at import, as this module checks them
#: (values after stripping blanks and lower-casing; ``INT``: decimal digits, ``_`` allowed).
#: Duplicated from the table in ``fakegrad_patch._config`` (``SETTINGS``) and pinned to it by
#: tests/test_settings_validation.py. ``FAKEGRAD_TRACE`` (a path) is never invalid as a value.
INT = "an integer"
ENV_CHECKS = {
    ENV_ON_MISSING: ON_MISSING_VALUES,
    "FAKEGRAD_TRACE_LEVEL": ("debug", "info", "warning", "error", INT),
    "FAKEGRAD_TRACE_MAX_BYTES": (INT,),
    "FAKEGRAD_TRACE_JSON": ("auto", "stdlib"),
    # ``write-back`` is the parser's spelling of ``write_back`` with a hyphen
    "FAKEGRAD_BUFFERS": ("upstream", "write_back", "write-back"),
    "FAKEGRAD_PROPAGATION": ("fast", "repair", "upstream"),
}
#: The module whose import triggers the activation.
TRIGGER = "torch"
#: How many characters of a bad value a message echoes (the rest is counted, not shown).
ECHO_LIMIT = 60

_PREFIX = "fakegrad_patch: "

#: What happened in this process (read by ``python -m fakegrad_patch doctor`` and the tests).
#: ``handled``: the hook ran once already (a second ``.pth`` or call is a no-op);
#: ``value``: the raw variable seen; ``deferred``: waiting for the end of ``site``;
#: ``waiting_for_torch``: the import hook is armed (nothing imported yet);
#: ``activated_by``: "pth" / "sitecustomize" once ``fakegrad_patch`` was imported and installed;
#: ``error``: the one line printed when activation failed (the patch is not active);
#: ``warning``: the one line printed when activation succeeded with a fallback (``-W error``
#: turned the invalid-``FAKEGRAD_ON_MISSING`` warning into an exception; ``drop`` is in force).
state: dict = {
    "handled": False,
    "value": None,
    "deferred": False,
    "waiting_for_torch": False,
    "activated_by": None,
    "error": None,
    "warning": None,
}


def parse(raw: "str | None") -> "bool | None":
    """``True`` for 1/true/yes/on, ``False`` for unset/empty/0/false/no/off, ``None`` otherwise."""
    value = (raw or "").strip().lower()
    if value in ON_VALUES:
        return True
    if value in OFF_VALUES:
        return False
    return None


def shown(raw: str, limit: int = ECHO_LIMIT) -> str:
    """``raw`` as a message echoes it: ``ascii()`` (control characters and anything a terminal
    could interpret are escaped), at most ``limit`` characters of it, the length if cut."""
    if len(raw) <= limit:
        return ascii(raw)
    return f"{raw[:limit]!a}... ({len(raw)} characters)"


def invalid_message(raw: str) -> str:
    """The one stderr line for a value that is neither on nor off."""
    return (
        f"{_PREFIX}{ENV}={shown(raw)} not understood (expected one of "
        f"{'/'.join(ON_VALUES)} or {'/'.join(v for v in OFF_VALUES if v)}); not activated"
    )


def sitecustomize_line() -> str:
    """The line users add to their own ``sitecustomize.py`` when ``.pth`` files are not processed
    (package reached through PYTHONPATH). Same checks as the ``.pth`` line, with the parsing
    inline because this route imports ``fakegrad_patch._activation.startup`` (hence the package,
    which installs the patch) and must only do so for an "on" value. Printed and appended by
    ``python -m fakegrad_patch sitecustomize [--append [PATH]]``. Like :func:`_say`, it never
    writes to stdout (``print(file=None)`` would, with stderr closed) and echoes a bounded,
    escaped value."""
    return (
        f'import os, sys; _fgp = os.environ.get("{ENV}", "").strip().lower(); '
        f"_fgp in {OFF_VALUES!r} or ("
        f'__import__("fakegrad_patch._activation.startup", None, None, ("activate",))'
        '.activate("sitecustomize") '
        f"if _fgp in {ON_VALUES!r} else "
        f'(print("{_PREFIX}{ENV}=%s%s not understood; not activated" % '
        f'(ascii(_fgp[:{ECHO_LIMIT}]), "..." * (len(_fgp) > {ECHO_LIMIT})), file=sys.stderr) '
        "if sys.stderr else None))  "
        f"{SITECUSTOMIZE_MARKER}"
    )


def stderr_usable() -> bool:
    """True when ``sys.stderr`` is a stream we may write to without landing in stdout.

    With fd 2 closed (``2>&-``) Python sets ``sys.stderr`` to None, and ``print(file=None)``
    writes to *stdout*, corrupting the program's output. A stream whose descriptor is closed, or
    is stdout's own descriptor (fd 2 reused by something that is not the original stderr), is
    refused too; ``2>&1`` (two descriptors, one file) is the user's choice and allowed.
    """
    stream = sys.stderr
    if stream is None or stream is sys.stdout:
        return False
    try:
        fd = stream.fileno()
    except Exception:
        return True  # not backed by a descriptor (a host's StringIO, say): it is not stdout
    try:
        os.fstat(fd)
    except OSError:
        return False
    try:
        out = sys.stdout.fileno() if sys.stdout is not None else 1
    except Exception:
        out = 1
    return fd != out


def _say(message: str) -> None:
    """One line on stderr, never raising, never on stdout (nothing, when stderr is unusable)."""
    # Not contextlib.suppress: importing contextlib would cost every start-up.
    try:
        if stderr_usable():
            sys.stderr.write(message + "\n")
            sys.stderr.flush()
    except Exception:
        pass


def init() -> None:
    """Entry point of ``fakegrad_patch.pth`` and ``fakegrad_patch.start``. Never raises."""
    try:
        _init()
    except Exception as exc:
        state["error"] = (
            f"{_PREFIX}start-up hook failed ({type(exc).__name__}: {exc}); not activated"
        )
        _say(state["error"])


def _init() -> None:
    if state["handled"]:
        return  # the same hook seen twice (two site dirs, .pth and .start, ...)
    state["handled"] = True
    raw = os.environ.get(ENV)
    state["value"] = raw
    flag = parse(raw)
    if flag is None:
        _say(invalid_message(raw or ""))
        return
    if not flag:
        return
    if _inside_site_main() and _defer_to_end_of_site():
        state["deferred"] = True
        return
    _arm()


def setting_invalid(env: str, raw: "str | None") -> bool:
    """True when ``env=raw`` is set to something ``fakegrad_patch._config`` rejects (same
    normalisation: surrounding blanks, case)."""
    allowed = ENV_CHECKS.get(env)
    value = (raw or "").strip().lower()
    if allowed is None or not value:
        return False
    if value in allowed:
        return False
    digits = value.replace("_", "")
    return not (INT in allowed and digits.isdigit() and digits.isascii())


def settings_invalid() -> bool:
    """True when any setting the package checks at import is invalid."""
    return any(setting_invalid(env, os.environ.get(env)) for env in ENV_CHECKS)


def _arm() -> None:
    """Activate when torch's import begins; at once when torch is already imported, or when the
    settings are invalid (so that the warning comes at start, where the user looks for it)."""
    if TRIGGER in sys.modules or settings_invalid():
        activate("pth")
        return
    state["waiting_for_torch"] = True
    sys.meta_path.insert(0, TorchImportHook())  # type: ignore[arg-type]  # duck-typed finder


class TorchImportHook:
    """A ``sys.meta_path`` finder that acts once, when ``import torch`` (in any form: ``import
    torch.nn``, ``importlib.import_module``, in any thread) starts looking for torch.

    It removes itself, runs :func:`activate` (``import fakegrad_patch``, whose ``install()``
    registers wrapt's post-import hook for torch and puts wrapt's finder on the meta path), then
    resolves torch through the meta path as it is now: wrapt's finder wraps torch's loader, so
    the patch applies when torch has finished importing, exactly as with ``import fakegrad_patch``
    before ``import torch``. If activation fails, torch is found as it would have been.
    ``find_spec`` runs under the import lock, so two threads cannot both activate.
    """

    def find_spec(self, name: str, path: object = None, target: object = None) -> object:
        if name != TRIGGER:
            return None
        try:
            sys.meta_path.remove(self)  # type: ignore[arg-type]
        except ValueError:
            return None  # already fired (another finder asked again)
        state["waiting_for_torch"] = False
        activate("pth")
        for finder in list(sys.meta_path):
            find_spec = getattr(finder, "find_spec", None)
            if find_spec is None:
                continue
            spec = find_spec(name, path, target)
            if spec is not None:
                return spec
        return None


def _inside_site_main() -> bool:
    """True while ``site.main()`` is processing ``.pth`` files (i.e. at interpreter start)."""
    site = sys.modules.get("site")
    code = getattr(getattr(site, "main", None), "__code__", None)
    getframe = getattr(sys, "_getframe", None)
    if code is None or getframe is None:
        return False
    frame = getframe(1)
    while frame is not None:
        if frame.f_code is code:
            return True
        frame = frame.f_back
    return False


def _defer_to_end_of_site() -> bool:
    """Run the activation as the last step of ``site``, once sys.path is complete.

    ``.pth`` files are processed in name order, part way through site initialisation: a later
    ``.pth`` may be what makes wrapt or torch importable. ``site.main()`` ends by loading
    ``sitecustomize`` then, when user site-packages are enabled, ``usercustomize``; both loaders
    are wrapped (plain closures: wrapt cannot be imported yet), the first acting only when the
    second will not run. Same approach as autowrapt's bootstrap.
    """
    site = sys.modules.get("site")
    exec_site = getattr(site, "execsitecustomize", None)
    exec_user = getattr(site, "execusercustomize", None)
    if site is None or not callable(exec_site) or not callable(exec_user):
        return False

    def execsitecustomize() -> None:
        try:
            exec_site()
        finally:
            if not getattr(site, "ENABLE_USER_SITE", False):
                _activate_deferred()

    def execusercustomize() -> None:
        try:
            exec_user()
        finally:
            _activate_deferred()

    site.execsitecustomize = execsitecustomize  # type: ignore[attr-defined]
    site.execusercustomize = execusercustomize  # type: ignore[attr-defined]
    return True


def _activate_deferred() -> None:
    if state["deferred"]:
        state["deferred"] = False
        _arm()


#: How many invalid settings ``-W error`` can turn into exceptions during one activation.
_MAX_SETTING_ERRORS = 16


def activate(origin: str) -> bool:
    """Import ``fakegrad_patch`` (which validates the settings, then installs the patch, lazily
    if torch is still importing). Returns True when the package installed itself; on failure
    prints one line on stderr and returns False. What is printed always agrees with the state:
    under ``-W error`` an invalid setting's warning becomes an exception out of the import; it is
    reported as such (one line per setting) and the import is retried (each setting is reported
    once per process, and its default used), so the patch is active with the defaults."""
    reported: list[str] = []
    for _ in range(_MAX_SETTING_ERRORS):
        try:
            import fakegrad_patch

            fakegrad_patch.install()
            break
        except Exception as exc:
            if not _is_settings_warning(exc):
                state["error"] = (
                    f"{_PREFIX}not activated ({origin}): {type(exc).__name__}: {exc}; "
                    "the program continues without the patch"
                )
                _say(state["error"])
                return False
            reported.append(f"{exc} ({type(exc).__name__}; the patch is active)")
            _say(reported[-1])
    else:
        state["error"] = f"{_PREFIX}not activated ({origin}): too many invalid settings"
        _say(state["error"])
        return False
    state["handled"] = True
    if state["activated_by"] is None:
        state["activated_by"] = origin
    if reported:
        state["warning"] = "\n".join(reported)
    return True


def _is_settings_warning(exc: BaseException) -> bool:
    """Is ``exc`` fakegrad_patch's own warning raised as an exception (``-W error``)?"""
    errors = sys.modules.get("fakegrad_patch._errors")
    category = getattr(errors, "FakeGradPatchWarning", None)
    return isinstance(category, type) and isinstance(exc, category)
