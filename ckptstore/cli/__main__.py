"""``python -m ckptstore.cli``: the same as the ``ckptstore`` command."""

import sys

from .main import main

sys.exit(main())
