"""Quiet logs: we configure these libraries ourselves, so their warnings and progress bars are
noise. Called by the CLI and by every searcher process."""

from __future__ import annotations

import os
import warnings


def quiet_libraries() -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    warnings.filterwarnings("ignore", category=UserWarning)
    # peft asks transformers a question transformers 5 has renamed; nothing for users to do.
    warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated")
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
