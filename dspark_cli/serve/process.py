"""Start `dspark serve` as a child process and wait until it answers (pipeline run, tests, demo).

    with served("runs/models/smollm2-135m-instruct") as server:
        regen(..., endpoints=[server.base_url], model=server.model)
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import DsparkError


@dataclass
class ServerHandle:
    """A running server: `base_url` ends in /v1 (what OpenAI clients and regen take)."""

    process: subprocess.Popen
    host: str
    port: int
    model: str
    log_path: Path | None

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}/v1"

    @property
    def root_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def stop(self, timeout: float = 20.0) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=timeout)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def start_server(model: str, port: int | None = None, host: str = "127.0.0.1",
                 served_model_name: str | None = None, args: list[str] | None = None,
                 log_path: str | Path | None = None, startup_timeout: float = 600.0) -> ServerHandle:
    """Launch `dspark serve MODEL` and return once /health answers (raise with its log if it dies)."""
    port = port or free_port(host)
    name = served_model_name or model
    cmd = [sys.executable, "-m", "dspark_cli.cli", "serve", model, "--host", host, "--port", str(port),
           "--served-model-name", name, *(args or [])]
    log = open(log_path, "ab") if log_path else subprocess.DEVNULL  # noqa: SIM115 (owned by the child)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                               preexec_fn=_die_with_parent if sys.platform == "linux" else None)
    handle = ServerHandle(process, host, port, name, Path(log_path) if log_path else None)
    deadline = time.monotonic() + startup_timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise DsparkError(f"dspark serve {model} exited with code {process.returncode} while "
                              f"starting.{_tail(handle.log_path)}",
                              hint="run the same `dspark serve` command by hand to see why.")
        try:
            with urllib.request.urlopen(f"{handle.root_url}/health", timeout=2) as r:
                if r.status == 200:
                    return handle
        except OSError:
            time.sleep(0.2)
    handle.stop()
    raise DsparkError(f"dspark serve {model} did not answer on {handle.root_url} within "
                      f"{startup_timeout:.0f}s.{_tail(handle.log_path)}")


@contextmanager
def served(model: str, **kwargs) -> Iterator[ServerHandle]:
    """Context manager around start_server: the server is stopped on exit, errors included."""
    handle = start_server(model, **kwargs)
    try:
        yield handle
    finally:
        handle.stop()


@contextmanager
def regen_endpoints(cfg: Any, log_path: str | Path | None = None) -> Iterator[tuple[list[str], str]]:
    """(endpoints, model name) for `data regen`: the config's own, or — with
    `[regen] serve_target = true` — a `dspark serve` of `[target].model` started for the block."""
    if not cfg.regen.serve_target:
        yield list(cfg.regen.endpoints), cfg.regen.model
        return
    if not cfg.target.model:
        raise DsparkError("regen.serve_target is true but target.model is empty.",
                          hint="set [target] model = a model folder, e.g. from `dspark model convert`.")
    args = ["--max-batch-size", str(min(cfg.regen.concurrency, 64)), "--dtype", cfg.target.dtype]
    if cfg.target.trust_remote_code:
        args.append("--trust-remote-code")
    if not cfg.target.prepack:
        args.append("--no-prepack")
    if cfg.target.device != "auto":
        args += ["--device", cfg.target.device]
    with served(cfg.target.model, served_model_name=cfg.regen.model or cfg.target.model,
                args=args, log_path=log_path) as server:
        yield [server.base_url], server.model


def _die_with_parent() -> None:
    """In the child, before exec: SIGTERM when the parent dies, even by kill -9 (a pipeline run
    killed mid-regen must not leave a server holding the model and the port)."""
    import ctypes
    import signal

    PR_SET_PDEATHSIG = 1
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def _tail(log_path: Path | None, lines: int = 5) -> str:
    if not log_path or not log_path.is_file():
        return ""
    tail = log_path.read_text(errors="replace").strip().splitlines()[-lines:]
    return " Last log lines: " + " | ".join(tail)
