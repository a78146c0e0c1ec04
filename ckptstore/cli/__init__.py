"""The ``ckptstore`` command line: :mod:`.main` (the commands and the parser)
and :mod:`.output` (what it prints, and how it fails)."""

from .main import main

__all__ = ["main"]
