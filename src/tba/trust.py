"""Which code named by a run directory may run without asking: what this user's own `tba train`
recorded there.

A run's config.yaml can name Python code (`task.reward_funcs`, `task.eval_func`:
`path/file.py:function`, `module:function`), which `tba eval` and `tba train --resume` import,
running it. A run directory someone hands you would run its code when you evaluate it. So
`tba train`, given that code by its user, records in `RUN_DIR/code.json` what it imported: each
file's absolute path and sha256 (each module's name), signed with a key of this user's
(HMAC-SHA256; `~/.config/tba/code-key`, made on first use, readable by this user alone). A
record another user wrote, or edited by hand, does not verify: a copied run directory cannot
vouch for code by forging one. Code named by a run that is not in a verified record, or whose file
changed since, runs only when the user says so (`tba eval --trust-code`, `tba train --resume
... --trust-code`; in Python, `trust_code=True`), as Hugging Face's `trust_remote_code`.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import os
import secrets
from pathlib import Path

CODE_RECORD = "code.json"
MODULE = "module"  # a module's record: its name (it is imported from the Python environment)


def key_path() -> Path:
    """This user's signing key: `$XDG_CONFIG_HOME/tba/code-key` (by default under ~/.config)."""
    return Path(os.environ.get("XDG_CONFIG_HOME") or "~/.config").expanduser() / "tba" / "code-key"


def _user_key(create: bool) -> bytes | None:
    """This user's key (made, readable by this user alone, when `create` and there is none); None
    where there is none or it cannot be read or made."""
    path = key_path()
    with contextlib.suppress(OSError):
        key = path.read_bytes()
        if len(key) == 32:
            return key
    if not create:
        return None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f"{path.name}.{os.getpid()}.partial")
        descriptor = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(descriptor, "wb") as file:
            file.write(secrets.token_bytes(32))
        try:
            os.link(partial, path)  # whole or not at all; a key another process made first wins
        except FileExistsError:
            pass
        finally:
            partial.unlink()
        key = path.read_bytes()
    except OSError:
        return None
    return key if len(key) == 32 else None


def fingerprint(target: str) -> str | None:
    """What a record holds for `target`: a `.py` file's sha256 (None if it cannot be read), or
    `MODULE` for a module name."""
    if not target.endswith(".py"):
        return MODULE
    try:
        return hashlib.sha256(Path(target).read_bytes()).hexdigest()
    except OSError:
        return None


def _mac(key: bytes, code: dict[str, str]) -> str:
    return hmac.new(key, json.dumps(code, sort_keys=True).encode(), hashlib.sha256).hexdigest()


def record_code(run_dir: Path, targets: list[str]) -> None:
    """Record `targets` (absolute `.py` paths, module names), the code this process imported
    for the run, as trusted in `run_dir`; without a key that can be made, or where the record
    cannot be written, none is (the run then asks for --trust-code when it is read again)."""
    code = {target: value for target in targets if (value := fingerprint(target)) is not None}
    path = run_dir / CODE_RECORD
    key = _user_key(create=bool(code)) if code else None
    with contextlib.suppress(OSError):
        if key is None:
            path.unlink(missing_ok=True)
            return
        partial = path.with_name(f"{path.name}.partial")
        partial.write_text(json.dumps({"code": code, "mac": _mac(key, code)}, indent=2) + "\n")
        os.replace(partial, path)


def recorded_code(run_dir: Path) -> dict[str, str]:
    """The code `run_dir` records, if this user's key signed the record; else nothing."""
    key = _user_key(create=False)
    try:
        record = json.loads((run_dir / CODE_RECORD).read_text())
        code, mac = record["code"], record["mac"]
    except (OSError, ValueError, TypeError, KeyError):
        return {}
    if key is None or not isinstance(code, dict) or not isinstance(mac, str):
        return {}
    return code if hmac.compare_digest(_mac(key, code), mac) else {}


def untrusted(run_dir: Path, targets: list[str]) -> list[str]:
    """Of `targets`, named by `run_dir`'s config, those its verified record does not hold as
    they are now (a file missing is left to the import, which names it)."""
    record = recorded_code(run_dir)
    return [target for target in targets
            if (now := fingerprint(target)) is not None and record.get(target) != now]  # fmt: skip
