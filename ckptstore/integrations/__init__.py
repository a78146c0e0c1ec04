"""Framework plug-ins: ``ckptstore.integrations.lightning`` and ``ckptstore.integrations.hf``.

Each module imports its framework when it is imported; this package and the
core import neither.
"""
