"""`python -m loadtest.strategy_table --artifacts DIR`: the per-library strategy timings that
`bert-compile --strategy auto` measured and recorded in the manifest, as a markdown table."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from artifact.errors import ArtifactError
from artifact.levels import resolve
from artifact.manifest import MANIFEST_FILE, Manifest


def read_manifest(directory: Path) -> Manifest:
    """The manifest of an artifact directory (of the level this CPU runs, for a multi-level one);
    ArtifactError, in one line that says how to make one, where `directory` is missing or holds no
    manifest."""
    directory = resolve(directory)
    if not (directory / MANIFEST_FILE).is_file():
        raise ArtifactError(f"{directory} is not a compiled artifact (no {MANIFEST_FILE}); make it with: "
                            f".venv/bin/bert-compile --config configs/default.yaml --out {directory}")
    return Manifest.read(directory)


def markdown_table(manifest: Manifest) -> str:
    from compile.passes.strategy import STRATEGIES  # imports TVM; read_manifest's users need not

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
    try:
        manifest = read_manifest(args.artifacts)
    except ArtifactError as exc:
        print(f"{parser.prog}: error: {exc}", file=sys.stderr)
        return 2
    print(markdown_table(manifest))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
