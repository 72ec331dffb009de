"""Shared fixtures: tiny real targets (built once per session) and test-wide settings."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# dtype "auto" and precision "auto" follow the CPU's bf16 support; pinned so that what the suite
# computes does not depend on which CPU the CI machine has (explicit bf16 tests stay bf16).
os.environ.setdefault("DSPARK_CPU_BF16", "0")

from fixtures.tiny_models import build_tiny_target  # noqa: E402


@pytest.fixture(scope="session", autouse=True)
def _torch_threads():
    import torch

    # Under pytest-xdist (`make test`: two workers) one thread each, so the workers share the cores
    # instead of oversubscribing them; alone, two.
    default = "1" if os.environ.get("PYTEST_XDIST_WORKER") else "2"
    torch.set_num_threads(int(os.environ.get("DSPARK_TEST_THREADS", default)))


@pytest.fixture(scope="session")
def tiny_qwen3_target(tmp_path_factory) -> Path:
    """36-layer random Qwen3 (hidden 32) with a Qwen3-style chat template, safetensors."""
    return build_tiny_target(tmp_path_factory.mktemp("tiny-qwen3"), style="qwen3", num_layers=36)


@pytest.fixture(scope="session")
def tiny_llama_target(tmp_path_factory) -> Path:
    """6-layer random Llama with a Llama-3-style chat template, safetensors."""
    return build_tiny_target(tmp_path_factory.mktemp("tiny-llama"), style="llama", num_layers=6)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def s3_server():
    """A real S3 API (moto server process on 127.0.0.1); yields its endpoint URL.

    Sets AWS_* and AWS_ENDPOINT_URL_S3 so `storage.url_to_fs('s3://…')` and subprocesses reach it.
    """
    import subprocess
    import time
    import urllib.request

    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    endpoint = f"http://127.0.0.1:{port}"
    for _ in range(100):
        try:
            urllib.request.urlopen(endpoint, timeout=0.5)
            break
        except Exception:
            time.sleep(0.1)
    saved = {k: os.environ.get(k) for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY",
                                            "AWS_DEFAULT_REGION", "AWS_ENDPOINT_URL_S3")}
    os.environ.update(AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing",
                      AWS_DEFAULT_REGION="us-east-1", AWS_ENDPOINT_URL_S3=endpoint)
    yield endpoint
    proc.terminate()
    proc.wait(timeout=10)
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.fixture
def s3_bucket(s3_server) -> str:
    """A fresh bucket on the moto server; returns 's3://name'."""
    import uuid

    import boto3

    name = f"dspark-{uuid.uuid4().hex[:12]}"
    boto3.client("s3", endpoint_url=s3_server, region_name="us-east-1").create_bucket(Bucket=name)
    return f"s3://{name}"


@pytest.fixture
def memory_url() -> str:
    """A unique memory:// root, cleared afterwards."""
    import uuid

    import fsspec

    root = f"memory://dspark-{uuid.uuid4().hex[:12]}"
    yield root
    fs = fsspec.filesystem("memory")
    if fs.exists(root.removeprefix("memory:/")):
        fs.rm(root.removeprefix("memory:/"), recursive=True)
