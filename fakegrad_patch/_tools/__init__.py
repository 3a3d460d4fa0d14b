"""User tools built on the core: ``verify`` (with its report and command line), ``doctor``, the
``demo`` and ``materialize``. Imported only when used."""
