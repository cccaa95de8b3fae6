"""Checkpoints by their Hugging Face Hub name, for `bert-compile --model ORG/NAME` and `bert-serve --model-id`.

Files come through huggingface_hub into its own cache, so HF_ENDPOINT, HF_HUB_OFFLINE, HF_TOKEN and HF_HUB_CACHE mean
what they mean to every Hugging Face tool, and a commit once fetched is there offline. Only what a checkpoint needs is
fetched (CHECKPOINT_FILES, one weight format): no ONNX, TensorFlow, Flax or OpenVINO copies. `resolve` is cheap
(the commit a revision names, and config.json) and refuses a model of a family we do not compile before its weights
are downloaded. Every failure a person can act on is a HubError: one line that says what to do.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, replace
from pathlib import Path

from .manifest import MODEL_TYPES, remote_code_refusal

REPO_ID = re.compile(r"[\w.-]+(?:/[\w.-]+)?")
WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")  # the first the repository has is the one fetched
CHECKPOINT_FILES = (
    "config.json",
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt", "vocab.json", "merges.txt",
    "sentencepiece.bpe.model", "spm.model", "added_tokens.json",  # slow tokenizers' files, converted when compiled
    # sentence-transformers: its modules, their folders (1_Pooling/, 2_Dense/, ...), input limit and prompts
    "modules.json", "sentence_bert_config.json", "config_sentence_transformers.json", "[0-9]_*/*",
)


class HubError(Exception):
    """A Hub model that cannot be had: reported as one line."""


@dataclass(frozen=True)
class HubModel:
    repo_id: str
    revision: str | None = None  # a branch, tag or commit; None: the default branch
    token: str | None = None  # None: HF_TOKEN, or the token `hf auth login` saved
    cache_dir: Path | None = None  # None: HF_HUB_CACHE (TEI's --huggingface-hub-cache)

    @property
    def named(self) -> str:
        return f"{self.repo_id} (revision {self.revision})" if self.revision else self.repo_id


@dataclass(frozen=True)
class Snapshot:
    repo_id: str
    sha: str  # the commit
    directory: Path


def is_repo_id(text: str) -> bool:
    """Whether `text` can name a Hub model (ORG/NAME or NAME); a directory that exists is never one."""
    return REPO_ID.fullmatch(text) is not None and "--" not in text and ".." not in text and not Path(text).is_dir()


def resolve(model: HubModel) -> Snapshot:
    """The commit `model.revision` names (from the Hub, or offline from the local cache), with its config.json;
    refused where the model is not of a family we compile or has no weights we read."""
    directory = _snapshot(model, ["config.json"])
    config = json.loads((directory / "config.json").read_text())
    model_type = config.get("model_type")
    refusal = remote_code_refusal(config, model.repo_id)
    if refusal is not None:
        raise HubError(refusal)
    if model_type not in MODEL_TYPES:
        architectures = ", ".join(config.get("architectures") or []) or "no architectures named"
        raise HubError(f"{model.repo_id} is a {model_type or 'model without a model_type'} model ({architectures}); "
                       f"only the BERT family compiles here: {', '.join(MODEL_TYPES)}")
    files = _listed_files(model, directory.name)
    if files is not None and not any(name in files for name in WEIGHT_FILES):
        raise HubError(f"{model.repo_id} has no {' or '.join(WEIGHT_FILES)} at commit {directory.name}")
    return Snapshot(model.repo_id, directory.name, directory)


def download(model: HubModel) -> Snapshot:
    """`resolve`, then fetch the checkpoint's files at that commit (nothing where they are cached)."""
    resolved = resolve(model)
    pinned = replace(model, revision=resolved.sha)
    files = _listed_files(pinned, resolved.sha)
    weights = [next((name for name in WEIGHT_FILES if name in files), WEIGHT_FILES[0])] if files else list(WEIGHT_FILES)
    return replace(resolved, directory=_snapshot(pinned, [*CHECKPOINT_FILES, *weights]))


def _listed_files(model: HubModel, sha: str) -> set[str] | None:
    """The files of the commit, from the listing huggingface_hub cached when it resolved it (None: none cached)."""
    from huggingface_hub import get_cached_repo_tree
    from huggingface_hub.errors import CachedRepoTreeNotFoundError

    try:
        return {entry.path for entry in get_cached_repo_tree(model.repo_id, revision=sha, cache_dir=model.cache_dir)}
    except CachedRepoTreeNotFoundError:
        return None


def _snapshot(model: HubModel, patterns: list[str]) -> Path:
    """huggingface_hub's snapshot_download of `patterns`, its failures said in one line."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, HfHubHTTPError, LocalEntryNotFoundError
    from huggingface_hub.utils import disable_progress_bars

    disable_progress_bars()  # bars redrawn with carriage returns garble a server's log; callers say what happens
    try:
        return Path(snapshot_download(model.repo_id, revision=model.revision, cache_dir=model.cache_dir,
                                      token=model.token, allow_patterns=patterns))
    except HFValidationError:
        raise HubError(f"{model.repo_id!r} is neither a directory nor a Hub model id (ORG/NAME)") from None
    except LocalEntryNotFoundError as exc:
        raise HubError(_not_cached(model, exc)) from None
    except HfHubHTTPError as exc:
        raise HubError(_refused(model, exc)) from None


def _not_cached(model: HubModel, exc: Exception) -> str:
    from huggingface_hub import constants
    from huggingface_hub.errors import IncompleteSnapshotError

    cache = model.cache_dir or constants.HF_HUB_CACHE
    if isinstance(exc, IncompleteSnapshotError):
        what = f"the Hub cache {cache} holds {model.named} only in part"
    else:
        what = f"{model.named} is not in the Hub cache {cache}"
    if constants.HF_HUB_OFFLINE:
        return f"HF_HUB_OFFLINE is set and {what}: unset it to download, or point HF_HUB_CACHE at a cache that has it"
    cause = exc.__cause__ or exc.__context__
    reason = f" ({type(cause).__name__})" if cause is not None else ""
    return f"cannot reach {constants.ENDPOINT}{reason} and {what}"


def _refused(model: HubModel, exc) -> str:
    """What the Hub's refusal means for the person asking."""
    from huggingface_hub import constants, get_token
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError, RevisionNotFoundError

    status = exc.response.status_code if exc.response is not None else None
    hub = constants.ENDPOINT
    has_token = (model.token or get_token()) is not None
    if isinstance(exc, RevisionNotFoundError):
        return f"{model.repo_id} has no revision {model.revision!r} on {hub}"
    if isinstance(exc, GatedRepoError):
        return f"{model.repo_id} is gated on {hub}: accept its conditions there with the account of the token given"
    if isinstance(exc, RepositoryNotFoundError) and status != 401:
        return f"no model {model.repo_id} on {hub} (nor a directory of that name here)"
    if status == 401 and not has_token:
        return (f"{model.repo_id} is private or gated on {hub} (or does not exist): give a token that can read it "
                "with --hf-token or HF_TOKEN")
    if status in (401, 403):
        return f"{hub} refused the token given (--hf-token or HF_TOKEN) for {model.repo_id}: can it read the model?"
    return f"{hub} answered {status} for {model.repo_id}: {str(exc).splitlines()[0]}"
