"""Text from the data (label names, folder names) as it may appear in the markdown of run and model artifacts.

Pure: no engine. A label is any folder name: a `|` would split a table's cell, `*` or `_` change the type, `[`
make a link, and `<` open HTML in a renderer that allows it. Each such character is escaped and a line break
becomes a space, so the text reads the same once rendered.
"""

from __future__ import annotations

import re

_SPECIAL = re.compile(r"([\\`*_\[\]|~])")  # what changes text inside a line (# or - matter only where a line starts)


def markdown_text(text: object) -> str:
    """TEXT for a markdown table cell or sentence: markdown's punctuation backslash-escaped, `<`, `>` and `&` as
    entities."""
    plain = " ".join(str(text).split("\n"))
    plain = plain.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
    return _SPECIAL.sub(r"\\\1", plain)
