"""tba: Trajectory Balance with Asynchrony, fast off-policy RL post-training of language models.

`TBATrainer` and `TBAConfig` (`tba.api`) are the TRL-shaped entry point for your own data and
reward functions; `tba train` (`tba.cli`) runs the same from YAML configs. The layout follows the
data flow, prompts -> searchers -> buffer -> trainer -> weights -> searchers: `tba.tasks`
(prompts and rewards), `tba.searcher`, `tba.buffer`, `tba.trainer` (with `tba.objectives`, the
losses, and `tba.policy`, models, sampling and log-probs), `tba.runtime` (where searchers run
and how their samples reach the buffer), `tba.loop`, which steps them, and `tba.run`, which
wires them for a run (docs/design.md).
"""

import logging
from typing import TYPE_CHECKING

# bitsandbytes (QLoRA), imported by peft, warns at import on CPUs with AVX512-BF16 that an
# optional package of faster kernels is missing, and at every 8-bit product that it rounds its
# input to float16, as its int8 products do: nothing for a user to act on.
logging.getLogger("bitsandbytes").setLevel(logging.ERROR)

if TYPE_CHECKING:
    from tba.api import TBAConfig, TBATrainer

__version__ = "0.1.0"
__all__ = ["TBAConfig", "TBATrainer"]


def __getattr__(name: str) -> object:
    """`tba.TBATrainer` and `tba.TBAConfig`, imported on first use: importing any module of tba
    (the command line answering a bad value, a searcher process) then costs what that module
    needs, not transformers, peft and datasets (~6 s)."""
    if name in __all__:
        import tba.api

        return getattr(tba.api, name)
    raise AttributeError(f"module 'tba' has no attribute {name!r}")
