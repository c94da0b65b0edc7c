"""Ctrl-C on `make serve` (`python -m cbserve.cluster.run ray_config.yaml`) with streams in flight:
the whole server ends within 10 s, every client's stream ends explicitly (the server's error
event, then `data: [DONE]`), and nothing prints a traceback.

The default model (SmolLM2, ~30 ms a token here) so that 480-token streams are surely still
running when the signal comes; the app is `ray_config.yaml`'s, on free ports.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.support.cluster import free_port

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.default_model]

ROOT = Path(__file__).resolve().parents[2]
STREAMS = 4
STOP_LIMIT_S = 10.0


def _config(tmp_path: Path) -> tuple[Path, int]:
    config = yaml.safe_load((ROOT / "ray_config.yaml").read_text())
    port = free_port()
    config["http_options"]["port"] = port
    config["grpc_options"]["port"] = free_port()
    path = tmp_path / "serve.yaml"
    path.write_text(yaml.safe_dump(config))
    return path, port


def _wait_ready(proc: subprocess.Popen, port: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, "the server exited before it served"
        with contextlib.suppress(OSError):
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            conn.request("GET", "/v1/models")
            if conn.getresponse().status == 200:
                return
        time.sleep(1.0)
    raise AssertionError(f"the server did not answer within {timeout:g} s")


class _Stream(threading.Thread):
    """One streaming completion read to its end; `started` is set at its first event."""

    def __init__(self, port: int, index: int):
        super().__init__(daemon=True)
        self.port, self.index = port, index
        self.started = threading.Event()
        self.body, self.error = b"", None

    def run(self) -> None:
        body = {"model": "SmolLM2-135M-Instruct", "prompt": f"Count from one to a thousand, step {self.index}:",
                "max_tokens": 480, "temperature": 0, "stream": True}
        try:
            conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
            conn.request("POST", "/v1/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
            resp = conn.getresponse()
            assert resp.status == 200
            while chunk := resp.read1(65536):
                self.body += chunk
                if b"data: " in self.body:
                    self.started.set()
        except Exception as exc:  # noqa: BLE001 - recorded: a cut connection is what this test looks for
            self.error = exc
        finally:
            self.started.set()


def _events(body: bytes) -> list[Any]:
    out = []
    for line in body.decode().splitlines():
        if line.startswith("data: "):
            data = line[len("data: "):]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def test_ctrl_c_ends_every_stream_explicitly_within_10_s(tmp_path: Path) -> None:
    config, port = _config(tmp_path)
    out, err = tmp_path / "stdout.log", tmp_path / "stderr.log"
    with open(out, "wb") as fout, open(err, "wb") as ferr:
        proc = subprocess.Popen([sys.executable, "-m", "cbserve.cluster.run", str(config)], cwd=ROOT,
                                stdout=fout, stderr=ferr, start_new_session=True)  # a terminal's process group
        try:
            _wait_ready(proc, port, timeout=900)
            streams = [_Stream(port, i) for i in range(STREAMS)]
            for s in streams:
                s.start()
            for s in streams:
                assert s.started.wait(120)
            t0 = time.monotonic()
            os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C in a terminal does
            proc.wait(timeout=60)
            took = time.monotonic() - t0
            for s in streams:
                s.join(timeout=30)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    log = err.read_text(errors="replace") + out.read_text(errors="replace")
    print(f"\nCtrl-C to exit: {took:.1f} s (exit code {proc.returncode})")
    assert took <= STOP_LIMIT_S, log[-3000:]
    assert proc.returncode == 0
    for s in streams:
        assert s.error is None, (s.index, s.error, s.body[-300:])
        events = _events(s.body)
        assert events[-1] == "[DONE]", s.body[-300:]
        last = events[-2]
        assert "error" in last and "shutting down" in last["error"]["message"], last  # not a finish_reason
    assert "Traceback" not in log, log[-5000:]
