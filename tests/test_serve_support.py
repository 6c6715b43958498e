"""Helpers for the serving tests: a word-level tokenizer, checkpoints, and `mtp serve` as a subprocess.

Not a test module (it holds no tests); named test_serve_* only because that is where serving test
code lives. The server is started exactly as a user starts it (`python -m mtp.cli serve ...`) on a
free loopback port, and the helpers talk to it over real sockets.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from conftest import VOCAB
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import Whitespace
from transformers import PreTrainedTokenizerFast

CHAT_TEMPLATE = (
    "{% for m in messages %}{{ 'w3 ' if m['role'] == 'user' else 'w4 ' }}{{ m['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}w5{% endif %}"
)


def word_tokenizer() -> PreTrainedTokenizerFast:
    """Token i is the word `w{i}`; text is words joined by spaces, so expected text is easy to build.

    The only special token is the unknown word `w0`. (A special `w2` would be matched inside `w28`:
    added tokens are split out of the text before the word model sees it.)
    """
    tok = Tokenizer(WordLevel({f"w{i}": i for i in range(VOCAB)}, unk_token="w0"))
    tok.pre_tokenizer = Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w0")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def words(ids: Any) -> str:
    return " ".join(f"w{int(t)}" for t in ids)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`mtp serve` in a subprocess; its output is collected in the background (and shown on failure)."""

    def __init__(self, checkpoint: Path, *args: str, startup_timeout: float = 120.0):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "mtp.cli", "serve", "--model", str(checkpoint), "--port", str(self.port), *args]
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        self.lines: list[str] = []
        self._ready = threading.Event()
        threading.Thread(target=self._drain, daemon=True).start()
        if not self._ready.wait(startup_timeout) or self.proc.poll() is not None:
            self.stop()
            raise RuntimeError("mtp serve did not start:\n" + self.log)

    def _drain(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)
            if "Uvicorn running on" in line:
                self._ready.set()
        self._ready.set()  # exited: wake the waiter

    @property
    def log(self) -> str:
        return "".join(self.lines)

    def terminate(self) -> None:
        self.proc.send_signal(signal.SIGTERM)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)

    # ---- raw HTTP ----------------------------------------------------------------------------------

    def request(
        self, method: str, path: str, body: Any = None, headers: dict[str, str] | None = None, timeout: float = 60
    ) -> tuple[int, dict[str, str], bytes]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            data = body if isinstance(body, bytes | None) else json.dumps(body).encode()
            hdrs = {"Content-Type": "application/json", **(headers or {})}
            conn.request(method, path, body=data, headers=hdrs)
            resp = conn.getresponse()
            return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
        finally:
            conn.close()

    def post(self, path: str, body: Any, **kw: Any) -> tuple[int, Any]:
        status, _, raw = self.request("POST", path, body, **kw)
        return status, json.loads(raw)

    def metrics(self, headers: dict[str, str] | None = None) -> dict[str, float]:
        """Samples of /metrics as {'name{labels without model_name}': value}."""
        status, _, raw = self.request("GET", "/metrics", headers=headers)
        assert status == 200, raw
        return parse_metrics(raw.decode())

    def wait_until(self, condition: Any, timeout: float = 30.0, what: str = "condition") -> None:
        """Poll the server's state (not a sleep-for-luck: it returns as soon as `condition()` holds)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if condition():
                return
            time.sleep(0.05)
        raise AssertionError(f"timed out waiting for {what}\n--- server log ---\n{self.log[-4000:]}")


_MODEL_LABEL = re.compile(r'model_name="(?:[^"\\]|\\.)*",?')


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text → {'name{other labels}': value}, with the constant model_name label dropped."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[_MODEL_LABEL.sub("", name).replace("{}", "")] = float(value)
    return out


class RawStream:
    """A streaming request on a bare socket, so a test can read a few events and then hang up."""

    def __init__(self, port: int, path: str, body: dict[str, Any], headers: dict[str, str] | None = None):
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=60)
        data = json.dumps(body).encode()
        extra = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
        head = (
            f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\n{extra}Connection: close\r\n\r\n"
        )
        self.sock.sendall(head.encode() + data)
        self.file = self.sock.makefile("rb")
        self.status_line = self.file.readline().decode()
        while self.file.readline() not in (b"\r\n", b""):
            pass  # headers

    @property
    def status(self) -> int:
        return int(self.status_line.split()[1])

    def events(self) -> Iterator[str]:
        """`data:` payloads; the chunked transfer framing lines are skipped."""
        for raw in self.file:
            line = raw.decode().strip()
            if line.startswith("data: "):
                yield line[6:]

    def close(self) -> None:
        self.file.close()
        self.sock.close()


def sse_payloads(raw: bytes) -> list[str]:
    return [line[6:] for line in raw.decode().splitlines() if line.startswith("data: ")]
