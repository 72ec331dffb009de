"""`dspark serve` on the tiny Qwen3 target: a real uvicorn process, the official openai client."""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request

import openai
import pytest
import torch

from dspark_cli.serve.process import served

USER = [{"role": "user", "content": "What is 12 plus 30? Please explain step by step."}]
NO_THINK = {"chat_template_kwargs": {"enable_thinking": False}}


@pytest.fixture(scope="module")
def server(tiny_qwen3_target, tmp_path_factory):
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    with served(str(tiny_qwen3_target), served_model_name="tiny", log_path=log,
                args=["--dtype", "float32", "--max-batch-size", "8", "--batch-wait-ms", "30",
                      "--threads", "1", "--default-max-tokens", "16"]) as handle:
        yield handle


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def reference(tiny_qwen3_target):
    """Greedy continuation by Transformers' own generate: what the server must reproduce."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_qwen3_target)
    model = AutoModelForCausalLM.from_pretrained(tiny_qwen3_target, dtype=torch.float32).eval()

    def greedy(messages, max_new_tokens, **template_kwargs):
        ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_dict=False,
                                      **template_kwargs)
        out = model.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False,
                             eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
        new = out[0, len(ids):].tolist()
        return ids, new, tok.decode(new, skip_special_tokens=True)

    return greedy


def _health(server) -> dict:
    with urllib.request.urlopen(f"{server.root_url}/health", timeout=10) as r:
        return json.loads(r.read())


class TestRoundTrip:
    def test_models_lists_the_served_name(self, client):
        models = client.models.list().data
        assert [m.id for m in models] == ["tiny"]

    def test_model_path_and_folder_name_are_aliases(self, client, tiny_qwen3_target):
        for name in (str(tiny_qwen3_target), tiny_qwen3_target.name):
            r = client.chat.completions.create(model=name, messages=USER, max_tokens=2, extra_body=NO_THINK)
            assert r.model == name and r.usage.completion_tokens <= 2

    def test_greedy_matches_transformers_generate(self, client, reference):
        prompt_ids, new_ids, text = reference(USER, 12, enable_thinking=False)
        r = client.chat.completions.create(model="tiny", messages=USER, temperature=0, max_tokens=12,
                                           extra_body=NO_THINK)
        choice = r.choices[0]
        assert choice.message.role == "assistant" and choice.message.content == text
        assert r.usage.prompt_tokens == len(prompt_ids)
        assert r.usage.completion_tokens == len(new_ids) == 12
        assert choice.finish_reason == "length"

    def test_chat_template_kwargs_reach_the_template(self, client):
        kw = dict(model="tiny", messages=USER, temperature=0, max_tokens=1)
        thinking = client.chat.completions.create(**kw, extra_body={"chat_template_kwargs":
                                                                    {"enable_thinking": True}})
        plain = client.chat.completions.create(**kw, extra_body=NO_THINK)
        # non-thinking mode appends the empty '<think>\n\n</think>\n\n' block to the prompt
        assert plain.usage.prompt_tokens > thinking.usage.prompt_tokens

    def test_seed_reproduces_and_n_gives_distinct_choices(self, client):
        kw = dict(model="tiny", messages=USER, temperature=1.0, top_p=0.95, max_tokens=10, seed=7,
                  extra_body={"top_k": 50, "min_p": 0.01, **NO_THINK})
        a = client.chat.completions.create(**kw)
        b = client.chat.completions.create(**kw)
        assert a.choices[0].message.content == b.choices[0].message.content
        many = client.chat.completions.create(**kw, n=3)
        assert [c.index for c in many.choices] == [0, 1, 2]
        assert len({c.message.content for c in many.choices}) > 1
        assert many.usage.completion_tokens == 30

    def test_default_max_tokens_applies(self, client):
        r = client.chat.completions.create(model="tiny", messages=USER, temperature=0, extra_body=NO_THINK)
        assert r.usage.completion_tokens == 16 and r.choices[0].finish_reason == "length"

    def test_stop_string_cuts_the_answer(self, client, reference):
        _, _, text = reference(USER, 12, enable_thinking=False)
        stop = text[4:7]
        assert stop and text.find(stop) >= 1
        r = client.chat.completions.create(model="tiny", messages=USER, temperature=0, max_tokens=12,
                                           stop=[stop], extra_body=NO_THINK)
        assert r.choices[0].message.content == text[:text.find(stop)]
        assert r.choices[0].finish_reason == "stop"


class TestStreaming:
    def test_stream_deltas_add_up_to_the_answer(self, client, reference):
        _, _, text = reference(USER, 12, enable_thinking=False)
        stream = client.chat.completions.create(model="tiny", messages=USER, temperature=0, max_tokens=12,
                                                stream=True, stream_options={"include_usage": True},
                                                extra_body=NO_THINK)
        chunks = list(stream)
        assert chunks[0].choices[0].delta.role == "assistant"
        content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert content == text
        finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        assert finishes == ["length"]
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12

    def test_stream_with_n_reports_each_choice(self, client):
        stream = client.chat.completions.create(model="tiny", messages=USER, temperature=1.0, seed=3, n=2,
                                                max_tokens=5, stream=True, extra_body=NO_THINK)
        ends = sorted(c.choices[0].index for c in stream if c.choices and c.choices[0].finish_reason)
        assert ends == [0, 1]


class TestBatching:
    def test_concurrent_requests_share_forward_passes(self, client, server, reference):
        prompts = [[{"role": "user", "content": f"Write {i} short words about the sea."}] for i in range(6)]
        expected = [reference(p, 20, enable_thinking=False)[2] for p in prompts]
        before = _health(server)
        results: dict[int, str] = {}

        def ask(i: int) -> None:
            r = client.chat.completions.create(model="tiny", messages=prompts[i], temperature=0,
                                               max_tokens=20, extra_body=NO_THINK)
            results[i] = r.choices[0].message.content

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        after = _health(server)
        assert [results[i] for i in range(6)] == expected  # batching must not change outputs
        assert after["max_batch_size"] > 1
        assert after["prepacked_linears"] > 0  # so the batched steps ran on the packed weights
        passes = after["forward_passes"] - before["forward_passes"]
        assert passes < 6 * 20, f"{passes} forward passes for 6 requests of 20 tokens: no sharing"
        assert after["requests"] - before["requests"] == 6


    def test_a_request_joins_a_running_batch(self, client, server, reference):
        before = _health(server)
        long = iter(client.chat.completions.create(model="tiny", messages=USER, temperature=0,
                                                   max_tokens=300, stream=True, extra_body=NO_THINK))
        for _ in range(3):  # role chunk, then content: the long answer is being generated now
            next(long)
        prompt = [{"role": "user", "content": "Write 3 short words about the sea."}]
        r = client.chat.completions.create(model="tiny", messages=prompt, temperature=0, max_tokens=8,
                                           extra_body=NO_THINK)
        assert r.choices[0].message.content == reference(prompt, 8, enable_thinking=False)[2]
        finish = [c.choices[0].finish_reason for c in long if c.choices and c.choices[0].finish_reason]
        after = _health(server)
        assert finish == ["length"], "the long answer ended before the short one arrived"
        assert after["joined"] - before["joined"] >= 1
        assert after["batches"] - before["batches"] == 1  # one batch served both


class TestErrors:
    def test_unknown_model_is_404(self, client):
        with pytest.raises(openai.NotFoundError) as e:
            client.chat.completions.create(model="gpt-9", messages=USER)
        assert "gpt-9" in str(e.value)

    def test_prompt_longer_than_context_is_400(self, client):
        long = [{"role": "user", "content": "The quick brown fox jumps. " * 200}]
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model="tiny", messages=long, max_tokens=4)
        assert "maximum context length is 512" in str(e.value)

    @pytest.mark.parametrize("bad", [{"temperature": 5}, {"top_p": 0}, {"n": 0}, {"max_tokens": 0},
                                     {"min_p": 2.0}, {"top_k": -3}])
    def test_bad_sampling_params_are_400(self, client, bad):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model="tiny", messages=USER, extra_body=bad)
        assert list(bad)[0] in str(e.value)

    def test_non_text_content_is_400(self, client):
        image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
        with pytest.raises(openai.BadRequestError, match="only text parts"):
            client.chat.completions.create(model="tiny", messages=image)

    def test_empty_messages_is_400(self, client):
        with pytest.raises(openai.BadRequestError, match="messages"):
            client.chat.completions.create(model="tiny", messages=[])

    @pytest.mark.parametrize(("body", "expected"), [
        (b'{"model": "tiny", "messages": [', "request body is not valid JSON"),
        (b"", "request body must be a JSON object"),
        (b'{"messages": [{"role": "user", "content": "hi"}]}', "model: Field required"),
    ])
    def test_malformed_bodies_name_the_cause(self, server, body, expected):
        req = urllib.request.Request(f"{server.base_url}/chat/completions", data=body, method="POST",
                                     headers={"content-type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(req, timeout=30)
        assert e.value.code == 400
        message = json.loads(e.value.read())["error"]["message"]
        assert expected in message and "None:" not in message and not message.startswith("0:")

    def test_server_still_healthy_after_errors(self, server):
        assert _health(server)["status"] == "ok"


def test_prompts_of_very_different_lengths_prefill_in_groups_and_decode_as_alone(tiny_qwen3_target,
                                                                                 reference):
    """One batch of short and long prompts: prefilled in length groups whose caches are stacked,
    every sequence still decodes exactly as Transformers' generate does for it alone."""
    from dspark_cli.serve.engine import Engine, Sequence, length_groups
    from dspark_cli.serve.sampling import SamplingParams

    engine = Engine(str(tiny_qwen3_target), dtype="float32", device="cpu")
    prompts = [[{"role": "user", "content": "Hi."}],
               [{"role": "user", "content": "Tell me about the sea. " * 30}],
               [{"role": "user", "content": "What is 2 plus 2?"}],
               [{"role": "user", "content": "Describe a mountain, a river and a town. " * 12}]]
    kwargs = {"enable_thinking": False}
    seqs = [Sequence(engine.render(p, kwargs), SamplingParams(temperature=0.0, max_tokens=12),
                     torch.Generator().manual_seed(0), lambda delta, reason: None) for p in prompts]
    groups = length_groups(seqs)
    assert 1 < len(groups) < len(seqs)  # the two short prompts share a forward, the long ones do not pad them
    forwards: list[int] = []
    engine.generate(seqs, on_forward=forwards.append)
    assert forwards[:len(groups)] == [len(g) for g in groups]
    for prompt, seq in zip(prompts, seqs, strict=True):
        assert seq.text == reference(prompt, 12, **kwargs)[2]


def test_length_groups_bound_the_padding():
    from dspark_cli.serve.engine import Sequence, length_groups
    from dspark_cli.serve.sampling import SamplingParams

    seqs = [Sequence([0] * n, SamplingParams(), torch.Generator(), lambda d, r: None)
            for n in (100, 12, 10, 95, 11, 300)]
    groups = length_groups(seqs, slack=1.25)
    assert [[len(s.prompt_ids) for s in g] for g in groups] == [[10, 11, 12], [95, 100], [300]]
    for g in groups:
        assert len(g) * max(len(s.prompt_ids) for s in g) <= 1.25 * sum(len(s.prompt_ids) for s in g)


def test_serve_refuses_a_missing_model(tmp_path):
    from dspark_cli.errors import DsparkError
    from dspark_cli.serve.process import start_server

    with pytest.raises(DsparkError, match="exited"):
        start_server(str(tmp_path / "no-such-model"), log_path=tmp_path / "log", startup_timeout=60)
    assert "error:" in (tmp_path / "log").read_text()


def test_regen_endpoints_serves_the_target_when_asked(tiny_qwen3_target, tmp_path):
    from dspark_cli.config import load_config
    from dspark_cli.serve.process import regen_endpoints

    toml = tmp_path / "p.toml"
    toml.write_text(f'[target]\nmodel = "{tiny_qwen3_target}"\nlayers = [1, 9]\ndtype = "float32"\n'
                    'prepack = false\n[regen]\nserve_target = true\nconcurrency = 4\n')
    with regen_endpoints(load_config(str(toml), [])) as (endpoints, model):
        client = openai.OpenAI(base_url=endpoints[0], api_key="unused", max_retries=0, timeout=60)
        assert [m.id for m in client.models.list().data] == [model] == [str(tiny_qwen3_target)]
        with urllib.request.urlopen(endpoints[0].removesuffix("/v1") + "/health", timeout=10) as r:
            assert json.load(r)["prepacked_linears"] == 0  # [target] prepack = false reached the server
    with pytest.raises(openai.APIConnectionError):  # stopped when the block ends
        client.models.list()
    plain = load_config(str(toml), ["regen.serve_target=false", "regen.endpoints=http://x:1/v1",
                                     "regen.model=m"])
    with regen_endpoints(plain) as (endpoints, model):
        assert (endpoints, model) == (["http://x:1/v1"], "m")


def test_busy_port_and_a_folder_that_is_no_model_fail_before_announcing(server, tiny_qwen3_target, tmp_path):
    """Both are checked before "✓ serving" is printed; each is one line naming the culprit."""
    from fixtures.cli import assert_user_error, run_dspark

    busy = run_dspark("serve", str(tiny_qwen3_target), "--port", str(server.port), "--threads", "1")
    assert_user_error(busy, f"cannot listen on 127.0.0.1:{server.port}")
    assert "serving" not in busy.stdout + busy.stderr and "loading" not in busy.stderr  # port checked first
    (tmp_path / "notes.txt").write_text("not a model")
    no_model = run_dspark("serve", str(tmp_path), "--port", "0", "--threads", "1")
    assert_user_error(no_model, str(tmp_path), "no config.json")
    assert "serving" not in no_model.stdout + no_model.stderr
    # the corrected command (the real target) is what the module's `server` fixture runs


def test_server_dies_with_a_killed_parent(tiny_qwen3_target, tmp_path):
    """kill -9 of the process that started the server (e.g. pipeline run) stops the server too."""
    import os
    import signal
    import subprocess
    import sys
    import time

    script = ("import sys; from dspark_cli.serve.process import start_server\n"
              f"h = start_server({str(tiny_qwen3_target)!r}, args=['--threads', '1'])\n"
              "print(h.process.pid, flush=True); sys.stdin.read()\n")
    parent = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True)
    child = int(parent.stdout.readline())
    os.kill(parent.pid, signal.SIGKILL)
    parent.wait(timeout=30)
    for _ in range(100):
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            return
        if open(f"/proc/{child}/stat").read().split()[2] == "Z":
            return  # exited, waiting to be reaped by init
        time.sleep(0.2)
    os.kill(child, signal.SIGKILL)
    pytest.fail("the server outlived its killed parent")
