"""A griffe extension that lets the API reference read the package's docstrings as written.

The docstrings are meant for ``help()`` and editors as much as for the site:
they use Sphinx roles (``:class:`~celery_redlock.calls.options.LockOptions```) and
document module constants with ``#:`` comments, as Celery and redis-py do.
MkDocs renders Markdown, so this extension, loaded by ``mkdocs.yml``:

- turns each role into a code span naming its target (``~`` keeps only the
  last dotted part, as in Sphinx);
- gives an attribute without a docstring the ``#:`` comment lines right
  above its assignment.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

__all__ = ["SphinxDocstrings"]

# :role:`target` or :role:`title <target>`; the role may be namespaced (:py:func:).
_ROLE = re.compile(r":(?:[a-z]+:)?[a-z]+:`(?:[^`<]*<)?~?([^`>]+)>?`")
_TILDE_ROLE = re.compile(r":(?:[a-z]+:)?[a-z]+:`~([^`]+)`")


def markdown_roles(text: str) -> str:
    """Return ``text`` with every Sphinx role replaced by a code span of its target."""
    text = _TILDE_ROLE.sub(lambda match: f"`{match.group(1).rsplit('.', 1)[-1]}`", text)
    return _ROLE.sub(lambda match: f"`{match.group(1)}`", text)


def comment_above(lines: list[str], lineno: int) -> str | None:
    """Return the ``#:`` comment block ending right above line ``lineno`` (1-based)."""
    found: list[str] = []
    index = lineno - 2
    while index >= 0 and lines[index].lstrip().startswith("#:"):
        found.append(lines[index].lstrip()[2:].strip())
        index -= 1
    return "\n".join(reversed(found)) or None


class SphinxDocstrings(griffe.Extension):
    """Rewrite Sphinx roles and attach ``#:`` comments once the object tree is built."""

    def on_object(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        """Fix up the docstring of one object of any kind."""
        if obj.is_attribute and obj.docstring is None and obj.lineno is not None:
            try:
                lines = list(obj.lines_collection[obj.filepath])  # type: ignore[index]
            except (KeyError, TypeError):
                lines = []
            comment = comment_above(lines, obj.lineno) if lines else None
            if comment:
                obj.docstring = griffe.Docstring(comment, lineno=obj.lineno, parent=obj)
        if obj.docstring is not None:
            obj.docstring.value = markdown_roles(obj.docstring.value)
