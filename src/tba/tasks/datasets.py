"""Rows of real datasets: read a local JSONL/JSON/Parquet/CSV file, or a dataset by name through
`datasets.load_dataset`, check the fields a task needs, and render prompts from a template.

Every problem with the data is one line naming the file (or dataset and split) and, for a bad
row, its number counted from 1 in the order of the file. `DatasetError` is a `ConfigError`, so
the command line prints it and exits with status 2.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import datasets

from tba.config import TaskConfig
from tba.errors import DatasetError
from tba.templates import render, template_fields

BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}


@dataclass(frozen=True)
class Source:
    """Where one split comes from: a local file, else a dataset by name and split."""

    path: str | None
    dataset: str | None = None
    dataset_config: str | None = None
    split: str = "train"
    key: str = "task.train_path"  # the config key that names the file, for error messages

    def describe(self) -> str:
        if self.path is not None:
            return self.path
        config = f", config {self.dataset_config!r}" if self.dataset_config else ""
        return f"dataset {self.dataset!r} (split {self.split!r}{config})"


def sources(config: TaskConfig) -> tuple[Source, Source]:
    """Where the train and the held-out rows come from."""
    train = Source(
        config.train_path,
        dataset=config.dataset,
        dataset_config=config.dataset_config,
        split=config.train_split,
        key="task.train_path",
    )
    if config.eval_dataset is not None:
        eval_dataset, eval_config = config.eval_dataset, config.eval_dataset_config
    else:
        eval_dataset = config.dataset
        eval_config = config.eval_dataset_config or config.dataset_config
    held_out = Source(
        config.eval_path,
        dataset=eval_dataset,
        dataset_config=eval_config,
        split=config.eval_split,
        key="task.eval_path",
    )
    return train, held_out


def read_rows(source: Source, limit: int | None = None, cache_dir: str | None = None) -> list[dict]:
    """The first `limit` rows (all when None) of a local file or a dataset by name, as dicts."""
    if source.path is not None:
        table = _read_file(source, cache_dir)
    else:
        table = _read_hub(source, cache_dir)
    if limit is not None and limit < len(table):
        table = table.select(range(limit))
    return table.to_list()


def _read_file(source: Source, cache_dir: str | None) -> Any:
    path = Path(source.path).expanduser()
    builder = BUILDERS.get(path.suffix.lower())
    if builder is None:
        raise DatasetError(
            f"{source.key}: {source.path} must end in {', '.join(BUILDERS)} (JSON lines, "
            "JSON, Parquet or CSV)"
        )
    if not path.is_file():
        raise FileNotFoundError(f"{source.key}: no such file: {source.path}")
    if _blank(path):  # the builders' own error says only `StopIteration`
        raise DatasetError(f"{source.key}: {source.path} is empty: it has no rows")
    try:
        return _load_dataset(builder, data_files=str(path), split="train", cache_dir=cache_dir)
    except Exception as error:  # any reading failure becomes one line
        bad_line = _first_bad_json_line(path) if path.suffix.lower() == ".jsonl" else None
        if bad_line is not None:
            raise DatasetError(f"{source.path}: {bad_line}") from None
        raise DatasetError(f"cannot read {source.path} as {builder}: {_one_line(error)}") from None


def _blank(path: Path, head: int = 1 << 16) -> bool:
    """Nothing but whitespace in the file (read no further than its first `head` bytes)."""
    with path.open("rb") as file:
        start = file.read(head)
    return not start.strip() and len(start) < head


def _first_bad_json_line(path: Path) -> str | None:
    """Which line of a JSON-lines file is not a JSON object, if one is not."""
    with path.open(encoding="utf-8", errors="replace") as lines:
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                value = json.loads(line.rstrip("\r\n"))
            except json.JSONDecodeError as error:
                return f"row {number} is not valid JSON ({error.msg}, column {error.colno})"
            if not isinstance(value, dict):
                return f"row {number} is a JSON {type(value).__name__}, not an object"
    return None


def _read_hub(source: Source, cache_dir: str | None) -> Any:
    try:
        return _load_dataset(
            source.dataset, source.dataset_config, split=source.split, cache_dir=cache_dir
        )
    except Exception as error:  # offline, unknown name or split: one line
        raise DatasetError(f"cannot load {source.describe()}: {_one_line(error)}") from None


def _load_dataset(*args: Any, **kwargs: Any) -> Any:
    # Its own log lines would repeat what the one-line error says.
    datasets.utils.logging.set_verbosity(datasets.utils.logging.CRITICAL)
    datasets.utils.logging.disable_progress_bar()
    return datasets.load_dataset(*args, **kwargs)


def _one_line(error: BaseException) -> str:
    """The most specific message of an exception chain, on one line."""
    while error.__cause__ is not None or error.__context__ is not None:
        error = error.__cause__ or error.__context__
    text = " ".join(str(error).split()) or type(error).__name__
    return text if len(text) <= 300 else text[:297] + "..."


# ---------------------------------------------------------------------------- rows of a task


def require_fields(rows: list[dict], fields: list[str], source: Source) -> None:
    """Every row has a value for every field, text that is not blank; else one line naming the
    source, the row and the field (a blank field would make a prompt of nothing, or a blank gold
    answer, trained on to the end without a word)."""
    for number, row in enumerate(rows, start=1):
        for field in fields:
            value = row.get(field)
            if value is None:
                present = ", ".join(k for k, v in row.items() if v is not None) or "none"
                raise DatasetError(
                    f"{source.describe()}: row {number} has no {field!r} field (it has: {present})"
                )
            if isinstance(value, str) and not value.strip():
                raise DatasetError(f"{source.describe()}: row {number}'s {field!r} is empty: "
                                   "every row needs a value there")  # fmt: skip


def task_rows(
    source: Source,
    *,
    limit: int | None,
    template: str,
    answer_field: str,
    column: str,
    convert: Callable[[Any], str],
    cache_dir: str | None = None,
) -> list[dict]:
    """Rows `{"prompt": template rendered on the row, column: convert(row[answer_field])}`.

    `convert` turns the gold field into what the reward functions compare with; it raises
    ValueError for a value it cannot use, reported with the source and the row."""
    raw = read_rows(source, limit, cache_dir)
    if not raw:
        raise DatasetError(f"{source.describe()} has no rows")
    require_fields(raw, [*template_fields(template), answer_field], source)
    rows = []
    for number, row in enumerate(raw, start=1):
        try:
            gold = convert(row[answer_field])
        except ValueError as error:
            raise DatasetError(
                f"{source.describe()}: row {number}, field {answer_field!r}: {error}"
            ) from None
        rows.append({"prompt": render(template, row), column: gold})
    return rows
