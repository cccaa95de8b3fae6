"""A stand-in for the Hugging Face Hub's HTTP API on 127.0.0.1, as much of it as huggingface_hub's snapshot_download
calls (reached through HF_ENDPOINT): a model's commit for a revision, the commit's file tree, and its files.

It answers as the Hub does where a repository cannot be read: 404 (RepoNotFound) for one that does not exist, 401 for
a private one without a token, and 401 "Invalid credentials" for a token it does not know. A test can hold the
download of a file (`hold`) until it releases it, to see what a server does meanwhile; every request is recorded.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

TOKEN = "hf_stand_in_token"


def commit_sha(name: str) -> str:
    return hashlib.sha1(name.encode()).hexdigest()


def git_blob_id(content: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(content) + content).hexdigest()


@dataclass
class Repo:
    commits: dict[str, dict[str, bytes]]  # sha -> {path: content}
    refs: dict[str, str]  # branch or tag -> sha
    private: bool = False

    def sha(self, revision: str) -> str | None:
        return revision if revision in self.commits else self.refs.get(revision)


def checkpoint_files(directory: Path) -> dict[str, bytes]:
    return {path.relative_to(directory).as_posix(): path.read_bytes()
            for path in sorted(directory.rglob("*")) if path.is_file()}


@dataclass
class Gate:
    """A file's download, held: `arrived` once a GET of it came, answered once `release()`d."""

    arrived: threading.Event = field(default_factory=threading.Event)
    released: threading.Event = field(default_factory=threading.Event)

    def release(self) -> None:
        self.released.set()


class HubStandIn:
    def __init__(self, repos: dict[str, Repo]):
        self.repos = repos
        self.requests: list[tuple[str, str]] = []  # (method, path)
        self.gates: dict[str, Gate] = {}  # file path in the repository -> its held download
        self._lock = threading.Lock()
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler_class())
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> "HubStandIn":
        self._thread.start()
        return self

    def __exit__(self, *_) -> None:
        self.stop()

    def stop(self) -> None:
        for gate in self.gates.values():
            gate.release()
        self.server.shutdown()
        self.server.server_close()

    def hold(self, path: str) -> Gate:
        """Hold every GET of `path` (in any repository) until the gate is released."""
        self.gates[path] = Gate()
        return self.gates[path]

    def fetched(self, repo_id: str) -> list[str]:
        """The files of `repo_id` whose content was downloaded (GET), in order."""
        prefix = f"/{repo_id}/resolve/"
        with self._lock:
            return [path[len(prefix):].split("/", 1)[1] for method, path in self.requests
                    if method == "GET" and path.startswith(prefix)]

    def _record(self, method: str, path: str) -> None:
        with self._lock:
            self.requests.append((method, path))

    def _handler_class(self):
        stand_in = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *_) -> None:
                pass

            def do_GET(self) -> None:
                stand_in._answer(self, "GET")

            def do_HEAD(self) -> None:
                stand_in._answer(self, "HEAD")

        return Handler

    def _answer(self, request: BaseHTTPRequestHandler, method: str) -> None:
        path = unquote(urlsplit(request.path).path)
        self._record(method, path)
        api = re.fullmatch(r"/api/models/(?P<repo>[^/]+(?:/[^/]+)?)(?:/(?P<kind>revision|tree)/(?P<rev>[^/]+))?"
                           r"(?:/.*)?", path)
        resolve = re.fullmatch(r"/(?P<repo>[^/]+(?:/[^/]+)?)/resolve/(?P<rev>[^/]+)/(?P<file>.+)", path)
        found = api or resolve
        if found is None:
            return self._send(request, 404, b"{}", {"X-Error-Code": "EntryNotFound"})
        repo = self.repos.get(found["repo"])
        if repo is None:
            return self._send(request, 404, b'{"error": "Repository not found"}', {"X-Error-Code": "RepoNotFound"})
        refused = self._refusal(repo, request.headers.get("authorization"))
        if refused is not None:
            return self._send(request, 401, b'{"error": "unauthorized"}', refused)
        sha = repo.sha(found["rev"] or "main")
        if sha is None:
            return self._send(request, 404, b'{"error": "Revision not found"}', {"X-Error-Code": "RevisionNotFound"})
        files = repo.commits[sha]
        if api is not None and api["kind"] == "tree":
            return self._send_json(request, self._tree(files))
        if api is not None:
            return self._send_json(request, {"id": found["repo"], "modelId": found["repo"], "sha": sha,
                                             "private": repo.private,
                                             "siblings": [{"rfilename": name} for name in files]})
        content = files.get(found["file"])
        if content is None:
            return self._send(request, 404, b"{}", {"X-Error-Code": "EntryNotFound"})
        gate = self.gates.get(found["file"])
        if gate is not None and method == "GET":
            gate.arrived.set()
            gate.released.wait()
        self._send(request, 200, content, {"X-Repo-Commit": sha, "ETag": f'"{git_blob_id(content)}"'})

    @staticmethod
    def _refusal(repo: Repo, authorization: str | None) -> dict[str, str] | None:
        if not repo.private or authorization == f"Bearer {TOKEN}":
            return None
        if authorization is None:
            return {"X-Error-Code": "RepoNotFound", "X-Error-Message": "Invalid username or password."}
        return {"X-Error-Message": "Invalid credentials in Authorization header"}

    @staticmethod
    def _tree(files: dict[str, bytes]) -> list[dict]:
        folders = sorted({str(Path(name).parent) for name in files} - {"."})
        return ([{"type": "directory", "oid": commit_sha(folder), "path": folder} for folder in folders]
                + [{"type": "file", "oid": git_blob_id(content), "size": len(content), "path": name}
                   for name, content in files.items()])

    def _send_json(self, request: BaseHTTPRequestHandler, data) -> None:
        self._send(request, 200, json.dumps(data).encode(), {"Content-Type": "application/json"})

    @staticmethod
    def _send(request: BaseHTTPRequestHandler, status: int, content: bytes, headers: dict[str, str]) -> None:
        request.send_response(status)
        for name, value in headers.items():
            request.send_header(name, value)
        request.send_header("Content-Length", str(len(content)))
        request.end_headers()
        if request.command != "HEAD":
            request.wfile.write(content)
