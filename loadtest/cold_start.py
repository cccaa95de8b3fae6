"""`python -m loadtest.cold_start`: how long `bert-serve --model-id` takes to /ready, from nothing and from its cache.

A stand-in for the Hugging Face Hub on 127.0.0.1 (tests/support/hub_stand_in.py, reached through HF_ENDPOINT)
serves the bundled all-MiniLM-L6-v2 as a repository. Then, each in a fresh process and with an empty Hub cache
and compile cache for the first:

1. cold: `bert-serve --model-id` (the default compile config unless --config): download, compile, load, /ready;
2. restart: the same again, loading from the compile cache;
3. offline: the same with HF_HUB_OFFLINE=1 and the Hub stand-in stopped.

Each run's seconds from the server's start to /ready 200 and, for the cold one, the compile's own time per phase
(its `[compile time]` line) go to stdout as JSON and one line each on stderr. Run it on an otherwise idle machine:
the compile's timings decide its precision and strategies, and the numbers are the benchmark.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from .machine import describe as describe_machine
from .servers import REPO, free_port

PROG = "python -m loadtest.cold_start"
REPO_ID = "bench/all-minilm-l6-v2"
# /ready polled every POLL_S on one connection: a new client and connection every 50 ms took a fifth of
# a core from the compile it waits for (2 cores), and the answer is late by at most this much
POLL_S = 0.1
PHASES = re.compile(r"\[compile time\] (?P<phases>.*); (?P<total>[\d.]+) s in all")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, help="compile config (default: the server's, configs/default.yaml)")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds a start may take before it fails")
    parser.add_argument("--keep", type=Path, help="keep the caches and server logs in this directory")
    parser.add_argument("--out", type=Path, help="also write the JSON result here")
    return parser.parse_args(argv)


def time_to_ready(args: list[str], env: dict[str, str], log: Path, timeout: float) -> float:
    """Seconds from starting `python -m service ARGS` to its /ready answering 200; the server is stopped after."""
    port = free_port()
    started = time.perf_counter()
    with open(log, "w") as out:
        process = subprocess.Popen([sys.executable, "-m", "service", "--host", "127.0.0.1", "--port", str(port),
                                    "--log-level", "info", *args], stdout=out, stderr=subprocess.STDOUT, cwd=REPO,
                                   env=env)
    try:
        with httpx.Client(timeout=5) as client:
            while True:
                if process.poll() is not None:
                    raise RuntimeError(f"the server exited {process.returncode} before /ready; its log: {log}")
                if time.perf_counter() - started > timeout:
                    raise RuntimeError(f"no /ready within {timeout:.0f} s; the server's log: {log}")
                try:
                    if client.get(f"http://127.0.0.1:{port}/ready").status_code == 200:
                        return time.perf_counter() - started
                except httpx.TransportError:
                    pass
                time.sleep(POLL_S)
    finally:
        process.terminate()
        process.wait(timeout=60)


def compile_phases(log: Path) -> dict | None:
    """The compile's wall time per phase, from its `[compile time]` line in the server's log."""
    found = PHASES.search(log.read_text(errors="replace"))
    if found is None:
        return None
    phases = dict(re.fullmatch(r"(.+) ([\d.]+) s", part).groups() for part in found["phases"].split(", "))
    return {"phases_s": {name: float(seconds) for name, seconds in phases.items()}, "total_s": float(found["total"])}


def run(args: argparse.Namespace, root: Path) -> dict:
    from compile.config import default_model_dir
    from tests.support.hub_stand_in import HubStandIn, Repo, checkpoint_files, commit_sha

    sha = commit_sha("main")
    repos = {REPO_ID: Repo({sha: checkpoint_files(default_model_dir())}, {"main": sha})}
    server_args = ["--model-id", REPO_ID, "--artifact-cache", str(root / "artifacts"),
                   *(["--config", str(args.config.absolute())] if args.config else [])]
    env = {**os.environ, "HF_HOME": str(root / "hub"), "HF_HUB_OFFLINE": "0", "HF_TOKEN": ""}
    env.pop("HF_HUB_CACHE", None)
    results = {}
    with HubStandIn(repos) as hub:
        env["HF_ENDPOINT"] = hub.url
        for name in ("cold", "restart"):
            log = root / f"{name}.log"
            results[name] = {"ready_s": round(time_to_ready(server_args, env, log, args.timeout), 2)}
            print(f"{name}: /ready after {results[name]['ready_s']:.1f} s", file=sys.stderr, flush=True)
    log = root / "offline.log"  # the stand-in has stopped: nothing answers at HF_ENDPOINT
    offline = time_to_ready(server_args, {**env, "HF_HUB_OFFLINE": "1"}, log, args.timeout)
    results["offline"] = {"ready_s": round(offline, 2)}
    print(f"offline (HF_HUB_OFFLINE=1, Hub stopped): /ready after {offline:.1f} s", file=sys.stderr)
    phases = compile_phases(root / "cold.log")
    if phases is not None:
        results["cold"]["compile"] = phases
        print("cold start's compile: " + ", ".join(f"{name} {seconds:.1f} s" for name, seconds in
                                                 phases["phases_s"].items()), file=sys.stderr)
    return {"machine": describe_machine(),
            "model": "all-MiniLM-L6-v2 (bundled)", "config": str(args.config or "configs/default.yaml"), **results}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.keep is not None:
        if args.keep.exists() and any(args.keep.iterdir()):
            print(f"{PROG}: error: --keep {args.keep} is not empty: a cold start needs empty caches", file=sys.stderr)
            return 2
        args.keep.mkdir(parents=True, exist_ok=True)
        result = run(args, args.keep)
    else:
        with tempfile.TemporaryDirectory(prefix="bert-cold-start-") as scratch:
            result = run(args, Path(scratch))
    command = f"{PROG} " + " ".join(argv if argv is not None else sys.argv[1:])
    text = json.dumps({"command": command.strip(), **result}, indent=2)
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
