"""Push a consolidated model folder to the Hugging Face Hub, verified. The only module importing huggingface_hub's
upload side.

The protocol, every remote step through huggingface_hub's own API (auth — ``--token``, ``HF_TOKEN``, the stored
login — and ``HF_ENDPOINT`` are resolved by it; large files, LFS, retries and progress bars are its job):

1. **Plan, locally** (:func:`plan_push`, no network). The allowlist: the weights (``model.safetensors``, or the
   shards the index names plus the index), ``config.json``, ``generation_config.json``, tokenizer and processor
   files, remote-code ``configuration_*.py`` / ``modeling_*.py`` / ``tokenization_*.py``, and the card. Top-level
   files only; everything else is skipped with a reason (hidden files, pickles such as ``*.pt`` optimizer shards,
   folders, shards the index does not name, ``zckpt.json``). An allowlisted name that is a symlink leaving FOLDER is
   an error, never followed. The weights must be complete: the index names every shard, every shard exists, its
   safetensors header parses, its tensors are the ones the index maps to it, and each file's size is exactly what
   its header says (so a truncated copy is caught before anything is sent). The card is FOLDER's own README.md, or
   one generated with :class:`huggingface_hub.ModelCard` from ``zckpt.json`` (see :func:`write_facts`). ``--dry-run``
   stops here.
2. **Repo**: ``create_repo(exist_ok=True)`` (skipped with ``--create-pr``: a pull request needs an existing repo),
   then with ``--revision`` ``create_branch(exist_ok=True)``.
3. **Listing** ``list_repo_tree(revision)``: a README.md already in the repo is kept unless ``overwrite_card``; remote
   weight files (``model*.safetensors``, ``pytorch_model*.bin`` and their indexes) that this model does not include
   are deleted in the same commit — a stale ``model.safetensors`` beside a new index is what ``from_pretrained``
   would load.
4. **One commit**: ``create_commit`` with a ``CommitOperationAdd`` per allowlisted file and the deletions.
5. **Verify** ``list_repo_tree(revision=<the new commit>)``: every pushed file is there with the local size, and the
   local sha256 (LFS files; the Hub reports it) or git blob id (regular files); the deleted ones are gone. Any
   difference is a :class:`~zckpt.errors.HubVerifyError`: a push that is not verified is not done.

Remote failures become one-line :class:`~zckpt.errors.HubError` s naming the fix (401/403 token, 404 repo or
revision, network, a server failing mid-upload).
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import math
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterator

from .errors import (HubAuthError, HubError, HubNotFoundError, HubVerifyError, InvalidArgumentError,
                     ModelFolderError)
from .plan import FLOAT_DTYPES
from .safetensors_header import HeaderError, read_header
from .writers.hf_safetensors import _CODE_FILE_RE, INDEX_NAME, MODEL_FILES, WEIGHTS_NAME

#: Beside the weights, written by ``zckpt consolidate``: the training facts for the card.
FACTS_NAME = "zckpt.json"
CARD_NAME = "README.md"
#: Remote files that are weights of *a* model: deleted when this push does not include them.
STALE_WEIGHTS = ("model*.safetensors", "model.safetensors.index.json", "pytorch_model*.bin",
                 "pytorch_model.bin.index.json")
PICKLE_SUFFIXES = (".pt", ".pth", ".bin", ".pkl", ".pickle", ".ckpt")
HUB_MAX_FILE = 50 * 10**9  # the Hub refuses larger LFS objects


@dataclass(frozen=True)
class UploadFile:
    """One file of the push: ``name`` in FOLDER and in the repo (top level), its bytes on disk or in memory."""

    name: str
    role: str  # weights | index | config | tokenizer | code | card
    size: int
    path: Path | None = None  # resolved; None for a generated card
    data: bytes | None = None


@dataclass(frozen=True)
class PushPlan:
    folder: Path
    files: tuple[UploadFile, ...]  # the allowlist, card last
    skipped: tuple[tuple[str, str], ...]  # (name, why)
    card_source: str  # "folder" (FOLDER/README.md) | "generated"
    facts: dict[str, Any] | None
    parameters: int
    warnings: tuple[str, ...] = ()

    @property
    def card(self) -> UploadFile:
        return self.files[-1]


@dataclass
class PushResult:
    repo_id: str
    revision: str
    dry_run: bool
    files: list[dict[str, Any]]  # name, role, bytes, sha256 (after the push)
    skipped: list[dict[str, str]]
    card: str  # generated | folder | kept (the repo's own README.md was kept)
    bytes: int
    repo_url: str | None = None
    commit_url: str | None = None
    commit_oid: str | None = None
    pr_url: str | None = None
    deleted: list[str] = field(default_factory=list)
    verified: bool = False
    warnings: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# ---- 1. the local plan ---------------------------------------------------------------------------------------

def plan_push(folder: str | Path, repo_id: str) -> PushPlan:
    """The allowlist, the completeness check and the card; reads FOLDER only."""
    folder = Path(folder)
    if not folder.is_dir():
        raise ModelFolderError(f"{folder} is not a folder; pass the OUT folder of `zckpt consolidate`")
    root = folder.resolve()
    weights, parameters, dtype = _weight_files(folder, root)
    chosen = {f.name for f in weights}
    files, skipped, warnings = list(weights), [], []
    for path in sorted(folder.iterdir(), key=lambda p: p.name):
        if path.name in chosen or path.name == CARD_NAME:
            continue
        role, why = _classify(path, root)
        if role is None:
            skipped.append((path.name, why))
            continue
        _check_json(path)
        files.append(UploadFile(path.name, role, path.stat().st_size, _inside(path, root)))
    if not (folder / "config.json").is_file():
        warnings.append("no config.json: from_pretrained needs one; copy the training run's config.json into the "
                        "folder")
    warnings += [f"{f.name} is {f.size / 1e9:.1f} GB, over the Hub's 50 GB per file: consolidate with "
                 "--max-shard-size 5GB" for f in files if f.size > HUB_MAX_FILE]
    facts = read_facts(folder)
    card_path = folder / CARD_NAME
    if card_path.exists() or card_path.is_symlink():
        resolved = _inside(card_path, root)
        card = UploadFile(CARD_NAME, "card", resolved.stat().st_size, resolved)
        source = "folder"
    else:
        config = _read_json(folder / "config.json") if (folder / "config.json").is_file() else {}
        data = model_card(repo_id, facts, config, parameters, dtype).encode("utf-8")
        card, source = UploadFile(CARD_NAME, "card", len(data), data=data), "generated"
    return PushPlan(folder, tuple(files) + (card,), tuple(skipped), source, facts, parameters, tuple(warnings))


def _weight_files(folder: Path, root: Path) -> tuple[list[UploadFile], int, str | None]:
    """The weights of a complete consolidated model: (files, parameter count, dominant float dtype)."""
    single, index = folder / WEIGHTS_NAME, folder / INDEX_NAME
    if single.exists() and index.exists():
        raise ModelFolderError(f"{folder} holds both {WEIGHTS_NAME} and {INDEX_NAME}; from_pretrained would load "
                               f"only {WEIGHTS_NAME}: remove the stale one (or consolidate into an empty folder)")
    if not single.exists() and not index.exists():
        raise ModelFolderError(f"{folder} holds no {WEIGHTS_NAME} or {INDEX_NAME}: not a consolidated model; run "
                               f"`zckpt consolidate SRC {folder}` first")
    if single.exists():
        path = _inside(single, root)
        tensors = _check_safetensors(path)
        return [UploadFile(WEIGHTS_NAME, "weights", path.stat().st_size, path)], *_count(tensors)
    index_path = _inside(index, root)
    index_data = _read_json(index_path)
    weight_map = index_data.get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise ModelFolderError(f"{index} has no weight_map: re-run `zckpt consolidate`")
    by_shard: dict[str, set[str]] = {}
    for tensor, shard in weight_map.items():
        if not isinstance(shard, str):
            raise ModelFolderError(f"{index} maps {tensor} to {shard!r}, not a file name: re-run `zckpt consolidate`")
        by_shard.setdefault(shard, set()).add(tensor)
    files, tensors = [], {}
    for shard in sorted(by_shard):
        if Path(shard).name != shard or shard.startswith(".") or shard in ("..", ""):
            raise ModelFolderError(f"{index} names shard {shard!r}, not a file beside it; a shard must be a plain "
                                   "file name in the folder")
        path = folder / shard
        if not (path.exists() or path.is_symlink()):
            raise ModelFolderError(f"{path} is missing but {INDEX_NAME} names it: the folder is incomplete; copy it "
                                   "again or re-run `zckpt consolidate`")
        resolved = _inside(path, root)
        header = _check_safetensors(resolved)
        if set(header) != by_shard[shard]:
            extra, missing = sorted(set(header) - by_shard[shard]), sorted(by_shard[shard] - set(header))
            raise ModelFolderError(f"{path} does not hold the tensors {INDEX_NAME} maps to it (index only: "
                                   f"{missing[:3]}, file only: {extra[:3]}): re-run `zckpt consolidate`")
        tensors.update(header)
        files.append(UploadFile(shard, "weights", resolved.stat().st_size, resolved))
    total = (index_data.get("metadata") or {}).get("total_size")
    data_bytes = sum(t.end - t.begin for t in tensors.values())
    if total is not None and total != data_bytes:
        raise ModelFolderError(f"{index} says total_size {total} but its shards hold {data_bytes} bytes of tensors: "
                               "the index belongs to another model; re-run `zckpt consolidate`")
    return files + [UploadFile(INDEX_NAME, "index", index_path.stat().st_size, index_path)], *_count(tensors)


def _check_safetensors(path: Path) -> dict:
    """The file's tensors (``{name: TensorSpan}``), after checking its header and that the file is exactly header +
    tensor bytes long."""
    try:
        data_start, tensors = read_header(path)
    except HeaderError as exc:
        raise ModelFolderError(f"{exc}: damaged; copy it again or re-run `zckpt consolidate`") from None
    size, end = path.stat().st_size, max((t.end for t in tensors.values()), default=0)
    if size != data_start + end:
        raise ModelFolderError(f"{path} is {size} bytes but its header describes {data_start + end}: truncated or "
                               "damaged; copy it again or re-run `zckpt consolidate`")
    return tensors


def _count(tensors: dict) -> tuple[int, str | None]:
    counts: dict[str, int] = {}
    for t in tensors.values():
        counts[t.dtype] = counts.get(t.dtype, 0) + math.prod(t.shape)
    floats = {d: n for d, n in counts.items() if d in FLOAT_DTYPES}
    return sum(counts.values()), max(floats, key=floats.get) if floats else None


def _classify(path: Path, root: Path) -> tuple[str | None, str]:
    """(role, "") for an allowlisted file, or (None, why it is skipped). An allowlisted name that is a link leaving
    FOLDER raises rather than being skipped: the model would be pushed without it."""
    name = path.name
    if name.startswith("."):
        return None, "hidden"
    if name in ("config.json", "generation_config.json"):
        role = "config"
    elif name in MODEL_FILES:
        role = "tokenizer"
    elif _CODE_FILE_RE.match(name):
        role = "code"
    elif path.is_symlink() and not _is_inside(path, root):
        return None, "symlink leaving the folder"
    elif path.is_dir():
        return None, "folder (only top-level model files are pushed)"
    elif name.endswith(PICKLE_SUFFIXES):
        return None, "pickle / optimizer state: never pushed"
    elif name == FACTS_NAME:
        return None, "zckpt's facts: used for the card, not pushed"
    elif name.endswith(".safetensors"):
        return None, f"not named by {INDEX_NAME}" if (path.parent / INDEX_NAME).exists() else "not the model's weights"
    else:
        return None, "not a model file"
    _inside(path, root)
    return role, ""


def _is_inside(path: Path, root: Path) -> bool:
    resolved = path.resolve()
    return resolved == root or root in resolved.parents


def _inside(path: Path, root: Path) -> Path:
    """``path`` resolved; an allowlisted file that is a symlink leaving the folder is refused, never followed."""
    resolved = path.resolve()
    if root not in resolved.parents:
        raise ModelFolderError(f"{path} is a symlink to {resolved}, outside {root.name}/; nothing outside the folder "
                               f"is pushed: replace the link by a copy of the file")
    if not resolved.is_file():
        raise ModelFolderError(f"{path} is not a regular file")
    return resolved


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ModelFolderError(f"{path} is not valid JSON ({exc}); fix it or re-run `zckpt consolidate`") from None
    if not isinstance(data, dict):
        raise ModelFolderError(f"{path} is not a JSON object; fix it or re-run `zckpt consolidate`")
    return data


def _check_json(path: Path) -> None:
    if path.suffix == ".json":
        _read_json(path)


# ---- the facts and the card ----------------------------------------------------------------------------------

def write_facts(folder: Path, facts: dict[str, Any]) -> None:
    """Write ``zckpt.json`` beside the weights: what the checkpoint said about its training, for the card.

    Keys: ``source_format``, ``source_version``, ``zero_stage``, ``world_size``, ``train_dtype``, ``step``, ``tag``,
    ``dtype``, ``parameters``, ``tensors``, ``tied``, ``written_by``; optional ``best`` (``{"metric", "value"}``,
    from a tracked best checkpoint). No local paths: the facts may end up in a public card.
    """
    (folder / FACTS_NAME).write_text(json.dumps(facts, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def read_facts(folder: Path) -> dict[str, Any] | None:
    path = folder / FACTS_NAME
    if not path.is_file():
        return None
    return _read_json(path)


def model_card(repo_id: str, facts: dict[str, Any] | None, config: dict[str, Any], parameters: int,
               dtype: str | None) -> str:
    """README.md text: huggingface_hub's ModelCard with ``library_name: transformers``, tags, and the facts."""
    from huggingface_hub import ModelCard, ModelCardData

    facts = facts or {}
    dtype = facts.get("dtype") or dtype
    architecture = (config.get("architectures") or [None])[0]
    tags = ["zckpt"] + [t for t in (facts.get("source_format"), dtype) if t]
    if facts.get("zero_stage") is not None:
        tags.append(f"zero-{facts['zero_stage']}")
    meta = {k: facts[k] for k in ("source_format", "source_version", "zero_stage", "world_size", "train_dtype",
                                  "step", "best") if facts.get(k) is not None}
    meta.update(parameters=parameters, dtype=dtype)
    data = ModelCardData(library_name="transformers", tags=tags, zckpt=meta,
                         pipeline_tag="text-generation" if str(architecture).endswith("ForCausalLM") else None)
    rows = [("architecture", architecture or config.get("model_type")), ("parameters", f"{parameters:,}"),
            ("dtype", dtype),
            ("source format", " ".join(str(facts[k]) for k in ("source_format", "source_version") if facts.get(k))),
            ("ZeRO stage", facts.get("zero_stage")), ("world size", facts.get("world_size")),
            ("training dtype", facts.get("train_dtype")), ("step", facts.get("step")),
            ("checkpoint tag", facts.get("tag"))]
    if facts.get("best"):
        rows.append(("best metric", f"{facts['best'].get('metric')} = {facts['best'].get('value')}"))
    table = "\n".join(f"| {k} | {v} |" for k, v in rows if v not in (None, ""))
    origin = ("Consolidated from a sharded ZeRO checkpoint" if facts else "Consolidated") + \
        " with zckpt into Hugging Face safetensors."
    if not facts:
        origin += " No `zckpt.json` was found beside the weights, so the training facts are not recorded here."
    body = (f"# {repo_id.split('/')[-1]}\n\n{origin}\n\n| | |\n|---|---|\n{table}\n\n## Use\n\n```python\n"
            f"from transformers import AutoModel{'ForCausalLM' if data.pipeline_tag else ''}\n\n"
            f"model = AutoModel{'ForCausalLM' if data.pipeline_tag else ''}.from_pretrained(\"{repo_id}\")\n```\n")
    return str(ModelCard(f"---\n{data.to_yaml()}\n---\n\n{body}"))


# ---- 2-5. the push -------------------------------------------------------------------------------------------

def push(folder: str | Path, repo_id: str, *, private: bool = False, revision: str | None = None,
         commit_message: str | None = None, create_pr: bool = False, token: str | None = None,
         dry_run: bool = False, overwrite_card: bool = False, quiet: bool = True) -> PushResult:
    """Push FOLDER (a consolidated model) to ``repo_id`` and verify the commit; see the module docstring."""
    started = time.perf_counter()
    _check_repo_id(repo_id)
    plan = plan_push(folder, repo_id)
    result = PushResult(repo_id=repo_id, revision=revision or "main", dry_run=dry_run,
                        files=[{"name": f.name, "role": f.role, "bytes": f.size} for f in plan.files],
                        skipped=[{"name": n, "why": w} for n, w in plan.skipped], card=plan.card_source,
                        bytes=sum(f.size for f in plan.files), warnings=list(plan.warnings))
    if not dry_run:
        from .outdir import signals_raise

        with _progress(quiet), signals_raise():  # SIGTERM/SIGHUP end it like Ctrl-C: the commit is all or nothing
            _push_plan(plan, result, private=private, commit_message=commit_message, create_pr=create_pr,
                       token=token, overwrite_card=overwrite_card)
    result.seconds = round(time.perf_counter() - started, 3)
    return result


def _push_plan(plan: PushPlan, result: PushResult, *, private: bool, commit_message: str | None, create_pr: bool,
               token: str | None, overwrite_card: bool) -> None:
    from huggingface_hub import CommitOperationAdd, CommitOperationDelete, HfApi
    from huggingface_hub.hf_api import RepoFile

    api = HfApi(token=token)
    step = _Step(api, result.repo_id, result.revision, token)
    with step("creating the repository"):
        if not create_pr:
            url = api.create_repo(result.repo_id, private=True if private else None, exist_ok=True)
            result.repo_id, result.repo_url = url.repo_id, str(url)
            if result.revision != "main":
                api.create_branch(result.repo_id, branch=result.revision, exist_ok=True)
        else:
            result.repo_url = f"{api.endpoint}/{result.repo_id}"
    with step("listing the repository"):
        remote = {e.path for e in api.list_repo_tree(result.repo_id, revision=result.revision)
                  if isinstance(e, RepoFile)}
    files = list(plan.files)
    if CARD_NAME in remote and not overwrite_card:
        files.remove(plan.card)
        result.card = "kept"
    names = {f.name for f in files}
    result.deleted = sorted(p for p in remote - names if any(fnmatch.fnmatch(p, pat) for pat in STALE_WEIGHTS))
    ops = [CommitOperationAdd(path_in_repo=f.name, path_or_fileobj=f.data if f.data is not None else str(f.path))
           for f in files] + [CommitOperationDelete(path_in_repo=p) for p in result.deleted]
    with step("uploading and committing"):
        info = api.create_commit(result.repo_id, ops, commit_message=commit_message or "Upload model with zckpt",
                                 commit_description=_description(plan), revision=result.revision,
                                 create_pr=create_pr)
    result.commit_url, result.commit_oid, result.pr_url = info.commit_url, info.oid, info.pr_url
    shas = {op.path_in_repo: op.upload_info.sha256.hex() for op in ops if isinstance(op, CommitOperationAdd)}
    result.files = [{"name": f.name, "role": f.role, "bytes": f.size, "sha256": shas[f.name]} for f in files]
    result.bytes = sum(f.size for f in files)
    with step("verifying the commit"):
        _verify(api, result, files, shas)
    result.verified = True


def _description(plan: PushPlan) -> str:
    """The commit's description: what the model is and where it came from."""
    facts = plan.facts or {}
    text = f"{plan.parameters:,} parameters"
    if facts.get("dtype"):
        text += f" at {facts['dtype']}"
    if facts.get("source_format"):
        text += (f", consolidated from a {facts['source_format']} ZeRO-{facts.get('zero_stage')} checkpoint "
                 f"({facts.get('world_size')} ranks, step {facts.get('step')})")
    return text + "; pushed with zckpt"


def _verify(api, result: PushResult, files: list[UploadFile], shas: dict[str, str]) -> None:
    """Compare the commit's files with the local bytes: names, sizes, sha256 (LFS) or git blob id (regular)."""
    from huggingface_hub.hf_api import RepoFile

    remote = {e.path: e for e in api.list_repo_tree(result.repo_id, revision=result.commit_oid)
              if isinstance(e, RepoFile)}
    problems = []
    for f in files:
        entry = remote.get(f.name)
        if entry is None:
            problems.append(f"{f.name} is missing")
        elif entry.size != f.size:
            problems.append(f"{f.name} is {entry.size} bytes on the Hub, {f.size} here")
        elif entry.lfs is not None and (entry.lfs.sha256 != shas[f.name] or entry.lfs.size != f.size):
            problems.append(f"{f.name} has sha256 {entry.lfs.sha256[:12]}… on the Hub, {shas[f.name][:12]}… here")
        elif entry.lfs is None and entry.blob_id != _git_blob_id(f):
            problems.append(f"{f.name} has git blob {entry.blob_id[:12]}… on the Hub, {_git_blob_id(f)[:12]}… here")
    problems += [f"{p} should have been deleted" for p in result.deleted if p in remote]
    if problems:
        raise HubVerifyError(f"the commit {result.commit_url} does not match the local files: {'; '.join(problems)}; "
                             "push again, and report it if it persists")


def _git_blob_id(f: UploadFile) -> str:
    sha = hashlib.sha1(b"blob %d\0" % f.size)
    if f.data is not None:
        sha.update(f.data)
    else:
        with open(f.path, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                sha.update(chunk)
    return sha.hexdigest()


def check_can_push(repo_id: str, token: str | None = None) -> None:
    """Fail fast, before a long consolidation: a valid REPO_ID and a token the Hub accepts."""
    from huggingface_hub import HfApi

    _check_repo_id(repo_id)
    api = HfApi(token=token)
    with _Step(api, repo_id, "main", token)("checking the token"):
        api.whoami()


def _check_repo_id(repo_id: str) -> None:
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(repo_id)
    except HFValidationError as exc:
        raise InvalidArgumentError(f"REPO_ID {repo_id!r} is not a Hub repository id ({exc}); use e.g. "
                                   "user/model") from None


@contextmanager
def _progress(quiet: bool) -> Iterator[None]:
    """``quiet``: none of the client's progress bars, nor its warnings (retries, "no files modified")."""
    from huggingface_hub.utils import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars
    from huggingface_hub.utils import logging as hf_logging

    bars_were_off, level = are_progress_bars_disabled(), hf_logging.get_verbosity()
    if quiet:
        disable_progress_bars()
        hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        if quiet:
            hf_logging.set_verbosity(level)
            if not bars_were_off:
                enable_progress_bars()


class _Step:
    """``with step("uploading"):`` turns what huggingface_hub raises into one-line HubErrors naming the fix."""

    def __init__(self, api, repo_id: str, revision: str, token: str | None) -> None:
        self.api, self.repo_id, self.revision, self.token = api, repo_id, revision, token

    @contextmanager
    def __call__(self, doing: str) -> Iterator[None]:
        from huggingface_hub.errors import HfHubHTTPError, LocalTokenNotFoundError

        try:
            yield
        except LocalTokenNotFoundError:
            raise HubAuthError(f"no Hugging Face token found while {doing}: run `hf auth login`, set HF_TOKEN or "
                               "pass --token") from None
        except HfHubHTTPError as exc:
            raise self._http_error(exc, doing) from exc
        except Exception as exc:
            root = _root_cause(exc)
            if isinstance(root, HfHubHTTPError):
                raise self._http_error(root, doing, _first_line(exc)) from exc
            if not _is_transport_error(root) and not isinstance(exc, (RuntimeError, ValueError, OSError)):
                raise
            detail = f"{type(root).__name__}: {_first_line(root)}"
            if not _is_transport_error(exc) and exc is not root:  # the client's wrapper names the file
                detail = f"{_first_line(exc)} {detail}"
            raise HubError(f"the Hub at {self.api.endpoint} failed while {doing} ({detail}): check the network "
                           f"(or HF_ENDPOINT); {_retry(doing)}") from exc

    def _http_error(self, exc, doing: str, context: str = "") -> HubError:
        from huggingface_hub.errors import RevisionNotFoundError
        from huggingface_hub.utils import get_token

        status = exc.response.status_code if exc.response is not None else None
        said = _first_line(exc.server_message or exc)
        where = f"{self.api.endpoint} ({status} while {doing}{': ' + context if context else ''}: {said})"
        namespace = self.repo_id.split("/")[0] if "/" in self.repo_id else "your"
        if status == 401:
            if self.token is None and get_token() is None:
                return HubAuthError(f"not logged in to {where}: run `hf auth login`, set HF_TOKEN or pass --token "
                                    "(a token with write access)")
            return HubAuthError(f"the Hub refused the token at {where}: it is invalid or expired; create a write "
                                f"token at {self.api.endpoint}/settings/tokens, pass it with --token or HF_TOKEN")
        if status == 403:
            return HubAuthError(f"the token may not write to {self.repo_id} at {where}: use a token with write "
                                f"access to the '{namespace}' namespace (read-only and fine-grained tokens without "
                                "write permission cannot push)")
        if status == 404 and isinstance(exc, RevisionNotFoundError):
            return HubNotFoundError(f"revision {self.revision!r} not found in {self.repo_id} at {where}: create the "
                                    "branch first, or drop --revision")
        if status == 404:
            return HubNotFoundError(f"repository {self.repo_id} not found at {where}: check REPO_ID (and the token's "
                                    "access to it); --create-pr needs an existing repository")
        return HubError(f"the Hub at {where} failed: {_retry(doing)}")


def _retry(doing: str) -> str:
    if doing == "verifying the commit":
        return "the commit was made but not verified; run the same command again to verify it (unchanged files are " \
               "not uploaded again)"
    return "nothing was committed; run the same command again (files already uploaded are not sent twice)"


def _root_cause(exc: BaseException) -> BaseException:
    """The HfHubHTTPError behind ``exc`` (the client wraps upload failures in RuntimeError), else the deepest cause."""
    from huggingface_hub.errors import HfHubHTTPError

    seen = {id(exc)}
    while not isinstance(exc, HfHubHTTPError):
        nxt = exc.__cause__ or exc.__context__
        if nxt is None or id(nxt) in seen:
            break
        seen.add(id(nxt))
        exc = nxt
    return exc


def _is_transport_error(exc: BaseException) -> bool:
    return isinstance(exc, (ConnectionError, TimeoutError)) or \
        type(exc).__module__.split(".")[0] in ("httpx", "httpx2", "httpcore", "httpcore2", "requests", "urllib3")


def _first_line(value: Any) -> str:
    lines = [line.strip() for line in str(value).splitlines() if line.strip()]
    return lines[0] if lines else type(value).__name__


# ---- text output ---------------------------------------------------------------------------------------------

def render(result: PushResult) -> list[str]:
    """Lines for the CLI. The first says what happened; a success line only after the commit is verified."""
    from .report import human_bytes

    pushed = result.files
    where = f"{result.repo_id}@{result.revision}"
    if result.dry_run:
        lines = [f"dry run: would push {len(pushed)} file(s), {human_bytes(result.bytes)}, to {where} "
                 "(nothing remote was touched)"]
        lines += [f"  {human_bytes(f['bytes']):>10}  {f['name']}  ({f['role']})" for f in pushed]
        lines.append(f"  card: {_card_words(result.card, dry_run=True)}")
        lines.append(f"  remote weight files not in this list ({', '.join(STALE_WEIGHTS)}) would be deleted")
    else:
        target = result.pr_url or result.commit_url
        lines = [f"pushed {len(pushed)} file(s), {human_bytes(result.bytes)}, to {where}: {target}",
                 "  verified: the commit's names, sizes and hashes (LFS sha256, git blob ids) match the local files",
                 f"  card: {_card_words(result.card, dry_run=False)}"]
        if result.deleted:
            lines.append(f"  deleted stale weights: {', '.join(result.deleted)}")
    if result.skipped:
        lines.append("  skipped: " + ", ".join(f"{s['name']} ({s['why']})" for s in result.skipped))
    lines += [f"  warning: {w}" for w in result.warnings]
    return lines


def _card_words(card: str, dry_run: bool) -> str:
    unless = " (unless the repo already has one; --overwrite-card replaces it)" if dry_run else ""
    return {"generated": "README.md generated" + unless, "folder": "the folder's README.md" + unless,
            "kept": "the repo's README.md was kept (--overwrite-card replaces it)"}[card]
