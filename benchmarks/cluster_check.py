"""The cluster commands of docs/cluster.md, run as written on one machine, checked: the searchers
run on the user's Ray cluster (not on an instance of tba's own), at normal priority, and nothing
listens beyond loopback.

    python -m benchmarks.cluster_check [--steps 20]

1. **One node on loopback** (docs/cluster.md, "one machine"): a head started with
   `RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0` and `--node-ip-address=127.0.0.1`, `tba train
   ray.address=127.0.0.1:PORT`. Checked: the run joined that cluster, its searcher reported from
   the head's node at nice 0, and every listening socket of Ray is on 127.0.0.1.
2. **A head and a second worker node** (docs/cluster.md, "several machines"), both on one
   machine. Ray 2.60 refuses a second node while `RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`, and binds
   every interface otherwise; so this part runs in a network namespace of its own that has only
   a loopback interface (`ip netns`, needs root): two nodes, two searchers, one on each node.
   Checked: the searchers reported from two different nodes, and no socket of the namespace is
   reachable from the machine's own network.

Prints one line per check; exit status 1 if one fails.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

NAMESPACE = "tba-cluster-check"
COMMON = ["--include-dashboard=false", "--disable-usage-stats"]


def sh(command: list[str], env: dict | None = None, check: bool = True, timeout: float = 300):
    done = subprocess.run(command, env=(os.environ | (env or {})), capture_output=True, text=True,
                          timeout=timeout)  # fmt: skip
    if check and done.returncode != 0:
        output = done.stdout[-2000:] + done.stderr[-2000:]
        raise RuntimeError(f"{' '.join(command)} failed:\n{output}")
    return done


def listeners(prefix: list[str] = ()) -> list[str]:
    """Local addresses of the listening TCP sockets (in a namespace with `prefix`)."""
    out = sh([*prefix, "ss", "-ltnH"]).stdout
    return [line.split()[3] for line in out.splitlines() if line.strip()]


def on_loopback(address: str) -> bool:
    host = address.rsplit(":", 1)[0].strip("[]").removeprefix("::ffff:")
    return host.startswith("127.") or host == "::1"


def events(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]


def train(run_dir: Path, address: str, steps: int, count: int, prefix: list[str] = ()) -> None:
    sh([*prefix, sys.executable, "-m", "tba.cli", "train", f"ray.address={address}",
        f"searchers.count={count}", "searchers.num_cpus=1", f"train.max_steps={steps}",
        "task.num_eval=16", "eval.every=1000", f"output_dir={run_dir}", "--overwrite"],
       timeout=900)  # fmt: skip


def check(name: str, ok: bool, detail: str) -> bool:
    print(f"{'ok  ' if ok else 'FAIL'} {name}: {detail}", flush=True)
    return ok


def one_node(work: Path, steps: int) -> bool:
    port = "6390"
    before = set(listeners())
    env = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_worker_niceness": "0"}
    sh(["ray", "start", "--head", "--node-ip-address=127.0.0.1", f"--port={port}",
        "--num-cpus=2", *COMMON], env)  # fmt: skip
    try:
        opened = sorted(set(listeners()) - before)
        run_dir = work / "one-node"
        train(run_dir, f"127.0.0.1:{port}", steps, count=1)
        log = events(run_dir)
    finally:
        sh(["ray", "stop", "--force"], check=False)
    joined = [e for e in log if e["event"] == "ray"]
    ready = [e for e in log if e["event"] == "searcher_ready"]
    results = [
        check("one node: joined the user's cluster", bool(joined) and port in joined[0]["message"],
              joined[0]["message"] if joined else "no 'ray' event"),
        check("one node: searcher at normal priority", bool(ready) and ready[0]["nice"] == 0,
              f"searcher_ready events: {[(e['node'][:8], e['nice']) for e in ready]}"),
        check("one node: nothing listens beyond loopback",
              bool(opened) and all(on_loopback(a) for a in opened),
              f"{len(opened)} new listening sockets: {', '.join(opened)}"),
    ]
    return all(results)


def two_nodes(work: Path, steps: int) -> bool:
    if os.geteuid() != 0:
        return check("two nodes", False, "needs root, for a network namespace (ip netns)")
    sh(["ip", "netns", "add", NAMESPACE])
    inside = ["ip", "netns", "exec", NAMESPACE]
    try:
        sh([*inside, "ip", "link", "set", "lo", "up"])
        env = {"RAY_worker_niceness": "0"}
        if Path("~/.ray/auth_token").expanduser().exists():
            env["RAY_AUTH_MODE"] = "token"  # a cluster where a token exists checks it
        before_host = set(listeners())
        sh([*inside, "ray", "start", "--head", "--port=6391", "--num-cpus=1", *COMMON], env)
        sh([*inside, "ray", "start", "--address=127.0.0.1:6391", "--num-cpus=1",
            "--disable-usage-stats"], env)  # fmt: skip
        run_dir = work / "two-nodes"
        train(run_dir, "127.0.0.1:6391", steps, count=2, prefix=inside)
        inner = listeners(inside)
        host_opened = sorted(set(listeners()) - before_host)
        interfaces = sh([*inside, "ip", "-o", "addr"]).stdout.split()
    finally:
        sh([*inside, "ray", "stop", "--force"], check=False)
        sh(["ip", "netns", "del", NAMESPACE], check=False)
    nodes = {e["node"] for e in events(run_dir) if e["event"] == "searcher_ready"}
    only_lo = {word for word in interfaces if word.endswith(":")} == {"1:"}
    results = [
        check("two nodes: searchers on both", len(nodes) == 2, f"{len(nodes)} distinct nodes"),
        check("two nodes: the namespace has only loopback", only_lo,
              f"interfaces: {' '.join(interfaces[:6])} ..."),
        check("two nodes: nothing opened in the machine's own network", not host_opened,
              f"{len(inner)} sockets inside the namespace, {len(host_opened)} outside"),
    ]
    return all(results)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps of each run")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as work:
        ok = one_node(Path(work), args.steps)
        ok = two_nodes(Path(work), args.steps) and ok
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
