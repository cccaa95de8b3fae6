"""How close compiled artifacts (and, with --openvino, OpenVINO NNCF int8) stay to
sentence-transformers fp32 on natural text: the sentences the compile measures its precision on
(compile/sentences.py) and held-out ones it never sees, one-word queries included. Each
sentence runs alone, as one query would.

    python -m loadtest.int8_accuracy --artifacts artifacts/minilm-cpu-int8 [--openvino]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import numpy as np

from artifact.errors import ArtifactError
from compile.sentences import ACCURACY_SENTENCES

from .strategy_table import read_manifest

PROG = "python -m loadtest.int8_accuracy"

HELDOUT_SENTENCES = [
    "maybe",
    "coffee",
    "London",
    "good night",
    "train tickets",
    "laptop battery life",
    "how do vaccines work",
    "Who wrote Pride and Prejudice?",
    "The printer on the second floor is out of toner again.",
    "A dog is chasing a red ball across the park.",
    "Is it safe to eat eggs after the best-before date?",
    "The new tax rules apply to everyone who earns more than the threshold.",
    "Glaciers in the Alps have lost more than half their volume since 1900.",
    "She forgot her umbrella, so she waited under the bus shelter until the rain stopped.",
    "The hospital hired forty nurses to shorten waiting times in the emergency ward.",
    "Compilers translate high-level source code into machine instructions that a processor can run.",
    "Our neighbours planted tomatoes, beans and sunflowers in the small garden behind the house.",
    "The airline refunded the tickets after cancelling the flight because of a strike by air traffic "
    "controllers, but the hotel bookings could not be recovered.",
    "Most of the museum's collection is kept in storage, and only a small fraction of the paintings "
    "is on display at any one time, which curators rotate every few months.",
    "Electric scooters became popular in many cities within a few years, prompting councils to introduce "
    "speed limits, parking zones and rules about riding on pavements.",
]
SETS = {"shipped": ACCURACY_SENTENCES, "held-out": HELDOUT_SENTENCES}


def cosines(actual: np.ndarray, expected: np.ndarray) -> np.ndarray:
    return np.sum(actual * expected, axis=1) / (np.linalg.norm(actual, axis=1) * np.linalg.norm(expected, axis=1))


def encoded(tokenizer_file: Path, sentences: list[str], max_seq: int) -> list[tuple[np.ndarray, ...]]:
    """Each sentence alone: ids, attention mask, token type ids, positions ([1, its length])."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tokenizer_file))
    tokenizer.no_padding()
    tokenizer.enable_truncation(max_seq)
    rows = []
    for encoding in tokenizer.encode_batch(sentences):
        ids = np.array([encoding.ids], dtype=np.int64)
        rows.append((ids, np.ones_like(ids), np.zeros_like(ids), np.arange(ids.shape[1], dtype=np.int64)[None]))
    return rows


def artifact_outputs(directory: Path, sentences: list[str]) -> np.ndarray:
    from artifact.loader import load_artifact

    model = load_artifact(directory)
    rows = encoded(model.tokenizer_dir / "tokenizer.json", sentences, model.max_seq)
    return np.concatenate([model.run(ids, mask, types).output for ids, mask, types, _ in rows])


def openvino_int8_outputs(model_dir: Path, sets: dict[str, list[str]]) -> dict[str, np.ndarray]:
    """OpenVINO NNCF int8 (transformer preset, calibrated on the shipped sentences), as the
    benchmark builds it (loadtest/openvino_peer.py)."""
    from compile.checkpoint import inspect_checkpoint, load_wrapper

    from .onnx_peer import export_onnx
    from .openvino_peer import openvino_models

    info = inspect_checkpoint(model_dir, "embed")
    with tempfile.TemporaryDirectory() as scratch:
        onnx = export_onnx(load_wrapper(info, "embed"), Path(scratch) / "model.onnx")
        model = openvino_models(onnx, 2, True, info.tokenizer_file, info.max_seq)["openvino_int8"]
        names = ("input_ids", "attention_mask", "token_type_ids", "position_ids")
        return {name: np.concatenate([model(dict(zip(names, row))) for row in
                                      encoded(info.tokenizer_file, sentences, info.max_seq)])
                for name, sentences in sets.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=PROG, description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--artifacts", type=Path, nargs="+", required=True)
    parser.add_argument("--model", type=Path, default=None, help="checkpoint (default: bundled all-MiniLM-L6-v2)")
    parser.add_argument("--openvino", action="store_true", help="also OpenVINO NNCF int8")
    parser.add_argument("--out", type=Path, default=None, help="write the table as JSON here")
    args = parser.parse_args(argv)
    try:
        for directory in args.artifacts:  # before minutes of reference encodings
            read_manifest(directory)
    except ArtifactError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    from sentence_transformers import SentenceTransformer

    from compile.config import default_model_dir

    model_dir = args.model or default_model_dir()
    reference = SentenceTransformer(str(model_dir), device="cpu")
    expected = {name: reference.encode(sentences, batch_size=1) for name, sentences in SETS.items()}
    outputs = {str(directory): {name: artifact_outputs(directory, sentences) for name, sentences in SETS.items()}
               for directory in args.artifacts}
    if args.openvino:
        outputs["openvino NNCF int8"] = openvino_int8_outputs(model_dir, SETS)
    table = {}
    for label, by_set in outputs.items():
        table[label] = {}
        for name, actual in by_set.items():
            found = cosines(actual, expected[name])
            table[label][name] = {"cosine_min": round(float(found.min()), 5),
                                  "cosine_mean": round(float(found.mean()), 5),
                                  "worst": SETS[name][int(found.argmin())]}
    print("| | " + " | ".join(f"{name}: least cosine (on) | {name}: mean" for name in SETS) + " |")
    print("|---|" + "---|---|" * len(SETS))
    for label, by_set in table.items():
        cells = [f"{r['cosine_min']:.4f} ({r['worst'][:24]!r}) | {r['cosine_mean']:.4f}" for r in by_set.values()]
        print(f"| {label} | " + " | ".join(cells) + " |")
    if args.out is not None:
        args.out.write_text(json.dumps(table, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
