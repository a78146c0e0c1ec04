"""``python -m ckptstore.cli``: the same as the ``ckptstore`` command."""

import sys

from .commands import main

sys.exit(main())
