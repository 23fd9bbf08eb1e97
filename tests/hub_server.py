"""A local stand-in for the Hugging Face Hub's upload API, on a real socket in a thread, for tests of
``streamgrpo model push``: the endpoints ``HfApi.create_repo`` and ``HfApi.upload_folder`` call
(``POST /api/repos/create``, ``POST /api/validate-yaml`` for README.md, ``POST /api/models/{repo}/preupload/{revision}``, ``POST
/api/models/{repo}/commit/{revision}``), answered as the Hub answers them (huggingface_hub's
``_commit_api``: every file "regular", so its content travels base64 in the commit's NDJSON). It keeps
what it received: the repositories created, and each commit's header and files."""

from __future__ import annotations

import base64
import hashlib
import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class HubServer:
    def __init__(self, token: str):
        self.token = token
        self.created: list[dict] = []
        self.validated: list[str] = []  # README.md texts sent to /api/validate-yaml
        self.commits: list[dict] = []  # {"repo", "revision", "header", "files": {path: bytes}}
        self.unknown: list[str] = []  # requests of any other endpoint
        self.refused = 0
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _reply(self, status: int, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                if self.path.split("?")[0] != "/api/agent-harnesses":  # huggingface_hub's agent detection: none here
                    hub.unknown.append(f"GET {self.path}")
                self._reply(404, {"error": "not found"})

            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                if self.headers.get("Authorization") != f"Bearer {hub.token}":
                    hub.refused += 1
                    self._reply(401, {"error": "Invalid credentials in Authorization header"})
                    return
                path = self.path.split("?")[0]
                if path == "/api/validate-yaml":  # the README's metadata block, checked before the upload
                    hub.validated.append(json.loads(body)["content"])
                    self._reply(200, {"errors": [], "warnings": []})
                    return
                if path == "/api/repos/create":
                    req = json.loads(body)
                    hub.created.append(req)
                    self._reply(200, {"url": f"{hub.url}/{req['organization']}/{req['name']}"})
                    return
                m = re.fullmatch(r"/api/models/([^/]+/[^/]+)/(preupload|commit)/(.+)", path)
                if m is None:
                    hub.unknown.append(f"POST {self.path}")
                    self._reply(404, {"error": "not found"})
                    return
                repo, what, revision = m.groups()
                if what == "preupload":
                    files = json.loads(body)["files"]
                    self._reply(200, {"files": [{"path": f["path"], "uploadMode": "regular", "shouldIgnore": False,
                                                 "oid": None} for f in files]})
                    return
                lines = [json.loads(ln) for ln in body.decode().splitlines() if ln.strip()]
                commit = {"repo": repo, "revision": revision, "header": lines[0]["value"], "files": {},
                          "other": [ln for ln in lines[1:] if ln["key"] != "file"]}
                for ln in lines[1:]:
                    if ln["key"] == "file":
                        commit["files"][ln["value"]["path"]] = base64.b64decode(ln["value"]["content"])
                hub.commits.append(commit)
                oid = hashlib.sha1(body).hexdigest()
                self._reply(200, {"commitUrl": f"{hub.url}/{repo}/commit/{oid}", "commitOid": oid,
                                  "pullRequestUrl": None})

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> HubServer:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join()
