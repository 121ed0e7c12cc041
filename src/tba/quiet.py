"""Quiet logs: we configure these libraries ourselves, so their warnings and progress bars are
noise. Called by the CLI and by every searcher process."""

from __future__ import annotations

import os
import warnings


def quiet_libraries() -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    warnings.filterwarnings("ignore", category=UserWarning)
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
