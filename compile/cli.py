"""`bert-compile` / `python -m compile`: flags override the YAML config; bad input exits 2."""

from __future__ import annotations

import argparse
import logging
import signal
import sys
from collections import Counter
from dataclasses import replace
from pathlib import Path

from artifact.hub import HubError, HubModel, download, is_repo_id, resolve

from .config import CompileConfig, load_config
from .errors import CompileError
from .progress import Progress, summary_table


def build_parser() -> argparse.ArgumentParser:
    """The flags, each overriding its config key; docs/COMPILE.md's reference is rendered from them."""
    parser = argparse.ArgumentParser(
        prog="bert-compile",
        description="Compile a Hugging Face BERT checkpoint into bucketed TVM libraries.",
    )
    parser.add_argument("--config", type=Path, help="YAML file of compile settings (configs/*.yaml)")
    parser.add_argument("--model", type=Path, help="checkpoint directory, or a Hugging Face Hub model id ORG/NAME "
                        "(downloaded; a directory of that name wins) (default: bundled all-MiniLM-L6-v2)")
    parser.add_argument("--revision", help="Hub model: the branch, tag or commit (default: main)")
    parser.add_argument("--hf-token", help="Hub model: a token that can read a private or gated one "
                        "(default: HF_TOKEN)")
    parser.add_argument("--huggingface-hub-cache", type=Path,
                        help="Hub model: where downloads are cached (default: HF_HUB_CACHE, ~/.cache/huggingface/hub)")
    parser.add_argument("--task", choices=["embed", "classify", "rerank", "sparse", "colbert"],
                        help="rerank: a cross-encoder (a classifier with one label), served on /rerank; sparse: SPLADE "
                             "from a *ForMaskedLM or SparseEncoder checkpoint, served on /embed_sparse; colbert: a PyLate "
                             "checkpoint's projected token vectors, served on /embed_multi (detected under embed)")
    parser.add_argument("--target", choices=["cpu", "cuda"])
    parser.add_argument("--cuda-arch", dest="cuda_arch", help="CUDA architecture (default sm_90)")
    parser.add_argument("--dtype", choices=["float32", "float16"], help="float16: CUDA only")
    parser.add_argument("--cuda-graph", dest="cuda_graph", action="store_true", default=None,
                        help="capture CUDA bucket libraries as CUDA graphs")
    parser.add_argument("--mcpu", help="LLVM CPU name (default: this machine's); several, comma-separated (e.g. "
                        "x86-64-v3,x86-64-v4), build one artifact whose loader picks the best level the CPU has")
    parser.add_argument("--layout", choices=["padded", "packed"],
                        help="packed: run on the real tokens only, no padding (cpu)")
    parser.add_argument("--buckets", help="comma-separated BATCHxSEQ shapes, e.g. 1x16,8x128 (packed: packed-SEQ, "
                        "e.g. packed-64,packed-512)")
    parser.add_argument("--max-batch", dest="max_batch", type=int, help="generic library's batch bound")
    parser.add_argument("--pooling", choices=["auto", "mean", "cls", "max", "none", "splade", "colbert"],
                        help="none: the libraries return every token's final hidden state and nothing else (every "
                        "embedding model serves /embed_all); colbert: --task colbert")
    parser.add_argument("--strategy", choices=["auto", "concat", "batched", "off"],
                        help="how parallel matmuls are combined; auto times all three per bucket")
    parser.add_argument("--strategy-margin", dest="strategy_margin", type=float,
                        help="auto: a library leaves the shared strategy (one more weight set in memory) only when "
                             "faster by more than this fraction (default 0.03)")
    parser.add_argument("--sparsity", type=_sparsity, help="prune this fraction of weight blocks, e.g. 0.9 (changes the "
                        "model); from-checkpoint: use the blocks the checkpoint already has at zero (does not)")
    parser.add_argument("--block", help="sparse block shape ROWSxCOLS (default 16x1)")
    parser.add_argument("--sparse-layers", dest="sparse_layers",
                        help="comma-separated: ffn, attention_output, qkv (default ffn,attention_output)")
    parser.add_argument("--sparse-choice", dest="sparse_choice", choices=["timed", "density"],
                        help="timed (default): each weight no denser than sparse_max_density on the fastest of its "
                             "precision's dense kernel and the sparse kernels within its accuracy, timed on this CPU; "
                             "density: every such weight on fp32 blocks")
    parser.add_argument("--precision", choices=["fp32", "bf16", "int8", "auto"],
                        help="what the linear layers compute in (cpu): bf16 needs AVX512_BF16, int8 AVX2; auto builds "
                             "each one this CPU runs and ships the fastest that keeps its accuracy gate")
    parser.add_argument("--min-cosine", dest="min_cosine", type=float,
                        help="bf16 / int8: fail when embeddings fall under this cosine to the fp32 model's (int8 "
                             "first keeps its most sensitive linears out of int8 to keep it); auto: ship no bf16 or "
                             "int8 candidate under it")
    parser.add_argument("--attention-products", dest="attention_products", choices=["auto", "fp32", "bf16"],
                        help="attention's products beside bf16 / int8 linears: auto (default) times fp32 against the "
                             "CPU's bf16 and (int8 libraries) int8 and keeps the fastest, fp32 unless another is "
                             "faster; fp32 or bf16 force one")
    parser.add_argument("--tune", type=float, metavar="SECONDS",
                        help="MetaSchedule search per padded bucket (cpu): a tuned kernel replaces the hand schedule "
                             "only where it was faster in a timed run; the kept schedules ship in tuning/")
    parser.add_argument("--out", type=Path, help="artifact directory to write (default: artifacts/ and the checkpoint "
                        "directory's name; artifacts/minilm-cpu for the bundled model)")
    parser.add_argument("--no-validate", dest="validate", action="store_false", default=None,
                        help="skip the comparison with PyTorch")
    parser.add_argument("--quiet", action="store_true", help="no progress lines")
    return parser


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def _sparsity(value: str) -> float | str:
    if value == "from-checkpoint":
        return value
    try:
        return float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is neither a fraction nor from-checkpoint") from None


_terminated_by: int | None = None  # the signal that ended the compile


def _raise_on_sigterm(signum, _frame):
    """End the compile so that the staging directory is cleaned up. Raised inside a Python callback of
    TVM's, the SystemExit comes back out of TVM as a RuntimeError: `main` then exits as the signal asked."""
    global _terminated_by
    _terminated_by = signum
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    signal.signal(signal.SIGTERM, _raise_on_sigterm)
    overrides = {
        key: getattr(args, key)
        for key in ("model", "task", "target", "cuda_arch", "dtype", "cuda_graph", "mcpu", "layout", "max_batch", "pooling",
                    "strategy", "strategy_margin", "sparsity", "block", "precision", "min_cosine", "attention_products",
                    "tune", "out", "validate")
    }
    for key in ("buckets", "sparse_layers"):
        if getattr(args, key) is not None:
            overrides[key] = getattr(args, key).split(",")
    try:
        config = _checkpoint_from_hub(load_config(args.config, overrides), args)
        from .pipeline import compile_model  # heavy imports (torch, tvm) only once input is sane

        progress = Progress(0, quiet=args.quiet)
        if len(config.cpu_levels) > 1:
            from .levels import compile_levels

            results = compile_levels(config, progress)
        else:
            results = [compile_model(config, progress)]
    except (CompileError, HubError) as exc:
        print(f"bert-compile: error: {exc}", file=sys.stderr)
        return 2
    except Exception:
        if _terminated_by is None:
            raise
        return 128 + _terminated_by
    for manifest, records in results:
        if len(results) > 1:
            print(f"level {manifest.target.mcpu} ({config.out / manifest.target.mcpu}):", file=sys.stderr)
        _report(manifest, records, config.validate_artifacts)
    print(f"wrote {config.out}" + (f" (levels {config.mcpu})" if len(results) > 1 else ""), file=sys.stderr)
    return 0


def _checkpoint_from_hub(config: CompileConfig, args: argparse.Namespace) -> CompileConfig:
    """A model named by its Hub id rather than a directory: its checkpoint, downloaded (or from the Hub cache). The
    artifact's default name is the model's (artifacts/NAME), and its manifest records the repository and commit."""
    if config.model is None or not is_repo_id(str(config.model)):
        if args.revision is not None:
            raise CompileError("--revision is for a model named by its Hub id (--model ORG/NAME), not a directory")
        return config
    model = HubModel(str(config.model), args.revision, args.hf_token, args.huggingface_hub_cache)
    snapshot = resolve(model)  # before anything is printed: a model that cannot be had is one line
    if not args.quiet:
        print(f"fetching {snapshot.repo_id} at commit {snapshot.sha} (what the Hub cache holds is not downloaded "
              "again)", file=sys.stderr, flush=True)
    return config.model_copy(update={"model": download(replace(model, revision=snapshot.sha)).directory})


def _report(manifest, records, validate: bool) -> None:
    """What one compile built: per library its build time, strategy and difference to PyTorch, and
    whether (else why not: `validate` false is --no-validate) the libraries were validated."""
    rows = [
        (r.name, r.library, f"{r.seconds:.1f}", r.strategy,
         ", ".join(f"{s} {ms:.1f}" for s, ms in r.strategy_ms.items()) if r.strategy_ms else "-",
         ", ".join(f"{shape}: {'n/a' if d is None else f'{d:.1e}'}" for shape, d in r.diffs.items()))
        for r in records
    ]
    header = ("library", "file", "build s", "strategy", "strategy ms", "max |tvm - torch|")
    print(summary_table(rows, header), file=sys.stderr)
    before = manifest.passes.before
    for strategy, passes in manifest.passes.strategies.items():
        after = passes.after
        print(
            f"{strategy}: matmul {before.matmul} -> {after.matmul}, concat {before.concat} -> {after.concat}, "
            f"permute_dims {before.permute_dims} -> {after.permute_dims}",
            file=sys.stderr,
        )
    if manifest.sparsity is not None:
        sp = manifest.sparsity
        changed = (f"{sp.pruned} weights pruned to blocks {sp.block}, cosine vs dense {sp.cosine_vs_dense:.4f}"
                   if sp.mode == "pruned" else f"the checkpoint's own zero blocks {sp.block} (model unchanged)")
        kernels = Counter(c.chosen for c in sp.choices if c.chosen)
        chosen = f" ({', '.join(f'{n} {name}' for name, n in sorted(kernels.items()))})" if kernels else ""
        print(f"sparsity: {changed}; {sp.rewritten} matmuls rewritten (density {sp.density}){chosen}", file=sys.stderr)
        if sp.sentences_vs_dense and "cosine_min" in sp.sentences_vs_dense:
            print(f"sparsity: pruned vs dense on the shipped sentences: least cosine "
                  f"{sp.sentences_vs_dense['cosine_min']:.4f} ({sp.sentences_vs_dense['worst_sentence']!r})",
                  file=sys.stderr)
    if manifest.validated:
        print("validated against PyTorch", file=sys.stderr)
    else:
        print("NOT validated: " + ("--no-validate" if not validate else "its libraries cannot run on this machine "
                                   "(python -m compile.verify --artifacts DIR where they can)"), file=sys.stderr)
