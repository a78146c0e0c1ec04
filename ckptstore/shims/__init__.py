"""Other libraries' private APIs, one module per library, each the only place
that names them (the layer test refuses a private name of torch, torchdata or
Lightning anywhere else).

A private API can change in any release: each shim states the versions it was
tested with, and ``tests/house/test_shims.py`` pins them against what is
installed, so an upgrade that moves a name fails one test with the fix named,
not a user's save.
"""
