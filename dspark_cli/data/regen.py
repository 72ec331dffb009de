"""`dspark data regen`: regenerate every assistant turn through OpenAI-compatible endpoints.

    from dspark_cli.config import load_config
    cfg = load_config("pipelines/qwen3-4b.toml", ["regen.endpoints=['http://gpu1:8000/v1']"])
    regen(cfg, "runs/x/prompts", "runs/x/responses")

Each endpoint gets `concurrency` workers sharing `AsyncOpenAI` clients (16 workers per client;
the SDK's own retries off: `faults.RetryPolicy` decides). A worker takes one conversation and
regenerates it turn by turn, each request carrying the regenerated history. Results are committed
in batches by `store.ResponseStore` from a thread, so the event loop never waits on storage.
Resume is keyed by prompt id: ids already in the output (answered, rejected or failed) are skipped;
`retry_errors` also re-runs the failed ones.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections import Counter
from dataclasses import dataclass
from typing import Any

import openai

from .. import manifest, storage
from ..config import PipelineConfig
from ..console import console
from ..errors import DsparkError, StageFailed
from ..redact import clean, register_secret, shorten
from ..settings.regen import RegenSettings
from ..stage import StageResult, already_done, completed
from . import io
from .faults import FailFast, Failure, MalformedResponse, RequestFailed, RetryPolicy, classify
from .progress import RegenCounters, RegenProgress
from .store import ResponseStore, StoreState

STAGE = "data.regen"
#: Settings that change what is generated; a resumed run must match them (the rest is operational).
IDENTITY_KEYS = ("model", "temperature", "top_p", "top_k", "min_p", "max_tokens", "thinking",
                 "keep_truncated", "keep_empty")
PROBE_TIMEOUT = 15.0


@dataclass
class Turn:
    """One assistant answer as the server returned it."""

    content: str
    reasoning: str | None
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int


def sampling_params(s: RegenSettings) -> dict[str, Any]:
    """The sampling parameters recorded with each row (and sent with each request)."""
    return {"temperature": s.temperature, "top_p": s.top_p, "top_k": s.top_k, "min_p": s.min_p,
            "max_tokens": s.max_tokens, "enable_thinking": s.thinking}


def request_body(s: RegenSettings) -> dict[str, Any]:
    """The chat-completions body besides `messages`: top_k, min_p and the thinking switch sit at
    top level, as vLLM and SGLang read them (what the SDK's `extra_body` would merge in)."""
    body: dict[str, Any] = {"model": s.model, "temperature": s.temperature, "top_p": s.top_p,
                            "max_tokens": s.max_tokens,
                            "chat_template_kwargs": {"enable_thinking": s.thinking}}
    if s.top_k is not None:
        body["top_k"] = s.top_k
    if s.min_p is not None:
        body["min_p"] = s.min_p
    return body


async def chat_completion(client: openai.AsyncOpenAI, body: dict[str, Any]) -> Any:
    """POST /chat/completions through the SDK's own request path (auth, errors, timeouts), returning
    the decoded JSON. `client.chat.completions.create` sends the same request, but its typed
    parameter transform and response models cost ~0.6 ms CPU per call (measured: 2.1 vs 1.4 ms),
    which caps one process near 200 req/s; regen needs the SDK's transport, not its types."""
    return await client.post("/chat/completions", cast_to=object, body=body)


def parse_completion(data: Any) -> Turn:
    """Decoded chat completion → Turn; MalformedResponse when it is not one (e.g. a proxy's page)."""
    try:
        choice = data["choices"][0]
        message = choice["message"]
        content = message.get("content") or ""
        reasoning = message.get("reasoning_content") or message.get("reasoning")
        finish = choice.get("finish_reason") or "unknown"
        usage = data.get("usage") or {}
        prompt_tokens = int(usage.get("prompt_tokens") or 0)
        completion_tokens = int(usage.get("completion_tokens") or 0)
    except (AttributeError, IndexError, KeyError, TypeError, ValueError) as e:
        raise MalformedResponse(f"not a chat completion: {str(data)[:200]!r}") from e
    if not isinstance(content, str) or (reasoning is not None and not isinstance(reasoning, str)):
        raise MalformedResponse("message content is not text")
    return Turn(content, reasoning, str(finish), prompt_tokens, completion_tokens)


def api_key(s: RegenSettings) -> str:
    """The key from the environment (never from a file); local servers accept any key."""
    key = os.environ.get(s.api_key_env)
    if key:
        register_secret(key)  # a server that echoes it must not get it into a stored message
        return key
    if s.api_key_env != "OPENAI_API_KEY":
        raise DsparkError(f"regen.api_key_env: environment variable {s.api_key_env} is not set.",
                          hint=f"export {s.api_key_env}=… (the key is never written to any file).")
    return "EMPTY"


def model_ids(page: Any) -> list[str] | None:
    """The model ids of a decoded GET /models answer; None when it is not `{"data": [{"id": …}]}`
    (a web page, a proxy's text, another API)."""
    data = page.get("data") if isinstance(page, dict) else None
    if not isinstance(data, list) or not all(isinstance(m, dict) and "id" in m for m in data):
        return None
    return [str(m["id"]) for m in data]


async def probe(clients: dict[str, openai.AsyncOpenAI], model: str) -> list[str]:
    """Endpoints that answer GET /models and serve `model`; one-line DsparkError when none does."""

    async def one(endpoint: str) -> tuple[str, list[str] | None, str]:
        try:
            page = await clients[endpoint].with_options(timeout=PROBE_TIMEOUT).get("/models", cast_to=object)
        except Exception as e:  # noqa: BLE001 - every failure means "this endpoint is not usable"
            failure = classify(e)
            status = f"HTTP {failure.status_code}: " if failure.status_code else ""
            return endpoint, None, f"{status}{failure.message}"
        served = model_ids(page)
        if served is None:
            shown = clean(str(page), 120)
            return endpoint, None, f"its /models answer is not an OpenAI model list: {shown!r}"
        return endpoint, served, ""

    results = await asyncio.gather(*(one(ep) for ep in clients))
    answering = [(ep, served) for ep, served, _ in results if served is not None]
    if not answering:
        detail = "; ".join(f"{ep} ({why})" for ep, _, why in results)
        raise DsparkError(f"no endpoint answered GET /models: {shorten(detail, 600)}",
                          hint="start a server (e.g. `vllm serve MODEL`), or fix --endpoint "
                               "(regen.endpoints in a config; …/v1).")
    for ep, _, why in results:
        if why:
            console.print(f"[yellow]warning:[/] {ep} did not answer ({why[:200]}); not using it.")
    usable = [ep for ep, served in answering if model in served]
    if not usable:
        ep, served = answering[0]
        names = ", ".join(served[:10]) or "-"
        raise DsparkError(f"model '{model}' is not served by {ep}; it serves: {names}.",
                          hint="pass one of those names as --model (regen.model in a config).")
    for ep, _served in answering:
        if ep not in usable:
            console.print(f"[yellow]warning:[/] {ep} does not serve '{model}'; not using it.")
    return usable


class _Job:
    """One regen run's async machinery: producer → workers (per endpoint) → batch writer."""

    def __init__(self, settings: RegenSettings, input_url: str, store: ResponseStore, pending: set[str],
                 next_index: int, counters: RegenCounters, progress: RegenProgress) -> None:
        self.s = settings
        self.input_url = input_url
        self.store = store
        self.pending = pending
        self.next_index = next_index
        self.counters = counters
        self.progress = progress
        self.policy = RetryPolicy(settings.max_retries, settings.retry_base_delay, settings.retry_max_delay)
        self.fail_fast = FailFast(settings.fail_fast_after)
        self.body = request_body(settings)
        self.sampling = json.dumps(sampling_params(settings), sort_keys=True)
        self.ok: list[dict[str, Any]] = []
        self.rejected: list[dict[str, Any]] = []
        self.errors: list[dict[str, Any]] = []

    async def run(self, endpoints: list[str], clients: dict[str, list[openai.AsyncOpenAI]]) -> None:
        workers = len(endpoints) * self.s.concurrency
        rows: asyncio.Queue = asyncio.Queue(maxsize=2 * workers)
        self._wake = asyncio.Event()
        self._finished = False
        async with asyncio.TaskGroup() as group:
            group.create_task(self._produce(rows, workers))
            writer = group.create_task(self._write_loop())
            tasks = [group.create_task(self._work(rows, clients[ep][w % len(clients[ep])], ep))
                     for ep in endpoints for w in range(self.s.concurrency)]
            await asyncio.gather(*tasks)
            self._finished = True
            self._wake.set()
            await writer

    async def _produce(self, rows: asyncio.Queue, workers: int) -> None:
        """Stream the pending prompt rows shard by shard (reads in a thread), then one stop per worker."""
        seen: set[str] = set()

        def pending_rows(shard: str) -> list[dict[str, Any]]:  # off the loop: decoding is CPU work
            return [row for row in io.read_table(shard).to_pylist() if row["id"] in self.pending]

        for shard in io.list_shards(storage.join(self.input_url, io.DATA_DIR)):
            for row in await asyncio.to_thread(pending_rows, shard):
                if row["id"] not in seen:
                    seen.add(row["id"])
                    await rows.put(row)
        for _ in range(workers):
            await rows.put(None)

    async def _work(self, rows: asyncio.Queue, client: openai.AsyncOpenAI, endpoint: str) -> None:
        while (row := await rows.get()) is not None:
            await self._conversation(row, client, endpoint)
            self.counters.done += 1
            if self._buffered() >= self.s.batch_rows:
                self._wake.set()
            self.progress.update()

    async def _complete(self, client: openai.AsyncOpenAI, messages: list[dict[str, str]]) -> Turn:
        """One chat completion under the retry policy; RequestFailed when it fails for good."""
        attempt = 0
        while True:
            self.counters.requests += 1
            try:
                turn = parse_completion(await chat_completion(client, {**self.body, "messages": messages}))
                self.fail_fast.success()
                return turn
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - classify decides: retry or record
                failure: Failure = classify(e)
            if self.fail_fast.failed(failure):
                raise StoppedEarly(self.fail_fast.attempts, failure)
            if not self.policy.should_retry(attempt, failure):
                raise RequestFailed(failure, attempt + 1)
            await asyncio.sleep(self.policy.delay(attempt, failure))
            attempt += 1
            self.counters.retries += 1

    async def _conversation(self, row: dict[str, Any], client: openai.AsyncOpenAI, endpoint: str) -> None:
        """Regenerate each assistant turn (after each user turn), seeing the regenerated history."""
        history: list[dict[str, str]] = []
        reasoning: list[str | None] = []
        finishes: list[str] = []
        prompt_tokens = completion_tokens = 0
        reason = None
        turn = 0
        for message in row["messages"]:
            history.append({"role": message["role"], "content": message["content"]})
            if message["role"] != "user":
                continue
            try:
                answer = await self._complete(client, history)
            except RequestFailed as e:
                self.counters.errors += 1
                self.errors.append({"id": row["id"], "source": row["source"], "split": row["split"],
                                    "kind": e.failure.kind, "status_code": e.failure.status_code,
                                    "message": e.failure.message, "endpoint": endpoint, "turn": turn,
                                    "attempts": e.attempts})
                return
            history.append({"role": "assistant", "content": answer.content})
            reasoning.append(answer.reasoning)
            finishes.append(answer.finish_reason)
            prompt_tokens += answer.prompt_tokens
            completion_tokens += answer.completion_tokens
            self.counters.prompt_tokens += answer.prompt_tokens
            self.counters.completion_tokens += answer.completion_tokens
            turn += 1
            if answer.finish_reason == "length" and not self.s.keep_truncated:
                reason = "truncated"
            elif not answer.content.strip() and not self.s.keep_empty:
                reason = "empty"
            if reason:
                break  # later turns would build on an answer that is dropped anyway
        out = {"id": row["id"], "source": row["source"], "split": row["split"], "messages": history,
               "reasoning": reasoning, "thinking": self.s.thinking, "model": self.s.model,
               "endpoint": endpoint, "sampling": self.sampling, "finish_reasons": finishes,
               "prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens}
        if reason:
            self.counters.rejected += 1
            self.rejected.append({**out, "reason": reason})
        else:
            self.counters.ok += 1
            self.ok.append(out)

    async def _write_loop(self) -> None:
        """Commit full batches as they fill, everything every `flush_seconds`, and at the end."""
        while True:
            try:
                await asyncio.wait_for(self._wake.wait(), timeout=self.s.flush_seconds)
                timed_out = False
            except TimeoutError:
                timed_out = True
            self._wake.clear()
            finished = self._finished
            await self._flush(partial=finished or timed_out)
            if finished:
                return

    def _buffered(self) -> int:
        return len(self.ok) + len(self.rejected) + len(self.errors)

    async def _flush(self, partial: bool) -> None:
        """Write batches of `batch_rows` (and the remainder when `partial`), each in a thread."""
        while self._buffered() >= self.s.batch_rows or (partial and self._buffered()):
            ok, rejected, errors = self._take(self.s.batch_rows)
            index = self.next_index
            self.next_index += 1
            await asyncio.to_thread(self.store.write_batch, index, ok, rejected, errors)

    def _take(self, limit: int) -> tuple[list, list, list]:
        """Up to `limit` results from the buffers (a batch never exceeds batch_rows)."""
        taken = []
        for buffer in (self.ok, self.rejected, self.errors):
            n = min(len(buffer), max(0, limit))
            taken.append(buffer[:n])
            del buffer[:n]
            limit -= n
        return taken[0], taken[1], taken[2]


def _prompt_ids(input_url: str) -> list[str]:
    return [row["id"] for row in io.read_rows(input_url, columns=["id"])]


def regen(cfg: PipelineConfig, input_url: str | None = None, output_url: str | None = None,
          force: bool = False, retry_errors: bool = False, show_progress: bool | None = None) -> StageResult:
    """Run the regen stage: prompts at input_url (default `<work_dir>/prompts`) → responses."""
    s = cfg.regen
    input_url = input_url or cfg.stage_url("prompts")
    output_url = output_url or cfg.stage_url("responses")
    finished = manifest.read_manifest(output_url) is not None and not retry_errors and not force
    if not s.endpoints and not finished:  # a finished stage needs no server to say so
        raise DsparkError("regen.endpoints is empty.",
                          hint="pass --endpoint http://HOST:PORT/v1 (repeatable).")
    if not s.model and not finished:
        raise DsparkError("regen.model is empty.", hint="pass --model with the name the server knows.")
    if manifest.read_manifest(input_url) is None:
        raise DsparkError(f"{input_url}: not a finished prompts artifact (no manifest.json).",
                          hint="run `dspark data prepare` first, or pass --input.")
    key = api_key(s)
    identity = {"regen": {k: getattr(s, k) for k in IDENTITY_KEYS}}
    run = manifest.prepare_stage(STAGE, output_url, identity, {input_url: manifest.fingerprint(input_url)},
                                 force=force)
    if run.state == "done" and not retry_errors:
        return already_done(run)
    store = ResponseStore(output_url)
    ids = _prompt_ids(input_url)
    state = StoreState() if run.replaces else store.scan()
    # --retry-errors adds the recorded failures to whatever is not settled yet (nothing, once the
    # stage has finished), so the manifest is never written over unattempted prompts.
    pending = set(ids) - state.settled
    if retry_errors:
        pending |= state.errors
    # The probe runs before the output is claimed: a wrong --model or endpoint leaves nothing behind.
    endpoints = asyncio.run(_probe(s, key)) if pending else []
    run.claim()
    if retry_errors and run.state == "done":
        storage.remove(run.manifest_url)  # the stage is open again until the retried errors settle
    counters = RegenCounters()
    if pending:
        retried = f", {len(state.errors)} of them recorded errors to retry" if retry_errors else ""
        settled = len(state.settled - pending)
        console.print(f"regen: {len(pending)} of {len(set(ids))} prompts to do ({settled} already "
                      f"settled{retried}) over {len(endpoints)} endpoint(s).")
        progress = RegenProgress(len(pending), counters, enabled=show_progress)
        job = _Job(s, input_url, store, pending, state.next_index, counters, progress)
        with progress:
            try:
                asyncio.run(_run(job, s, key, endpoints))
            except BaseExceptionGroup as group:  # a worker or the writer failed: show that error
                error = _first_leaf(group)
                if isinstance(error, StoppedEarly) and run.state == "fresh":
                    run.abandon()  # nothing answered: the corrected rerun starts afresh, no --force
                raise error from None
    final = store.finish()  # the one read of the whole output
    unsettled = set(ids) - final.settled
    if unsettled:  # only a bug could get here: never mark the stage done over missing prompts
        raise DsparkError(f"{output_url}: {len(unsettled)} prompts have no result after the run "
                          f"(e.g. {sorted(unsettled)[0]!r}); rerun to complete them.")
    totals = dict(final.counts)
    totals["prompts"] = len(set(ids))
    _refuse_unusable(run, store, totals, s.max_error_share)
    totals["requests_this_run"] = counters.requests
    totals["retries_this_run"] = counters.retries
    req_s, tok_s = counters.rates()
    extra = {"endpoints": s.to_dict()["endpoints"], "model": s.model, "sampling": sampling_params(s),
             "api_key_env": s.api_key_env, "concurrency": s.concurrency, "batch_rows": s.batch_rows,
             "max_retries": s.max_retries, "row_schema": "response_row/v1"}
    committed = run.finish(totals, extra=extra, timings={"regen_seconds": round(counters.elapsed, 3),
                                                         "requests_per_second": round(req_s, 3),
                                                         "output_tokens_per_second": round(tok_s, 3)})
    return completed(run, committed, dict(totals))  # a reopened (--retry-errors) run counts as resumed


def _refuse_unusable(run: manifest.StageRun, store: ResponseStore, totals: dict[str, Any],
                     max_share: float) -> None:
    """Fail (no manifest) a run that answered nothing, or whose failed share is above `max_share`.

    With no answer at all the run is abandoned (the corrected rerun starts afresh, whatever it
    changes); otherwise the answers are kept and the failed prompts' records dropped from the batch
    files, so the rerun retries exactly them. `errors.parquet` keeps the failures to read.
    """
    errors, prompts = totals["errors"], totals["prompts"]
    if totals["responses"] and errors <= max_share * prompts:
        return
    failed = store.error_view()
    why = ""
    if failed:
        common, n = Counter(f"{r['kind']}" + (f" {r['status_code']}" if r["status_code"] else "")
                            + f": {r['message']}" for r in failed).most_common(1)[0]
        why = f"; most common ({n}×): {shorten(common, 200)}"
    if not totals["responses"]:
        rejected = totals["rejected"]
        detail = f"{errors} failed, {rejected} rejected (truncated {totals['rejected_truncated']}, " \
                 f"empty {totals['rejected_empty']})"
        run.abandon()
        raise StageFailed(f"data regen: no usable response from {prompts} prompts ({detail}{why}).",
                          hint=f"see {store.url}/errors.parquet; fix the cause and rerun (it starts afresh)."
                          if errors else "raise --max-tokens, or pass --keep-truncated / --keep-empty.")
    storage.remove(store.errors_url)
    raise StageFailed(f"data regen: {errors} of {prompts} prompts failed, more than "
                      f"--max-error-share {max_share:g}{why}.",
                      hint=f"fix the cause and rerun the same command: the {errors} failed prompts are "
                           f"retried, the {totals['responses']} answers kept.")


class StoppedEarly(StageFailed):
    """The first requests of a run all failed the same way (FailFast): stop, say it once."""

    def __init__(self, attempts: int, failure: Failure) -> None:
        status = f" {failure.status_code}" if failure.status_code else ""
        super().__init__(f"data regen: stopped early: the first {attempts} requests all failed the same way "
                         f"({failure.kind}{status}: {shorten(failure.message, 200)}); no answer was stored.",
                         hint="fix the endpoint, model or request settings, then rerun the same command.")


def _first_leaf(group: BaseExceptionGroup) -> BaseException:
    error: BaseException = group
    while isinstance(error, BaseExceptionGroup):
        error = error.exceptions[0]
    return error


#: Workers sharing one client. With the httpx transport, httpcore scans every pooled connection
#: on each request and response close, so one pool of 64 costs ~25 % of the client's CPU.
WORKERS_PER_CLIENT = {"aiohttp": 64, "httpx": 16}


def make_client(endpoint: str, key: str, timeout: float) -> tuple[openai.AsyncOpenAI, str]:
    """An SDK client on the aiohttp transport (the SDK's documented choice for high concurrency:
    measured 0.9-1.1 vs 1.5-1.8 ms CPU per request), or on httpx when aiohttp is missing."""
    try:
        http_client, transport = openai.DefaultAioHttpClient(timeout=timeout), "aiohttp"
    except RuntimeError:
        http_client, transport = None, "httpx"
    client = openai.AsyncOpenAI(base_url=endpoint, api_key=key, max_retries=0, timeout=timeout,
                                http_client=http_client)
    return client, transport


def check_endpoints(s: RegenSettings) -> list[str]:
    """The endpoints that serve `s.model` now (GET /models); DsparkError naming them when none does.
    `pipeline run` calls it before its first stage, as regen does before claiming its output."""
    return asyncio.run(_probe(s, api_key(s)))


async def _probe(s: RegenSettings, key: str) -> list[str]:
    """The usable endpoints (see `probe`), with short-lived clients of their own."""
    clients = {ep: make_client(ep, key, s.request_timeout)[0] for ep in dict.fromkeys(s.endpoints)}
    try:
        return await probe(clients, s.model)
    finally:
        for client in clients.values():
            await client.close()


async def _run(job: _Job, s: RegenSettings, key: str, endpoints: list[str]) -> None:
    clients: dict[str, list[openai.AsyncOpenAI]] = {}
    for ep in endpoints:
        first, transport = make_client(ep, key, s.request_timeout)
        n_clients = -(-s.concurrency // WORKERS_PER_CLIENT[transport])  # ceil
        clients[ep] = [first, *(make_client(ep, key, s.request_timeout)[0] for _ in range(n_clients - 1))]
    try:
        await job.run(endpoints, clients)
    finally:
        for pool in clients.values():
            for client in pool:
                await client.close()
