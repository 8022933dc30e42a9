"""An in-process fake Kubernetes API server for the backend's tests (no cluster can run here).

A real HTTP server on loopback (a thread) that speaks the REST paths the official `kubernetes` client uses:
create (POST to a collection), get, list (with `labelSelector=k=v,...`), merge-patch and delete, for any
resource path. Admission is the offline validator: an object `validate_manifest` refuses is answered 422
(Unprocessable Entity), as the API server would. Conflicts are 409, missing objects 404.

A test plays the controllers (JobSet, Kueue, kubelet) through `put`/`patch_status` on the server object.

Why not kmock: its pytest plugin (auto-loaded on install) imports pytest-asyncio, which this suite does not
use; installing both would change every test session's plugins for one module.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlparse

from trainforge.infra.k8s.validate import ManifestInvalid, validate_manifest


class FakeKubeAPI:
    def __init__(self, validate: bool = True):
        self.objects: dict[str, dict[str, Any]] = {}  # "<collection path>/<name>" -> object
        self.requests: list[tuple[str, str]] = []
        self.validate = validate
        self.lock = threading.Lock()
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, name="fake-kube-api", daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def __enter__(self) -> FakeKubeAPI:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=5)

    # -- what the tests (as controllers) do ------------------------------------------------------------------
    def put(self, collection: str, obj: dict[str, Any]) -> None:
        with self.lock:
            self.objects[f"{collection}/{obj['metadata']['name']}"] = obj

    def patch(self, path: str, patch: dict[str, Any]) -> None:
        with self.lock:
            _merge(self.objects[path], patch)

    def kinds(self) -> list[str]:
        return [o["kind"] for o in self.objects.values()]

    # -- HTTP ----------------------------------------------------------------------------------------------
    def _handler(self) -> type[BaseHTTPRequestHandler]:
        api = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def _send(self, code: int, body: dict[str, Any]) -> None:
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _error(self, code: int, reason: str, message: str) -> None:
                self._send(code, {"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": reason,
                                  "message": message, "code": code})

            def _body(self) -> dict[str, Any]:
                n = int(self.headers.get("Content-Length") or 0)
                return json.loads(self.rfile.read(n) or b"{}")

            def do_POST(self) -> None:
                path = urlparse(self.path).path.rstrip("/")
                obj = self._body()
                api.requests.append(("POST", path))
                if api.validate:
                    try:
                        validate_manifest(obj)
                    except ManifestInvalid as exc:
                        return self._error(422, "Invalid", str(exc))
                key = f"{path}/{obj['metadata']['name']}"
                with api.lock:
                    if key in api.objects:
                        return self._error(409, "AlreadyExists", f"{key} already exists")
                    obj.setdefault("metadata", {})["uid"] = f"uid-{len(api.objects)}"
                    api.objects[key] = obj
                self._send(201, obj)

            def do_GET(self) -> None:
                url = urlparse(self.path)
                path = url.path.rstrip("/")
                api.requests.append(("GET", path))
                with api.lock:
                    if path in api.objects:
                        return self._send(200, api.objects[path])
                    items = [o for k, o in api.objects.items() if k.rsplit("/", 1)[0] == path]
                selector = parse_qs(url.query).get("labelSelector", [""])[0]
                wanted = dict(p.split("=", 1) for p in selector.split(",") if "=" in p)
                items = [o for o in items
                         if all((o["metadata"].get("labels") or {}).get(k) == v for k, v in wanted.items())]
                if not items and not path.split("/")[-1].endswith("s"):
                    return self._error(404, "NotFound", f"{path} not found")
                self._send(200, {"kind": "List", "apiVersion": "v1", "metadata": {"resourceVersion": "1"},
                                 "items": items})

            def do_PATCH(self) -> None:
                path = urlparse(self.path).path.rstrip("/")
                api.requests.append(("PATCH", path))
                with api.lock:
                    if path not in api.objects:
                        return self._error(404, "NotFound", f"{path} not found")
                    _merge(api.objects[path], self._body())
                    self._send(200, api.objects[path])

            def do_DELETE(self) -> None:
                path = urlparse(self.path).path.rstrip("/")
                api.requests.append(("DELETE", path))
                with api.lock:
                    obj = api.objects.pop(path, None)
                    if obj is None:
                        return self._error(404, "NotFound", f"{path} not found")
                    if obj.get("kind") == "JobSet":  # the garbage collector removes the gang's pods with it
                        name = obj["metadata"]["name"]
                        for key in [k for k, o in api.objects.items() if o.get("kind") == "Pod" and
                                    (o["metadata"].get("labels") or {}).get("jobset.sigs.k8s.io/jobset-name") == name]:
                            del api.objects[key]
                self._send(200, {"kind": "Status", "apiVersion": "v1", "status": "Success"})

        return Handler


def _merge(dst: dict[str, Any], patch: dict[str, Any]) -> None:
    for k, v in patch.items():
        if isinstance(v, dict) and isinstance(dst.get(k), dict):
            _merge(dst[k], v)
        elif v is None:
            dst.pop(k, None)
        else:
            dst[k] = v
