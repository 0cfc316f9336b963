"""A loopback stand-in for the Hugging Face Hub and S3, serving LoRA adapters to Dynamo's LoRA downloader.

Only what ``dynamo._core.LoRADownloader`` (1.6.1) asks for, as observed: for ``hf://org/repo`` the Hub API
``GET /api/models/{repo}/revision/{rev}`` (``sha`` and ``siblings``), then each file from
``/{repo}/resolve/{sha}/{file}`` with ranged GETs (``bytes=0-0`` first: ``content-range`` gives the size,
``x-repo-commit`` and ``etag`` the identity); for ``s3://bucket/prefix`` a ``ListObjectsV2``
(``GET /{bucket}?list-type=2&prefix={prefix}/``) then a ``GET`` per object (path-style addressing).

Point a process at it with :meth:`FakeAdapterHub.env`; every request is recorded (method, path) so two
processes can be compared. Binds 127.0.0.1 only.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlsplit
from xml.sax.saxutils import escape

SHA = "0123456789abcdef0123456789abcdef01234567"
ADAPTER_FILES = {"adapter_config.json": b'{"peft_type": "LORA", "r": 4}', "adapter_model.safetensors": b"weights"}


class FakeAdapterHub:
    """Serves ``hf_repos`` (repo id → files) and ``s3_objects`` ("bucket/key" → bytes)."""

    def __init__(self, hf_repos: Mapping[str, Mapping[str, bytes]], s3_objects: Mapping[str, bytes]) -> None:
        self.hf_repos = hf_repos
        self.s3_objects = s3_objects
        self.requests: list[tuple[str, str]] = []
        self._lock = threading.Lock()
        self.port = 0

    def env(self, root: Path) -> dict[str, str]:
        """The worker environment that sends Dynamo's downloader here, with its caches under ``root``."""
        url = f"http://127.0.0.1:{self.port}"
        return {
            "HF_ENDPOINT": url,
            "HF_HOME": str(root / "hf"),
            "HF_HUB_OFFLINE": "0",
            "DYN_LORA_PATH": str(root / "loras"),
            "AWS_ENDPOINT_URL": url,
            "AWS_ALLOW_HTTP": "true",
            "AWS_ACCESS_KEY_ID": "fake",
            "AWS_SECRET_ACCESS_KEY": "fake",
            "AWS_REGION": "us-east-1",
            "AWS_EC2_METADATA_DISABLED": "true",  # never ask the instance metadata service (not loopback)
            "NO_PROXY": "127.0.0.1",
        }

    def requests_since(self, start: int) -> list[tuple[str, str]]:
        with self._lock:
            return list(self.requests[start:])

    def count(self) -> int:
        with self._lock:
            return len(self.requests)

    def _record(self, method: str, path: str) -> None:
        with self._lock:
            self.requests.append((method, path))

    @contextmanager
    def serving(self) -> Iterator[FakeAdapterHub]:
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                hub._record("GET", self.path)
                url = urlsplit(self.path)
                parts = url.path.strip("/").split("/")
                if parts[:2] == ["api", "models"]:
                    return self._hf_info("/".join(parts[2:4]))
                if len(parts) >= 5 and parts[2] == "resolve":
                    return self._hf_file("/".join(parts[:2]), "/".join(parts[4:]))
                if len(parts) == 1:
                    return self._s3_list(parts[0], parse_qs(url.query).get("prefix", [""])[0])
                return self._s3_get("/".join(parts))

            def _hf_info(self, repo: str) -> None:
                files = hub.hf_repos.get(repo)
                if files is None:
                    return self._send(404, b'{"error":"Repository not found"}', "application/json")
                info = {"id": repo, "sha": SHA, "siblings": [{"rfilename": name} for name in files]}
                self._send(200, json.dumps(info).encode(), "application/json")

            def _hf_file(self, repo: str, name: str) -> None:
                data = hub.hf_repos.get(repo, {}).get(name)
                if data is None:
                    return self._send(404)
                headers = {"x-repo-commit": SHA, "etag": f'"{hashlib.sha1(data).hexdigest()}"'}
                wanted = self.headers.get("range", "")
                if wanted.startswith("bytes="):
                    first, _, last = wanted[len("bytes=") :].partition("-")
                    start, end = int(first), min(int(last) if last else len(data) - 1, len(data) - 1)
                    headers["content-range"] = f"bytes {start}-{end}/{len(data)}"
                    return self._send(206, data[start : end + 1], "application/octet-stream", headers)
                self._send(200, data, "application/octet-stream", headers)

            def _s3_list(self, bucket: str, prefix: str) -> None:
                keys = sorted(k.split("/", 1)[1] for k in hub.s3_objects if k.startswith(f"{bucket}/{prefix}"))
                contents = "".join(
                    f"<Contents><Key>{escape(key)}</Key><LastModified>2026-01-01T00:00:00.000Z</LastModified>"
                    f'<ETag>"x"</ETag><Size>{len(hub.s3_objects[f"{bucket}/{key}"])}</Size>'
                    "<StorageClass>STANDARD</StorageClass></Contents>"
                    for key in keys
                )
                xml = (
                    '<?xml version="1.0" encoding="UTF-8"?>'
                    '<ListBucketResult xmlns="http://s3.amazonaws.com/doc/2006-03-01/">'
                    f"<Name>{escape(bucket)}</Name><Prefix>{escape(prefix)}</Prefix><KeyCount>{len(keys)}</KeyCount>"
                    f"<MaxKeys>1000</MaxKeys><IsTruncated>false</IsTruncated>{contents}</ListBucketResult>"
                )
                self._send(200, xml.encode(), "application/xml")

            def _s3_get(self, key: str) -> None:
                data = hub.s3_objects.get(key)
                if data is None:
                    return self._send(404)
                headers = {"etag": '"x"', "last-modified": "Thu, 01 Jan 2026 00:00:00 GMT"}
                self._send(200, data, "application/octet-stream", headers)

            def _send(
                self, status: int, body: bytes = b"", kind: str = "text/plain", headers: Mapping[str, str] = {}
            ) -> None:
                self.send_response(status)
                self.send_header("content-type", kind)
                self.send_header("content-length", str(len(body)))
                for key, value in headers.items():
                    self.send_header(key, value)
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: object) -> None:
                return None

        server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = server.server_address[1]
        thread = threading.Thread(target=server.serve_forever, name="fake-adapter-hub", daemon=True)
        thread.start()
        try:
            yield self
        finally:
            server.shutdown()
            server.server_close()
            thread.join(timeout=10)
