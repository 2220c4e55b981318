"""A ``tokenloom serve`` subprocess on 127.0.0.1 whose output goes to a file (readable while it runs), and raw-socket
helpers for what HTTP clients will not send (silent sockets, HTTP/1.0, a body cut short, huge headers)."""

from __future__ import annotations

import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[2]
SHAKES = REPO / "checkpoints" / "shakespeare-char"
DE_EN = REPO / "checkpoints" / "multi30k-de-en"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LiveServer:
    def __init__(self, checkpoint: Path, *extra: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.host = f"127.0.0.1:{self.port}"
        self._log = tempfile.NamedTemporaryFile("w+", prefix="tokenloom-serve-", suffix=".log")  # noqa: SIM115
        self.process = subprocess.Popen([sys.executable, "-m", "tokenloom.cli.main", "serve", str(checkpoint),
                                         "--port", str(self.port), *extra],
                                        stdout=self._log, stderr=subprocess.STDOUT, text=True)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"the server exited: {self.log()}")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(0.2)
        self.stop()
        raise RuntimeError("the server did not start within 120 s")

    def log(self) -> str:
        with open(self._log.name, encoding="utf-8", errors="replace") as f:
            return f.read()

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.process.kill()
        self._log.close()


def connect(server: LiveServer, timeout: float = 10) -> socket.socket:
    return socket.create_connection(("127.0.0.1", server.port), timeout=timeout)


def request_bytes(server: LiveServer, body: bytes, path: str = "/v1/completions", version: str = "1.1",
                  length: int | None = None, extra: str = "") -> bytes:
    return (f"POST {path} HTTP/{version}\r\nHost: {server.host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body) if length is None else length}\r\n{extra}\r\n").encode() + body


def read_all(s: socket.socket, timeout: float = 30) -> bytes:
    """Everything the server sends until it closes (or ``timeout`` passes: then what came, and b'<timeout>')."""
    s.settimeout(timeout)
    out = b""
    try:
        while True:
            chunk = s.recv(65536)
            if not chunk:
                return out
            out += chunk
    except TimeoutError:
        return out + b"<timeout>"
    except ConnectionResetError:
        return out + b"<reset>"


def closed_by_server(s: socket.socket, wait: float) -> bool:
    """Whether the server closes ``s`` within ``wait`` seconds (whatever it sends first)."""
    return not read_all(s, wait).endswith(b"<timeout>")
