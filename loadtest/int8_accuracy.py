"""How close compiled artifacts (and, with --openvino, OpenVINO NNCF int8) stay to
sentence-transformers fp32 on natural text: the sentences the compile measures its precision on
(compile/sentences.py), held-out ones it never sees (one-word queries included), and held-out
passages of 130-210 tokens. Each text runs alone, as one query would.

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

from .machine import describe as describe_machine
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
# Passages of 130-210 tokens, as long as the chunks a retrieval index embeds, which no
# shipped sentence is: int8's error adds up over more tokens before mean pooling.
HELDOUT_PASSAGES = [
    "The city council met on Tuesday evening to discuss the proposed redevelopment of the old railway yards. "
    "Residents who live near the site raised concerns about traffic, noise during construction, and the loss "
    "of the informal green space where children play and people walk their dogs. The developer presented "
    "revised plans that include a public park, a primary school and four hundred homes, a quarter of which "
    "would be offered at below-market rents. Several councillors asked whether the existing roads could carry "
    "the extra cars, and the transport officer replied that a new bus route and a protected cycle lane were "
    "part of the agreement. The vote was postponed until an independent traffic study is published next spring.",
    "To replace a bicycle inner tube, first shift the chain onto the smallest rear sprocket and open the brake "
    "so that the wheel can pass between the pads. Loosen the quick release or the axle nuts and pull the wheel "
    "out of the frame. Use two tyre levers to lift one bead of the tyre over the rim, working around the wheel "
    "until that side is free, then pull out the old tube. Run your fingers carefully around the inside of the "
    "tyre to find the thorn or piece of glass that caused the puncture; if you leave it there, the new tube will "
    "go flat within minutes. Inflate the new tube just enough to give it shape, push the valve through the hole "
    "in the rim, tuck the tube inside the tyre, and press the bead back over the rim with your thumbs. Check "
    "that the tube is not pinched anywhere before pumping it up to the pressure printed on the tyre wall.",
    "Photosynthesis takes place mainly in the leaves of plants, inside small structures called chloroplasts. "
    "Chlorophyll absorbs red and blue light and reflects green, which is why most leaves look green to us. "
    "The energy captured from light is used to split water molecules, releasing oxygen as a by-product, and to "
    "produce energy carriers that drive the second stage of the process. In that stage, carbon dioxide taken "
    "from the air through tiny pores in the leaf is combined into sugars. Plants use those sugars to grow, to "
    "build cellulose for their cell walls, and to store energy as starch in roots, seeds and tubers. Because "
    "almost every food chain on land begins with plants, photosynthesis ultimately supplies the energy for "
    "nearly all animals, including the people who grow, harvest and eat crops.",
    "Our support team received several reports this week from customers who could not log in after the latest "
    "update of the mobile app. The problem affects accounts that use single sign-on through an employer, and only "
    "on phones where the operating system has not been updated for more than a year. After the user enters a "
    "password, the app shows a blank screen and returns to the login page without an error message. Engineers "
    "traced the fault to an expired certificate in an older library that the app still bundles for those "
    "devices. A fix has been submitted to both app stores and should be available within two days. Until then, "
    "affected customers can sign in through the website, where all account features work as usual, or update "
    "their phone's operating system, which also resolves the issue. We apologise for the inconvenience and will "
    "credit one month of the subscription to every account that contacted us about this problem.",
    "The history of the printed book in Europe is usually dated from the middle of the fifteenth century, when "
    "movable metal type, oil-based ink and a press adapted from those used to make wine were combined in a single "
    "workshop. Within fifty years printers were at work in more than two hundred towns, and millions of copies "
    "had been produced. Early printed books imitated manuscripts closely: they used the same letter shapes, left "
    "spaces for initials to be painted by hand, and were often decorated after printing. Prices fell steadily, "
    "and books that had been owned only by monasteries, universities and wealthy families began to appear in "
    "the homes of merchants and craftsmen. Historians still debate how quickly reading spread among ordinary "
    "people, but there is little doubt that printing changed how knowledge was stored, copied and argued about. "
    "Errors in a manuscript were unique to that copy, whereas an error in a printed edition was repeated in every "
    "copy of it, which encouraged careful proofreading, lists of corrections, and eventually new editions that "
    "claimed to be more accurate than the ones before them.",
    "A good night's sleep depends less on the number of hours spent in bed than on keeping a regular rhythm. "
    "Going to bed and getting up at roughly the same times every day, including weekends, helps the body's "
    "internal clock anticipate when to release the hormones that make us feel sleepy or alert. Bright light in "
    "the morning strengthens that rhythm, while bright screens late in the evening can delay it. Caffeine stays "
    "in the blood for many hours, so a coffee in the afternoon may still affect sleep at midnight. Alcohol can "
    "make it easier to fall asleep but tends to fragment sleep later in the night. A cool, dark and quiet "
    "bedroom helps, and so does keeping the bed for sleep rather than for work. People who lie awake for a long "
    "time are often advised to get up, do something calm in dim light, and return to bed only when they feel "
    "sleepy, so that the bed does not become associated with frustration.",
]
SETS = {"shipped": ACCURACY_SENTENCES, "held-out": HELDOUT_SENTENCES, "passages": HELDOUT_PASSAGES}


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
        command = f"{PROG} " + " ".join(argv if argv is not None else sys.argv[1:])
        args.out.write_text(json.dumps({"command": command, "machine": describe_machine(), "accuracy": table},
                                       indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
