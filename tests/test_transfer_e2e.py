"""Weight transports end to end, on Ray: a transport registered from this file (weights through
files in a directory) carries an asynchronous run with no change to any module of tba; a default
asynchronous run listens on loopback alone; too little /dev/shm falls back with one line, or, with
`shared` asked for, is one line."""

from __future__ import annotations

import ipaddress
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Literal

import psutil
import pytest
import torch

from tba.config import load_config
from tba.config.transfer import TRANSFER_SETTINGS, TransferSettings
from tba.policy.model import published_state
from tba.run_dir import read_metrics
from tba.runtime.transfer import TRANSPORTS, Receiver, Sender, register_transport

pytestmark = pytest.mark.slow

TINY = ["train.num_prompts=2", "train.group_size=2", "policy.max_new_tokens=4",
        "task.num_train=16", "task.num_eval=4", "task.num_eval_pass_k=2", "eval.pass_k=2",
        "eval.every=1000", "train.max_minutes=null", "searchers.num_cpus=1",
        "policy.num_threads=1", "checkpoint.every_minutes=null"]  # fmt: skip


def file_transport() -> tuple[type[Sender], type[TransferSettings]]:
    """A transport of weights through files (`torch.save` of the published tensors, one file a
    version), defined in a function so that Ray sends its receiver by value to the searchers."""

    class FileTransfer(TransferSettings):
        type: Literal["file"] = "file"
        directory: str = ""

    class FileReceiver(Receiver):
        name = "file"

        def __init__(self, directory: str) -> None:
            self.directory = Path(directory)

        @classmethod
        def attach(cls, handles: Any, model: torch.nn.Module, place: Any) -> FileReceiver:
            return cls(handles)

        def receive(self, model, newer_than, offer, *, wait=False):
            if offer is None or offer.version <= newer_than:
                return None
            state = torch.load(self.directory / f"v{offer.version}.pt")
            target = published_state(model)
            with torch.no_grad():
                for name, tensor in state.items():
                    target[name].copy_(tensor)
            return offer.version, offer.step

    class FileSender(Sender):
        name = "file"
        receiver = FileReceiver

        def publish(self, version: int, step: int) -> None:
            state = {n: t.detach().clone() for n, t in published_state(self.trainer.model).items()}
            path = Path(self.settings.directory) / f"v{version}.pt"
            torch.save(state, path.with_suffix(".partial"))
            os.replace(path.with_suffix(".partial"), path)

        def handles(self) -> str:
            return self.settings.directory

    return FileSender, FileTransfer


def test_a_transport_registered_from_outside_carries_an_asynchronous_run(tmp_path, policy_dir):
    from tba.run import train

    sender, settings = file_transport()
    register_transport(sender, settings)
    (tmp_path / "weights").mkdir()
    try:
        config = load_config(None, [
            *TINY, "searchers.count=1", "train.max_steps=6", "train.sync_every=2",
            f"policy.model={policy_dir}", "task.name=math", f"output_dir={tmp_path / 'run'}",
            "searchers.weight_transfer.type=file",
            f"searchers.weight_transfer.directory={tmp_path / 'weights'}",
        ])  # fmt: skip
        run_dir = train(config)
    finally:
        TRANSPORTS.pop("file")
        TRANSFER_SETTINGS.pop("file")
    events = read_metrics(run_dir / "events.jsonl")
    paths = [e["path"] for e in events if e["event"] == "weight_transfer"]
    assert paths == ["file"]
    assert not [e for e in events if e["event"] == "weight_digest_mismatch"]
    assert sorted(p.name for p in (tmp_path / "weights").iterdir())[:2] == ["v1.pt", "v2.pt"]
    steps = [r for r in read_metrics(run_dir / "metrics.jsonl") if "loss" in r]
    assert len(steps) == 6 and max(r["staleness_mean"] for r in steps) < 6


def is_loopback(ip: str) -> bool:
    """127.0.0.0/8 and ::1, and 127.x as an IPv6 socket sees it (::ffff:127.0.0.1)."""
    address = ipaddress.ip_address(ip)
    mapped = getattr(address, "ipv4_mapped", None)
    return address.is_loopback or (mapped is not None and mapped.is_loopback)


def listening(processes: list[psutil.Process]) -> set[str]:
    """The addresses every TCP socket of `processes` listens on."""
    found = set()
    for process in processes:
        try:
            found |= {c.laddr.ip for c in process.net_connections(kind="inet")
                      if c.status == psutil.CONN_LISTEN}  # fmt: skip
        except psutil.Error:  # gone meanwhile
            continue
    return found


@pytest.mark.parametrize("transfer", ["auto", "broadcast"])
def test_a_default_asynchronous_run_listens_on_loopback_alone(tmp_path, policy_dir, transfer):
    """Every socket that the run's processes (the trainer, Ray's, the searchers') listen on,
    read while it trains; `broadcast` makes the trainer's store and gloo's sockets too."""
    command = [sys.executable, "-m", "tba.cli", "train", *TINY, "train.max_steps=400",
               f"policy.model={policy_dir}", f"output_dir={tmp_path / 'run'}",
               f"searchers.weight_transfer={transfer}"]  # fmt: skip
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, start_new_session=True)  # fmt: skip
    addresses: set[str] = set()
    try:
        deadline = time.time() + 240
        metrics = tmp_path / "run" / "metrics.jsonl"
        while time.time() < deadline and process.poll() is None:
            if metrics.exists() and len(metrics.read_text().splitlines()) > 3:
                tree = [psutil.Process(process.pid), *psutil.Process(process.pid).children(
                    recursive=True)]  # fmt: skip
                addresses |= listening(tree)
                break
            time.sleep(0.5)
    finally:
        process.terminate()
        output, _ = process.communicate(timeout=120)
    assert addresses, output[-3000:]
    assert all(is_loopback(ip) for ip in addresses), addresses
    if transfer == "broadcast":
        events = read_metrics(tmp_path / "run" / "events.jsonl")
        assert [e["path"] for e in events if e["event"] == "weight_transfer"] == ["broadcast"]


def unshare_available() -> bool:
    if shutil.which("unshare") is None or os.geteuid() != 0:
        return False
    probe = subprocess.run(["unshare", "-m", "true"], capture_output=True)
    return probe.returncode == 0


@pytest.mark.skipif(not unshare_available(), reason="needs root and unshare for a small /dev/shm")
def test_a_small_dev_shm_falls_back_with_one_line_and_refuses_shared(tmp_path, policy_dir):
    """/dev/shm of 64 KiB, less than the test policy's two bucket sets (as Docker's default
    64 MB is less than a real model's): `auto` says why in one line and takes the next transport;
    `shared` alone exits with status 2 and one line."""

    def run(*overrides: str) -> subprocess.CompletedProcess:
        command = " ".join([sys.executable, "-m", "tba.cli", "train", *TINY, "train.max_steps=4",
                            f"policy.model={policy_dir}", *overrides])  # fmt: skip
        return subprocess.run(
            ["unshare", "-m", "sh", "-c",
             f"mount -t tmpfs -o size=64k tmpfs /dev/shm && exec {command}"],
            capture_output=True, text=True, timeout=400,
        )  # fmt: skip

    auto = run(f"output_dir={tmp_path / 'auto'}")
    assert auto.returncode == 0, auto.stderr[-3000:]
    events = read_metrics(tmp_path / "auto" / "events.jsonl")
    [unavailable] = [e for e in events if e["event"] == "weight_transfer_unavailable"]
    assert unavailable["path"] == "shared" and "--shm-size" in unavailable["why"]
    [taken] = [e for e in events if e["event"] == "weight_transfer"]
    assert taken["path"] == "broadcast" and "/dev/shm" in taken["why"]
    assert "weight_transfer_unavailable" in auto.stderr and "Traceback" not in auto.stderr
    alone = run(f"output_dir={tmp_path / 'alone'}", "searchers.weight_transfer=shared")
    assert alone.returncode == 2
    [line] = [x for x in alone.stderr.splitlines() if x.startswith("tba: error:")]
    assert "searchers.weight_transfer=shared" in line and "--shm-size" in line
    assert "Traceback" not in alone.stderr

