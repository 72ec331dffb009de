"""`dspark serve`: an OpenAI-compatible server for a local Transformers model.

    dspark serve runs/models/smollm2-135m-instruct --port 8000
    curl localhost:8000/v1/chat/completions -d '{"model": "runs/models/smollm2-135m-instruct",
        "messages": [{"role": "user", "content": "Hi"}]}'

For laptops, demos and tests; production regen points at vLLM or SGLang.
"""

from __future__ import annotations

import socket
from typing import Annotated

import typer

from ..console import console


def serve(
    model: Annotated[str, typer.Argument(help="Model folder (e.g. from `dspark model convert`) or hub id.")],
    host: Annotated[str, typer.Option(help="Interface to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(min=0, max=65535, metavar="N", help="TCP port, 0: any free.")] = 8000,
    served_model_name: Annotated[list[str] | None, typer.Option(
        "--served-model-name", help="Name(s) clients send as `model` (default: MODEL as given and "
        "its folder name). Repeatable; the first is listed by /v1/models.")] = None,
    dtype: Annotated[str, typer.Option(help="auto (bfloat16 on GPU and on CPUs with native bf16, "
                                       "else float32), float32, bfloat16 or float16.")] = "auto",
    device: Annotated[str, typer.Option(help="auto, cpu, cuda or cuda:N.")] = "auto",
    max_model_len: Annotated[int | None, typer.Option(help="Cap the context length (prompt + "
                                                      "answer).")] = None,
    max_batch_size: Annotated[int, typer.Option(help="Most sequences in one batch.")] = 32,
    max_batch_tokens: Annotated[int, typer.Option(help="Most padded prompt tokens in one "
                                                  "batch's prefill.")] = 16384,
    batch_wait_ms: Annotated[float, typer.Option(help="How long a new batch waits for more "
                                                 "requests to join.")] = 5.0,
    default_max_tokens: Annotated[int, typer.Option(help="max_tokens when a request gives none.")]
    = 512,
    threads: Annotated[int | None, typer.Option(min=1, metavar="N",
                                                help="torch CPU threads (default: torch's).")] = None,
    trust_remote_code: Annotated[bool, typer.Option("--trust-remote-code",
                                                    help="Run code from the model repository.")] = False,
    prepack: Annotated[bool, typer.Option("--prepack/--no-prepack",
                                          help="Pack the linear weights once where steps gain (CPU "
                                          "float32, bf16 with native bf16; target/prepack.py).")] = True,
) -> None:
    """Serve MODEL on /v1/chat/completions (JSON and SSE), /v1/models and /health."""
    import os

    import torch
    import uvicorn

    from ..errors import DsparkError
    from ..serve.app import create_app
    from ..serve.batcher import Batcher
    from ..serve.engine import Engine
    from ..target.dtypes import DTYPE_NAMES

    if dtype not in ("auto", *DTYPE_NAMES):
        raise DsparkError(f"--dtype must be auto or one of {', '.join(DTYPE_NAMES)}, got {dtype!r}.")
    if max_batch_size <= 0 or max_batch_tokens <= 0:
        raise DsparkError("--max-batch-size and --max-batch-tokens must be > 0.")
    if not 0 <= batch_wait_ms < float("inf"):  # also refuses nan
        raise DsparkError(f"--batch-wait-ms must be a finite number >= 0, got {batch_wait_ms}.")
    if threads:
        torch.set_num_threads(threads)
    # Everything is checked before "serving" is announced: the port first (cheap), then the model.
    sock = _listening_socket(host, port)
    console.print(f"[cyan]▶[/] loading {model}")
    try:
        engine = Engine(model, dtype=dtype, device=device, max_model_len=max_model_len,
                        trust_remote_code=trust_remote_code, prepack=prepack)
    except BaseException:
        sock.close()
        raise
    names = list(served_model_name or [model])
    for alias in (model, os.path.basename(os.path.normpath(model))):
        if alias not in names:
            names.append(alias)
    batcher = Batcher(engine, max_batch_size=max_batch_size, max_batch_tokens=max_batch_tokens,
                      wait_ms=batch_wait_ms)
    app = create_app(engine, names, batcher, default_max_tokens=default_max_tokens)
    console.print(f"[green]✓[/] serving {names[0]} ({engine.dtype}, {engine.device}, context "
                  f"{engine.context_length}) on http://{host}:{port}/v1")
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    server.run(sockets=[sock])


def _listening_socket(host: str, port: int) -> socket.socket:
    """A listening socket with TCP_NODELAY, which accepted sockets inherit on Linux: without it
    uvicorn's separate header/body writes (and every small SSE chunk) wait for the client's
    delayed ACK, +40 ms per reply."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        from ..errors import DsparkError

        raise DsparkError(f"cannot listen on {host}:{port}: {e.strerror}.",
                          hint="pick another --port, or stop the server already using it.") from e
    sock.listen(2048)
    return sock


def register(app: typer.Typer) -> None:
    """Add the `serve` command to the app."""
    app.command("serve")(serve)
