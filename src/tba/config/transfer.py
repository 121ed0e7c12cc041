"""How published weights reach the searcher processes (`searchers.weight_transfer`): one section
whose `type` names a transport (`tba.runtime.transfer`) and whose other settings are that
transport's alone. `searchers.weight_transfer=broadcast` is short for
`searchers.weight_transfer.type=broadcast`.

`TRANSFER_SETTINGS` maps each `type` to its settings class; a transport added elsewhere registers
its own (`register_transfer_settings`), and the section is validated against the class its `type`
names, as a union discriminated on `type` would be."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator

from tba.config.base import Section, kind_settings


class TransferSettings(Section):
    """A transport's settings: `type` names it; the rest are its own."""

    shorthand = "type"
    type: str = Field("auto", description="the transport (`auto`, `shared`, `broadcast`, "
                      "`object_store`)")  # fmt: skip

    @classmethod
    def variants(cls) -> dict[str, type[Section]]:
        return dict(TRANSFER_SETTINGS)


class AutoTransfer(TransferSettings):
    """Each searcher takes the first transport of `order` it can use (docs/asynchrony.md)."""

    type: Literal["auto"] = Field(
        "auto", description="`auto`: each searcher takes the first of `order` it can use: "
        "`shared` wherever it can map the trainer's buckets, else `broadcast` (the group is made "
        "when a searcher needs it), else `object_store`; a transport the trainer cannot serve "
        "(too little shared memory) is skipped with one line saying why",
    )
    order: list[str] = Field(
        ["shared", "broadcast", "object_store"], min_length=1,
        description="the transports to try, best first",
    )  # fmt: skip

    @field_validator("order")
    @classmethod
    def _known_transports(cls, order: list[str]) -> list[str]:
        unknown = [name for name in order if name not in TRANSFER_SETTINGS or name == "auto"]
        if unknown:
            known = ", ".join(name for name in TRANSFER_SETTINGS if name != "auto")
            raise ValueError(f"unknown transport {unknown[0]!r}; known: {known}")
        if len(set(order)) < len(order):
            raise ValueError("a transport is named twice")
        return order


class SharedTransfer(TransferSettings):
    """Flat per-dtype buckets on the trainer's device that searchers on its machine map."""

    type: Literal["shared"] = Field(
        "shared", description="`shared`: flat per-dtype buckets on the trainer's device, which "
        "searchers on its machine map once and copy from (shared memory on a CPU, CUDA IPC on "
        "the same GPU); a searcher that cannot map them stops the run",
    )
    sets: int = Field(
        2, ge=1, le=2, description="bucket sets (2: the trainer never waits for a copy in "
        "progress; 1: half the memory)",
    )  # fmt: skip


class BroadcastTransfer(TransferSettings):
    """The same buckets sent to each searcher by torch.distributed (NCCL or gloo)."""

    type: Literal["broadcast"] = Field(
        "broadcast", description="`broadcast`: the trainer's buckets sent by torch.distributed "
        "(NCCL between GPUs, gloo otherwise) in a group of the trainer and each searcher, for "
        "other GPUs and machines; a broken group falls back to the object store",
    )
    join_timeout_s: float | None = Field(
        None, gt=0, description="a searcher that has not joined the group within this many "
        "seconds takes the object store's way (default: ray.sync_timeout_s)",
    )  # fmt: skip


class ObjectStoreTransfer(TransferSettings):
    """A copy through host memory and Ray's object store."""

    type: Literal["object_store"] = Field(
        "object_store", description="`object_store`: a copy through host memory and Ray's "
        "object store, once per version, fetched by every searcher (any machine, any device)",
    )


TRANSFER_SETTINGS: dict[str, type[TransferSettings]] = {
    settings.model_fields["type"].default: settings
    for settings in (AutoTransfer, SharedTransfer, BroadcastTransfer, ObjectStoreTransfer)
}


def register_transfer_settings(name: str, settings: type[TransferSettings]) -> None:
    """Let `searchers.weight_transfer.type=name` select a transport added elsewhere."""
    TRANSFER_SETTINGS[name] = settings


def transfer_settings(value: Any, key: str = "searchers.weight_transfer") -> Any:
    """A `searchers.weight_transfer` value as its transport's settings (`kind_settings`): a name
    alone stands for the section `{type: name}`; a mapping is validated against the class its
    `type` names. What is wrong is a `ValueError` of one line naming the setting under `key`."""
    return kind_settings(TransferSettings, value, key, "transport")
