"""mkdocs hook: the docstrings use Sphinx roles (:class:`X`, :meth:`Y`); the
python handler renders them as ":class:" followed by code. Keep the code, drop
the role, so the API pages read as prose."""

from __future__ import annotations

import re
from typing import Any

_ROLE = re.compile(r":(?:class|meth|attr|mod|func|exc|data|obj|py:\w+):(?=<code>)")


def on_page_content(html: str, **kwargs: Any) -> str:
    return _ROLE.sub("", html)
