"""A local Hugging Face Hub for the tests: the subset of the Hub's HTTP API that huggingface_hub's upload path speaks.

Served on 127.0.0.1 at a random port by a threaded ``http.server``, in memory. Point the real client at it with
``HF_ENDPOINT`` (and ``HF_HUB_DISABLE_XET=1``, which keeps the client on the git-LFS path). Routes, as the client
calls them during ``create_repo`` / ``create_commit`` / ``list_repo_tree``:

* ``POST /api/repos/create``                                  -> 200 ``{"url"}``, 409 when it exists
* ``GET  /api/whoami-v2``                                     -> the token's user
* ``POST /api/validate-yaml``                                 -> README metadata check (always fine)
* ``GET  /api/models/{repo}/revision/{rev}``                  -> repo info (sha, siblings; ``blobs=1`` adds sizes)
* ``POST /api/models/{repo}/branch/{branch}``                 -> create a branch from main, 409 when it exists
* ``POST /api/models/{repo}/preupload/{rev}``                 -> per file ``uploadMode`` (lfs for weights) and ``oid``
* ``POST /{repo}.git/info/lfs/objects/batch``                 -> LFS batch: an upload + verify action per new object
* ``PUT  /_lfs/upload/{sha256}`` then ``POST /_lfs/verify``   -> the object store (checks the sha256 of the body)
* ``POST /api/models/{repo}/commit/{rev}``                    -> NDJSON: header, file (base64), lfsFile, deletedFile
* ``GET  /api/models/{repo}/tree/{rev}[/{path}]``             -> files with size, git blob id and LFS sha256; paged
  through ``Link: <...>; rel="next"`` like the Hub (``page_size``)

Auth as the Hub: ``Authorization: Bearer <token>``; an unknown token is a 401 ("Invalid credentials in Authorization
header"), none on a write is a 401, a read token writing or a user writing outside its namespaces is a 403, a
missing repo is a 404 ``RepoNotFound``, a missing revision a 404 ``RevisionNotFound``. Faults for the tests:
``drop_put_after`` (that many LFS PUTs succeed, later ones lose the connection halfway through the body),
``commit_status`` (the commit endpoint answers that status), ``tree_lies`` (``{path: "size" | "sha256"}``: the listing
misreports that file).
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
import socket
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, unquote, urlsplit

LFS_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".h5", ".msgpack", ".model", ".ckpt")
GITATTRIBUTES = b"*.safetensors filter=lfs diff=lfs merge=lfs -text\n*.bin filter=lfs diff=lfs merge=lfs -text\n"


def git_blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@dataclass(frozen=True)
class Blob:
    data: bytes
    lfs: bool

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.data).hexdigest()

    @property
    def pointer(self) -> bytes:
        return (f"version https://git-lfs.github.com/spec/v1\noid sha256:{self.sha256}\nsize {len(self.data)}\n"
                .encode())

    @property
    def oid(self) -> str:
        """The git blob id the Hub reports: of the content, or of the LFS pointer file."""
        return git_blob_id(self.pointer if self.lfs else self.data)


@dataclass
class Commit:
    oid: str
    parent: str | None
    message: str
    files: dict[str, Blob]


@dataclass
class Repo:
    repo_id: str
    private: bool
    refs: dict[str, str] = field(default_factory=dict)  # "main", "refs/pr/1" -> commit oid
    commits: dict[str, Commit] = field(default_factory=dict)
    prs: int = 0


class HubError(Exception):
    def __init__(self, status: int, message: str, code: str | None = None, header_message: str | None = None,
                 **extra) -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.header_message = status, message, code, header_message
        self.extra = extra


class LocalHub:
    """In-memory Hub state plus the server thread. Use as a context manager; ``url`` is the endpoint."""

    def __init__(self) -> None:
        self.tokens: dict[str, tuple[str, str]] = {"hf_write": ("alice", "write"), "hf_read": ("alice", "read")}
        self.namespaces: dict[str, set[str]] = {"alice": {"alice", "alice-org"}}
        self.repos: dict[str, Repo] = {}
        self.objects: dict[str, bytes] = {}  # LFS store: sha256 -> bytes
        self.log: list[tuple[str, str, str | None]] = []  # (method, path, token)
        self.puts = 0
        self.page_size = 1000
        self.drop_put_after: int | None = None
        self.commit_status: int | None = None
        self.tree_lies: dict[str, str] = {}
        self.lock = threading.RLock()
        self._counter = 0
        self._server: ThreadingHTTPServer | None = None

    # ---- lifecycle -------------------------------------------------------------------------------------------
    def __enter__(self) -> "LocalHub":
        hub = self

        class Handler(_Handler):
            pass

        Handler.hub = hub
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        assert self._server is not None
        self._server.shutdown()
        self._server.server_close()

    @property
    def url(self) -> str:
        assert self._server is not None
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    # ---- what tests look at ----------------------------------------------------------------------------------
    def files(self, repo_id: str, revision: str = "main") -> dict[str, bytes]:
        repo = self.repos[repo_id]
        return {p: b.data for p, b in repo.commits[self.resolve(repo, revision)].files.items()}

    def add_repo(self, repo_id: str, files: dict[str, bytes] | None = None, private: bool = False) -> Repo:
        """Create a repo directly (as if made earlier), with ``files`` committed on main."""
        with self.lock:
            repo = Repo(repo_id, private)
            blobs = {".gitattributes": Blob(GITATTRIBUTES, False)}
            for path, data in (files or {}).items():
                blob = Blob(data, path.endswith(LFS_SUFFIXES))
                if blob.lfs:
                    self.objects[blob.sha256] = data
                blobs[path] = blob
            self._commit(repo, "main", None, "initial commit", blobs)
            self.repos[repo_id] = repo
            return repo

    # ---- state helpers ---------------------------------------------------------------------------------------
    def _new_oid(self) -> str:
        self._counter += 1
        return hashlib.sha1(f"commit {self._counter}".encode()).hexdigest()

    def _commit(self, repo: Repo, ref: str, parent: str | None, message: str, files: dict[str, Blob]) -> Commit:
        commit = Commit(self._new_oid(), parent, message, files)
        repo.commits[commit.oid] = commit
        repo.refs[ref] = commit.oid
        return commit

    def resolve(self, repo: Repo, revision: str) -> str:
        if revision in repo.refs:
            return repo.refs[revision]
        if revision in repo.commits:
            return revision
        raise HubError(404, f"Invalid rev id: {revision}", code="RevisionNotFound")

    def user(self, token: str | None, need: str) -> str | None:
        """The token's user; raises 401 for an unknown token, or for none when ``need`` is "write"."""
        if token is None:
            if need == "write":
                raise HubError(401, "You must be authenticated to access this endpoint")
            return None
        if token not in self.tokens:
            raise HubError(401, "Invalid credentials in Authorization header",
                           header_message="Invalid credentials in Authorization header")
        return self.tokens[token][0]

    def repo(self, repo_id: str, token: str | None, need: str) -> Repo:
        user = self.user(token, need)
        repo = self.repos.get(repo_id)
        visible = repo is not None and (not repo.private or repo_id.split("/")[0] in self.namespaces.get(user, ()))
        if not visible:
            raise HubError(404, "Repository not found", code="RepoNotFound")
        if need == "write":
            self.check_write(user, repo_id.split("/")[0], token)
        return repo

    def check_write(self, user: str | None, namespace: str, token: str | None) -> None:
        if self.tokens.get(token, (None, "read"))[1] != "write":
            raise HubError(403, "You have read access but not the required permissions for this operation.")
        if namespace not in self.namespaces.get(user, ()):
            raise HubError(403, f'You don\'t have the rights to create a model under the namespace "{namespace}"')


class _Handler(BaseHTTPRequestHandler):
    hub: LocalHub
    protocol_version = "HTTP/1.1"
    wbufsize = 1 << 16  # headers and body leave in one segment (else delayed ACKs cost ~40 ms a request)
    disable_nagle_algorithm = True

    def log_message(self, format, *args) -> None:  # quiet
        pass

    def do_GET(self) -> None:
        self._dispatch("GET")

    def do_POST(self) -> None:
        self._dispatch("POST")

    def do_PUT(self) -> None:
        self._dispatch("PUT")

    # ---- plumbing --------------------------------------------------------------------------------------------
    def _dispatch(self, method: str) -> None:
        parts = urlsplit(self.path)
        self.query = {k: v[-1] for k, v in parse_qs(parts.query).items()}
        auth = self.headers.get("Authorization", "")
        self.token = auth[len("Bearer "):] if auth.startswith("Bearer ") else None
        with self.hub.lock:
            self.hub.log.append((method, parts.path, self.token))
        for route_method, pattern, handler in ROUTES:
            match = pattern.fullmatch(parts.path)
            if route_method == method and match:
                try:
                    args = {k: unquote(v) if v is not None else None for k, v in match.groupdict().items()}
                    result = handler(self, **args)
                except HubError as exc:
                    self._error(exc)
                    return
                if result is not None:
                    self._json(200, *result) if isinstance(result, tuple) else self._json(200, result)
                return
        self._error(HubError(404, f"no route for {method} {parts.path}"))

    def _body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            chunks = []
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip(), 16)
                chunk = self.rfile.read(size)
                self.rfile.readline()
                if size == 0:
                    return b"".join(chunks)
                chunks.append(chunk)
        return self.rfile.read(int(self.headers.get("Content-Length") or 0))

    def _json_body(self):
        return json.loads(self._body() or b"{}")

    def _json(self, status: int, payload, headers: dict[str, str] | None = None) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.end_headers()
        self.wfile.write(data)

    def _error(self, exc: HubError) -> None:
        headers = {}
        if exc.code:
            headers["X-Error-Code"] = exc.code
        if exc.header_message:
            headers["X-Error-Message"] = exc.header_message
        if self.command in ("POST", "PUT") and not getattr(self, "_consumed", False):
            self.close_connection = True  # the request body may be unread: do not reuse the connection
        self._json(exc.status, {"error": exc.message, **exc.extra}, headers)

    @property
    def base(self) -> str:
        return self.hub.url

    # ---- routes ----------------------------------------------------------------------------------------------
    def create_repo(self):
        body = self._json_body()
        self._consumed = True
        user = self.hub.user(self.token, "write")
        namespace = body.get("organization") or user
        repo_id = f"{namespace}/{body['name']}"
        self.hub.check_write(user, namespace, self.token)
        with self.hub.lock:
            if repo_id in self.hub.repos:
                raise HubError(409, "You already created this model repo", url=f"{self.base}/{repo_id}")
            self.hub.add_repo(repo_id, private=body.get("visibility") == "private" or bool(body.get("private")))
        return {"url": f"{self.base}/{repo_id}", "name": repo_id}

    def whoami(self):
        user = self.hub.user(self.token, "write")
        return {"type": "user", "name": user, "auth": {"accessToken": {"role": self.hub.tokens[self.token][1]}}}

    def validate_yaml(self):
        self._json_body()
        self._consumed = True
        return {"errors": [], "warnings": []}

    def repo_info(self, repo: str, rev: str):
        r = self.hub.repo(repo, self.token, "read")
        commit = r.commits[self.hub.resolve(r, rev)]
        blobs = self.query.get("blobs") in ("1", "true", "True")
        siblings = []
        for path, blob in sorted(commit.files.items()):
            entry = {"rfilename": path}
            if blobs:
                entry.update(size=len(blob.data), blobId=blob.oid)
                if blob.lfs:
                    entry["lfs"] = {"sha256": blob.sha256, "size": len(blob.data), "pointerSize": len(blob.pointer)}
            siblings.append(entry)
        return {"id": repo, "modelId": repo, "sha": commit.oid, "private": r.private, "siblings": siblings}

    def create_branch(self, repo: str, branch: str):
        self._json_body()
        self._consumed = True
        r = self.hub.repo(repo, self.token, "write")
        with self.hub.lock:
            if branch in r.refs:
                raise HubError(409, f"Reference already exists: refs/heads/{branch}")
            r.refs[branch] = r.refs["main"]
        return {}

    def preupload(self, repo: str, rev: str):
        body = self._json_body()
        self._consumed = True
        r = self.hub.repo(repo, self.token, "write")
        head = r.commits[self.hub.resolve(r, rev)]
        files = []
        for f in body["files"]:
            lfs = f["path"].endswith(LFS_SUFFIXES)
            old = head.files.get(f["path"])
            oid = None if old is None else (old.sha256 if old.lfs else git_blob_id(old.data))
            files.append({"path": f["path"], "uploadMode": "lfs" if lfs else "regular", "shouldIgnore": False,
                          "oid": oid})
        return {"files": files, "commitOid": head.oid}

    def lfs_batch(self, repo: str):
        body = self._json_body()
        self._consumed = True
        self.hub.repo(repo, self.token, "write")
        objects = []
        for obj in body["objects"]:
            if obj["oid"] in self.hub.objects:
                objects.append({"oid": obj["oid"], "size": obj["size"]})
                continue
            objects.append({"oid": obj["oid"], "size": obj["size"], "authenticated": True, "actions": {
                "upload": {"href": f"{self.base}/_lfs/upload/{obj['oid']}"},
                "verify": {"href": f"{self.base}/_lfs/verify/{obj['oid']}"}}})
        return {"transfer": "basic", "objects": objects}, {"Content-Type": "application/vnd.git-lfs+json"}

    def lfs_upload(self, oid: str):
        with self.hub.lock:
            self.hub.puts += 1
            drop = self.hub.drop_put_after is not None and self.hub.puts > self.hub.drop_put_after
        if drop:  # read half the body, then the server "dies": no response, connection reset
            self.rfile.read(int(self.headers.get("Content-Length") or 2) // 2)
            self.close_connection = True
            self.connection.shutdown(socket.SHUT_RDWR)
            return None
        data = self._body()
        self._consumed = True
        if hashlib.sha256(data).hexdigest() != oid:
            raise HubError(400, "sha256 of the uploaded body does not match the object id")
        with self.hub.lock:
            self.hub.objects[oid] = data
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.send_header("ETag", f'"{oid[:32]}"')
        self.end_headers()
        return None

    def lfs_verify(self, oid: str):
        body = self._json_body()
        self._consumed = True
        stored = self.hub.objects.get(body["oid"])
        if body["oid"] != oid or stored is None or len(stored) != body["size"]:
            raise HubError(404, "Object not found or size mismatch")
        return {"success": True}

    def commit(self, repo: str, rev: str):
        lines = [json.loads(line) for line in self._body().splitlines() if line.strip()]
        self._consumed = True
        r = self.hub.repo(repo, self.token, "write")
        if self.hub.commit_status is not None:
            raise HubError(self.hub.commit_status, "Internal Error - We're working hard to fix this as soon as possible")
        with self.hub.lock:
            head = self.hub.resolve(r, rev)
            files = dict(r.commits[head].files)
            header = {}
            for line in lines:
                key, value = line["key"], line["value"]
                if key == "header":
                    header = value
                elif key == "file":
                    files[value["path"]] = Blob(base64.b64decode(value["content"]), False)
                elif key == "lfsFile":
                    data = self.hub.objects.get(value["oid"])
                    if data is None or ("size" in value and len(data) != value["size"]):
                        raise HubError(422, f"Your push was rejected because an LFS pointer pointed to a file that "
                                            f"does not exist ({value['path']})")
                    files[value["path"]] = Blob(data, True)
                elif key == "deletedFile":
                    if files.pop(value["path"], None) is None:
                        raise HubError(404, "A file with this name doesn't exist", code="EntryNotFound")
                elif key == "deletedFolder":
                    files = {p: b for p, b in files.items() if not p.startswith(value["path"].rstrip("/") + "/")}
            if header.get("parentCommit") not in (None, head):
                raise HubError(412, "A commit has happened since. Please refresh and try again.")
            pr = self.query.get("create_pr") == "1"
            if pr:
                r.prs += 1
            ref = f"refs/pr/{r.prs}" if pr else rev
            commit = self.hub._commit(r, ref, head, header.get("summary", ""), files)
        return {"success": True, "commitOid": commit.oid, "commitUrl": f"{self.base}/{repo}/commit/{commit.oid}",
                "pullRequestUrl": f"{self.base}/{repo}/discussions/{r.prs}" if pr else None}

    def tree(self, repo: str, rev: str, path: str | None = None):
        r = self.hub.repo(repo, self.token, "read")
        commit = r.commits[self.hub.resolve(r, rev)]
        prefix = (path.strip("/") + "/") if path else ""
        recursive = self.query.get("recursive") in ("True", "true", "1")
        entries, folders = [], set()
        for p, blob in sorted(commit.files.items()):
            if not p.startswith(prefix):
                continue
            rest = p[len(prefix):]
            if "/" in rest:
                parts = rest.split("/")
                for depth in range(1, len(parts) if recursive else 2):
                    folders.add(prefix + "/".join(parts[:depth]))
                if not recursive:
                    continue
            entries.append(self._entry(p, blob))
        entries += [{"type": "directory", "oid": git_blob_id(f.encode()), "size": 0, "path": f} for f in folders]
        entries.sort(key=lambda e: e["path"])
        start = int(self.query.get("cursor", 0))
        page = entries[start:start + self.hub.page_size]
        headers = {}
        if start + self.hub.page_size < len(entries):
            tail = f"/{path}" if path else ""
            headers["Link"] = (f'<{self.base}/api/models/{repo}/tree/{rev}{tail}?recursive={recursive}'
                               f'&expand=False&cursor={start + self.hub.page_size}>; rel="next"')
        return page, headers

    def _entry(self, path: str, blob: Blob) -> dict:
        size, sha = len(blob.data), blob.sha256
        lie = self.hub.tree_lies.get(path)
        if lie == "size":
            size += 1
        elif lie == "sha256":
            sha = hashlib.sha256(blob.data + b"x").hexdigest()
        entry = {"type": "file", "oid": blob.oid, "size": size, "path": path}
        if blob.lfs:
            entry["lfs"] = {"oid": sha, "size": size, "pointerSize": len(blob.pointer)}
        return entry


_REPO = r"(?P<repo>[^/]+/[^/]+)"
ROUTES = [(m, re.compile(p), h) for m, p, h in [
    ("POST", r"/api/repos/create", _Handler.create_repo),
    ("GET", r"/api/whoami-v2", _Handler.whoami),
    ("POST", r"/api/validate-yaml", _Handler.validate_yaml),
    ("GET", rf"/api/models/{_REPO}/revision/(?P<rev>[^/]+)", _Handler.repo_info),
    ("POST", rf"/api/models/{_REPO}/branch/(?P<branch>[^/]+)", _Handler.create_branch),
    ("POST", rf"/api/models/{_REPO}/preupload/(?P<rev>[^/]+)", _Handler.preupload),
    ("POST", rf"/api/models/{_REPO}/commit/(?P<rev>[^/]+)", _Handler.commit),
    ("GET", rf"/api/models/{_REPO}/tree/(?P<rev>[^/]+)(?:/(?P<path>.*))?", _Handler.tree),
    ("POST", rf"/{_REPO}\.git/info/lfs/objects/batch", _Handler.lfs_batch),
    ("PUT", r"/_lfs/upload/(?P<oid>[0-9a-f]{64})", _Handler.lfs_upload),
    ("POST", r"/_lfs/verify/(?P<oid>[0-9a-f]{64})", _Handler.lfs_verify),
]]
