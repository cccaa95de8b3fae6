"""`python -m loadtest.strategy_table --artifacts DIR`: the per-library strategy timings that
`bert-compile --strategy auto` measured and recorded in the manifest, as a markdown table."""

from __future__ import annotations

import argparse
from pathlib import Path

from compile.manifest import Manifest
from compile.strategy import STRATEGIES


def markdown_table(manifest: Manifest) -> str:
    lines = ["| library | " + " | ".join(f"{s} ms" for s in STRATEGIES) + " | chosen |",
             "|---|" + "---|" * (len(STRATEGIES) + 1)]
    entries = [(f"bucket {b.batch}x{b.seq}", b) for b in manifest.buckets]
    entries.append((f"generic (timed at {next(iter(manifest.generic.max_abs_diff))})", manifest.generic))
    for name, entry in entries:
        timings = entry.strategy_ms or {}
        cells = " | ".join(f"{timings[s]:.1f}" if s in timings else "-" for s in STRATEGIES)
        lines.append(f"| {name} | {cells} | {entry.strategy} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtest.strategy_table", description=__doc__.splitlines()[0])
    parser.add_argument("--artifacts", type=Path, required=True)
    args = parser.parse_args(argv)
    print(markdown_table(Manifest.read(args.artifacts)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
