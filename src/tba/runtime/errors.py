"""Errors of the runtime, kept free of heavy imports so that the CLI can catch them cheaply."""


class SearcherError(RuntimeError):
    """A searcher failed in a way the run cannot recover from; the message says which and why."""
