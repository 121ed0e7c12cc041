"""Runs port scripts one after the other in this one process, so that Python, torch and
transformers are imported once, and Ray started once (where the plan says `ray`; each run joins
it, as a run inside another's Ray session does): `python run_ports.py PLAN.json`. The plan lists,
for each script, its path, the directory it runs in, its environment (added to this process's)
and the file that gets its output; each script's outcome ("ok", or its traceback) goes to
PLAN.json's `outcomes` file. A failing script does not stop the next. The Hub is a stand-in
(`LocalHub`): an upload is a line of `hub.jsonl` in the script's directory."""

import contextlib
import json
import os
import runpy
import sys
import traceback
import types
from pathlib import Path

import tba.api
from tba.config import load_config
from tba.runtime.ray_cluster import ray_session


class LocalHub:
    """`huggingface_hub.HfApi` for the scripts' uploads (offline, as the tests run): each
    `upload_folder` is a line of `hub.jsonl` in the directory the script runs in."""

    def __init__(self, token=None):
        self.token = token

    def create_repo(self, repo_id, private=None, exist_ok=False):
        return types.SimpleNamespace(repo_id=repo_id if "/" in repo_id else f"me/{repo_id}")

    def upload_folder(self, repo_id, folder_path, commit_message, revision=None):
        files = sorted(path.name for path in Path(folder_path).iterdir())
        with open("hub.jsonl", "a") as record:
            record.write(json.dumps({"repo_id": repo_id, "files": files}) + "\n")
        return types.SimpleNamespace(commit_url=f"https://huggingface.co/{repo_id}/commit/1")


tba.api.HfApi = LocalHub

plan = json.loads(Path(sys.argv[1]).read_text())
sys.path.insert(0, str(Path(__file__).parent))  # the stand-ins the scripts import
outcomes = {}
ray = ray_session(load_config()) if plan.get("ray") else contextlib.nullcontext()
with ray:
    for item in plan["scripts"]:
        saved = dict(os.environ)
        os.environ.update(item["env"])
        os.chdir(item["cwd"])
        with open(item["log"], "w") as log, contextlib.redirect_stdout(log), \
                contextlib.redirect_stderr(log):  # fmt: skip
            try:
                runpy.run_path(item["script"], run_name="__main__")
                outcomes[item["name"]] = "ok"
            except BaseException:  # noqa: BLE001 - reported, and the next script runs
                outcomes[item["name"]] = traceback.format_exc()
        os.environ.clear()
        os.environ.update(saved)
Path(plan["outcomes"]).write_text(json.dumps(outcomes))
