"""The consoles tba prints through: rich's, reading what they are given as plain text.

What a run prints comes largely from outside: exception messages of reward functions, paths,
metric names of a custom task, Ray's and gloo's errors. Rich reads `[...]` as markup and `:name:`
as an emoji code by default, so a message naming `[/srv/judge/server.cc:42]` raised
`rich.errors.MarkupError` and ended the run. Every console tba makes comes from here, with both
turned off: a text is printed as it is, whatever it holds.
"""

from __future__ import annotations

from rich.console import Console


def plain_console(*, stderr: bool = True) -> Console:
    """A console (stderr by default, stdout with `stderr=False`) that prints every text it is
    given as it is: no markup, no emoji codes."""
    return Console(stderr=stderr, markup=False, emoji=False)
