"""TRL's `GRPOConfig` arguments, read as tba settings: a TRL GRPO script becomes a tba script by
changing the import, the trainer class and the config class.

`TBAConfig(learning_rate=1e-5, num_generations=4, ...)` takes TRL's names beside tba's own
sections. Each of GRPOConfig's arguments (TRL 1.x, and the older names scripts still use) is one
of:

- **mapped**: it sets the tba settings that mean the same (`learning_rate` ->
  `train.learning_rate`; the batch arguments together, `batch_settings`);
- **without effect**: accepted, and listed once when the run starts, because it only tunes the
  Hugging Face Trainer's plumbing (data loaders, logging, devices, kernels) or GRPO's own loss,
  which tba replaces by TB;
- **refused** unless left at its default: one line saying why, because it would change what is
  trained and tba cannot do it; quietly training something else would be worse.

One idea a module, each over the ones it names:

- `kinds`: the three kinds of entry (`Mapped`, `Ignored`, `Refused`) and the table's builders;
- `converters`: one argument's value as tba settings (dtypes, schedules, optimizer names,
  trackers, a quantization_config as the `quantization` section);
- `batches`: TRL's six batch arguments together as tba's batch (`batch_settings`);
- `table`: every argument and its entry (`TRL_ARGUMENTS`), and TRL's defaults (`TRL_DEFAULTS`);
- `reading`: TRL-named arguments as tba settings, with what set each (`from_trl`);
- `merge`: those settings into a config's data beside the script's own sections
  (`merge_arguments`, which `tba.api.TBAConfig` calls);
- `reference`: docs/trl.md (`reference_page`, `tba config --trl > docs/trl.md`).
"""

from tba.trl_args.batches import BATCH_ARGUMENTS, batch_settings
from tba.trl_args.converters import TRACKERS, quantization_settings
from tba.trl_args.kinds import Ignored, Mapped, Refused
from tba.trl_args.merge import TOGETHER, merge_arguments, merge_trl
from tba.trl_args.reading import TrlSettings, from_trl
from tba.trl_args.reference import reference_page
from tba.trl_args.table import TRL_ARGUMENTS, TRL_DEFAULTS

__all__ = [
    "BATCH_ARGUMENTS",
    "TOGETHER",
    "TRACKERS",
    "TRL_ARGUMENTS",
    "TRL_DEFAULTS",
    "Ignored",
    "Mapped",
    "Refused",
    "TrlSettings",
    "batch_settings",
    "from_trl",
    "merge_arguments",
    "merge_trl",
    "quantization_settings",
    "reference_page",
]
