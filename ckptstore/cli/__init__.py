"""The ``ckptstore`` command line: :mod:`.commands` (the commands and the parser)
and :mod:`.output` (what it prints, and how it fails)."""

from .commands import main

__all__ = ["main"]
