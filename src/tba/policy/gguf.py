"""GGUF files (llama.cpp's format) as model sources.

`policy.model` may name a `.gguf` file, or a directory holding exactly one `.gguf` file and no
`config.json`. transformers reads it (`from_pretrained(directory, gguf_file=name)`, for the model
and for the tokenizer, which the file carries with its chat template), needing the `gguf`
package (`pip install "tba[gguf]"`). Every weight is dequantized while it loads, in the dtype
asked for, and the model is then copied into a plain one: transformers counts a GGUF-loaded model
as quantized (it refuses `save_pretrained`, and tba would treat it as a QLoRA base), while what
it holds are ordinary dense weights (versions that know `GgufConfig(dequantize=True)` load a plain
model at once, and nothing is copied). The plain model saves as safetensors that any loader
reads, and trains, syncs and checkpoints like any other model.

Every process that loads the policy (the trainer and its ranks, the searchers in-process and in
Ray, the reference model) goes through `tba.policy.model.load_model` and
`tba.policy.tokenizer.load_tokenizer`, which send a GGUF source here.
"""

from __future__ import annotations

import copy
import importlib.util
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from tba.errors import ConfigError, first_line

SUFFIX = ".gguf"
MAGIC = b"GGUF"  # the first bytes of every GGUF file


def gguf_file(path: str | Path, key: str = "policy.model") -> Path | None:
    """The GGUF file `path` names: the file itself, or the one `.gguf` file of a directory
    without `config.json` (a directory with several is refused: name one). None when `path`
    names no GGUF file (a model directory, a Hub id, a name)."""
    local = Path(path).expanduser()
    if local.is_file():
        return local if local.suffix.lower() == SUFFIX else None
    if not local.is_dir() or (local / "config.json").exists():
        return None
    files = sorted(p for p in local.iterdir() if p.suffix.lower() == SUFFIX and p.is_file())
    if len(files) > 1:
        names = ", ".join(p.name for p in files[:4]) + (", ..." if len(files) > 4 else "")
        raise ConfigError(f"{key}: {local} holds {len(files)} GGUF files ({names}) and no "
                          "config.json: name the file to load")  # fmt: skip
    return files[0] if files else None


def require_gguf(file: Path, key: str = "policy.model") -> None:
    """transformers reads GGUF files with the `gguf` package, an optional dependency."""
    if importlib.util.find_spec("gguf") is None:
        raise ConfigError(f"{key}: {file} is a GGUF file, which needs the gguf package: "
                          "pip install gguf (or tba[gguf])")  # fmt: skip


def load_gguf_model(
    file: Path, dtype: torch.dtype = torch.float32, key: str = "policy.model"
) -> PreTrainedModel:
    """The causal LM in the GGUF file `file`, dequantized into a plain model in `dtype`, on the
    CPU. One that transformers cannot read (an architecture it has no GGUF mapping for, a damaged
    file) is one line naming `key`."""
    require_gguf(file, key)
    try:
        loaded = AutoModelForCausalLM.from_pretrained(
            file.parent, gguf_file=file.name, dtype=dtype, use_kernels=False, **_dequantized()
        )
    except Exception as error:  # unknown architecture, damaged file: one line to a user
        raise ConfigError(_unreadable(file, key, "the GGUF file", error)) from None
    return plain_copy(loaded, dtype)


def load_gguf_tokenizer(file: Path, key: str = "policy.model"):
    """The tokenizer (and chat template) stored in the GGUF file `file`."""
    require_gguf(file, key)
    try:
        return AutoTokenizer.from_pretrained(file.parent, gguf_file=file.name)
    except Exception as error:
        raise ConfigError(_unreadable(file, key, "a tokenizer from the GGUF file", error)) from None


def _unreadable(file: Path, key: str, what: str, error: Exception) -> str:
    """Why transformers could not load `what` from `file`, in one line: a file cut short or
    damaged, as the gguf package's own reader finds it (transformers then fails on a NumPy
    reshape or a struct unpack, naming neither the file nor the cause), else its error."""
    damage = gguf_damage(file)
    if damage is not None:
        return (f"{key}: the GGUF file {file} is cut short or damaged ({damage}): download or "
                "copy it again")  # fmt: skip
    return f"{key}: cannot load {what} {file}: {type(error).__name__}: {first_line(error)}"


def gguf_damage(file: Path) -> str | None:
    """What is wrong with the GGUF file `file` as a file (its size, and what it lacks), or None
    when the gguf package reads its header and every tensor's extent."""
    from gguf import GGUFReader  # an optional dependency (tba[gguf]), checked by require_gguf

    size = file.stat().st_size
    with file.open("rb") as start:
        magic = start.read(len(MAGIC))
    if magic != MAGIC[: len(magic)]:
        return f"{size:,} bytes, not starting with {MAGIC.decode()} as a GGUF file does"
    try:
        reader = GGUFReader(file)
    except Exception:  # noqa: BLE001 - NumPy's and struct's errors: cut short, or damaged
        return f"{size:,} bytes, in which its header and tensors do not read whole"
    end = max((t.data_offset + t.n_bytes for t in reader.tensors), default=0)
    if end > size:
        return f"{size:,} bytes, fewer than its tensors take, {end:,}"
    return None


def _dequantized() -> dict:
    """Loading settings that dequantize every weight as it loads: transformers versions that can
    keep GGUF blocks packed (`GgufConfig`) do so when a matmul kernel is installed, and such a
    model can neither be trained nor saved. Older versions always dequantize."""
    try:
        from transformers import GgufConfig
    except ImportError:
        return {}
    return {"quantization_config": GgufConfig(dequantize=True)}


def plain_copy(model: PreTrainedModel, dtype: torch.dtype) -> PreTrainedModel:
    """`model` as a plain model (what `save_pretrained`, peft and tba's QLoRA checks see as
    one): itself when transformers loaded it so, else its weights in a model of its class built
    from its config without the GGUF quantization marker (holding both copies for a moment)."""
    packed = [name for name, module in model.named_modules()
              if type(module).__name__.lower().startswith("gguf")]  # fmt: skip
    if packed:  # the dequantizing settings were not honoured
        raise ConfigError(f"transformers kept the GGUF weights of {packed[0]} packed; "
                          "upgrade transformers")  # fmt: skip
    marked = getattr(model, "is_quantized", False) or hasattr(model.config, "quantization_config")
    if not marked:
        return model.eval()
    config = copy.deepcopy(model.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.name_or_path = model.config.name_or_path
    plain = AutoModelForCausalLM.from_config(config, dtype=dtype)
    plain.load_state_dict(model.state_dict())
    plain.generation_config = copy.deepcopy(model.generation_config)
    plain.tie_weights()
    return plain.eval()
