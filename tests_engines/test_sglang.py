"""SGLang 0.5.23's own loaders and heads on what dspark writes (harness.py says what is stubbed).

Loaded from SGLang's files: the STS and SPS loaders, the DSpark/DFlash config parsers, the Markov
and confidence heads, and DSparkDraftMixin.load_weights (its backbone parent, DFlashDraftModel,
needs SGLang's GPU layers and is replaced by a recorder: vLLM's test checks the backbone).
"""

from __future__ import annotations

import json
import types
from pathlib import Path

import pytest
import torch
from conftest import DEMO_EXPORTS, REHEARSAL, absent
from harness import sglang_module
from safetensors.torch import load_file

pytest.importorskip("msgspec")
try:  # `import sglang` itself needs GPU-stack packages; the files are what is used (harness.py)
    import importlib.metadata

    importlib.metadata.distribution("sglang")
except importlib.metadata.PackageNotFoundError:
    pytest.skip("sglang is not installed (make test-engines installs it)", allow_module_level=True)

DSPARK_KINDS = ["vanilla", "vanilla-conf-h", "gated", "rnn", "headless"]


@pytest.fixture(autouse=True)
def _mode(monkeypatch):
    monkeypatch.delenv("SGLANG_RAGGED_VERIFY_MODE", raising=False)


def config_of(folder: str) -> dict:
    return json.loads((Path(folder) / "config.json").read_text())


# ---- STS --------------------------------------------------------------------------------------------

STS_CASES = [
    {"temperatures": [1.2, 0.8, 1.0, 1.1], "dataset": "d", "num_samples": 3, "ece_before": [0.1] * 4,
     "ece_after": [0.05] * 4, "per_position": [{"k": 1}], "schema_version": 1},
    {"temperatures": [1, 2, 3, 4]},
    {"temperatures": [1.0, 1.0, 1.0, 1.0], "ece_before": 0.12},
    {"temperatures": [1.0, 1.0, 1.0, 1.0], "num_samples": 3.0},
    {"temperatures": [1.0, 1.0, 1.0, 1.0], "dataset": 5},
    {"temperatures": [1.0, -1.0, 1.0, 1.0]},
    {"temperatures": []},
    {"temperatures": [True, 1.0, 1.0, 1.0]},
]


@pytest.mark.parametrize("case", range(len(STS_CASES)))
def test_export_checks_sts_verdict_is_sglangs(tmp_path, case):
    from dspark_cli.model.engine_check import check_sts

    sts = sglang_module("sglang.srt.speculative.dspark_components.dspark_sts")
    path = tmp_path / "c.json"
    path.write_text(json.dumps(STS_CASES[case]))
    try:
        sts.load_sts_calibration_from_path(str(path))
        sglang_ok = True
    except Exception:  # msgspec.ValidationError or ValueError from __post_init__
        sglang_ok = False
    problems = [p for p in check_sts(STS_CASES[case], 4) if "γ is" not in p]
    assert sglang_ok == (not problems), problems


def test_sglang_loads_the_calibration_dspark_calibrate_writes(target, exports, tmp_path):
    """The real `dspark calibrate` on a tiny drafter; SGLang's DSparkStsCalibration reads its file."""
    from dspark_cli.cli import main

    sts = sglang_module("sglang.srt.speculative.dspark_components.dspark_sts")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"turns": [q]}) for q in
                                 ["What is 12 plus 30?", "Write a short poem.", "def add(a, b):"]))
    try:
        main(["calibrate", "--target", str(target), "--drafter", exports["vanilla"][1], "--dataset",
              str(prompts), "--num-prompts", "3", "--max-new-tokens", "24", "-o", str(tmp_path / "cal"),
              "--set", "target.dtype='float32'", "--set", "target.device='cpu'"])
    except SystemExit as e:
        assert e.code == 0
    loaded = sts.load_sts_calibration_from_path(str(tmp_path / "cal" / "calibration.json"))
    assert len(loaded.temperatures) == 4 and all(t > 0 for t in loaded.temperatures)
    assert len(loaded.ece_before) == len(loaded.ece_after) == 4


# ---- SPS --------------------------------------------------------------------------------------------

def test_sglang_loads_the_sps_table_dspark_profile_writes(target, tmp_path):
    from dspark_cli.cli import main
    from dspark_cli.decode.sps import SpsTable
    from dspark_cli.model.engine_check import check_sps

    sps = sglang_module("sglang.srt.speculative.dspark_components.dspark_sps")
    main(["profile", "--target", str(target), "--batch-tokens", "1,3,8", "--repeats", "1", "--context-length",
          "8", "--dtype", "float32", "--device", "cpu", "-o", str(tmp_path / "profile")])
    path = tmp_path / "profile" / "sps.json"
    table = sps.load_sps_table_from_path(str(path))
    ours = SpsTable.load(str(path))
    assert isinstance(table, sps.SpsCostTable) and table.sample_batch_tokens == [1, 3, 8]
    assert table.max_batch_tokens == 8 and not sps.is_uninitialized_sps_table(table)
    # SGLang reads the floor probe; ours interpolates: equal on the probes themselves.
    for b in (1, 3, 8):
        assert table.lookup(b) == pytest.approx(ours(b))
    assert table.lookup(5) == pytest.approx(ours(3))
    assert check_sps(json.loads(path.read_text())) == []
    # The first release's form is what SGLang refused; check_sps says the same.
    old = {"schema_version": 1, "batch_tokens": [1, 2], "steps_per_second": [3.0, 2.0], "meta": {}}
    (tmp_path / "old.json").write_text(json.dumps(old))
    with pytest.raises(Exception, match="sample_batch_tokens"):
        sps.load_sps_table_from_path(str(tmp_path / "old.json"))
    assert check_sps(old)


# ---- DSpark / DFlash config -----------------------------------------------------------------------------

@pytest.mark.parametrize("kind", DSPARK_KINDS)
def test_sglang_parses_our_dspark_config(exports, kind):
    conf = sglang_module("sglang.srt.speculative.dspark_components.dspark_config")
    drafter, folder = exports[kind]
    cfg = config_of(folder)
    parsed = conf.parse_dspark_draft_config(draft_hf_config=cfg)
    c = drafter.config
    assert parsed.gamma == c.block_size and parsed.mask_token_id == c.mask_token_id
    assert parsed.target_layer_ids == c.target_layer_ids and parsed.num_hidden_layers == c.num_draft_layers
    headless = kind == "headless"
    assert parsed.markov_rank == (1 if headless else c.markov_rank)
    assert parsed.markov_head_type == ("vanilla" if headless else c.markov_head_type)
    runtime = conf.resolve_runtime_config(draft_hf_config=cfg, speculative_num_draft_tokens=c.block_size + 1,
                                          target_vocab_size=c.vocab_size)
    assert runtime.gamma == c.block_size and runtime.verify_num_draft_tokens == c.block_size + 1


def test_sglang_parses_our_dflash_config(exports):
    utils = sglang_module("sglang.srt.speculative.dflash_utils")
    drafter, folder = exports["fill_in"]
    parsed = utils.parse_dflash_draft_config(draft_hf_config=config_of(folder))
    assert parsed.block_size == drafter.config.block_size + 1  # DFlash counts the anchor slot
    assert parsed.target_layer_ids == drafter.config.target_layer_ids
    assert parsed.mask_token_id == drafter.config.mask_token_id


def test_why_the_private_config_moved_out_of_dspark_config(exports):
    """SGLang merges a top-level dspark_config into its settings: the first release's headless
    export put markov_head_type 'none' there, which SGLang refuses."""
    conf = sglang_module("sglang.srt.speculative.dspark_components.dspark_config")
    cfg = config_of(exports["headless"][1])
    assert conf.parse_dspark_draft_config(draft_hf_config=cfg).markov_head_type == "vanilla"
    old = dict(cfg, dspark_config=cfg["dspark_cli_config"])
    with pytest.raises(ValueError, match="markov_head_type"):
        conf.parse_dspark_draft_config(draft_hf_config=old)


# ---- heads -------------------------------------------------------------------------------------------------

def head_config(cfg: dict) -> types.SimpleNamespace:
    return types.SimpleNamespace(**cfg)


def prefixed(tensors: dict, prefix: str) -> dict:
    return {k.removeprefix(prefix): v for k, v in tensors.items() if k.startswith(prefix)}


@pytest.mark.parametrize("kind", DSPARK_KINDS)
def test_sglangs_markov_head_with_our_weights_gives_our_bias(exports, kind):
    model = sglang_module("sglang.srt.models.dspark")
    drafter, folder = exports[kind]
    tensors = load_file(str(Path(folder) / "model.safetensors"))
    head = model.build_markov_head(head_config(config_of(folder)))
    head.load_state_dict(prefixed(tensors, "markov_head."), strict=True)  # exact names and shapes
    gen = torch.Generator().manual_seed(3)
    gamma, d = drafter.config.block_size, drafter.config.hidden_size
    prev = torch.randint(0, drafter.config.vocab_size, (2, gamma), generator=gen)
    hidden = torch.randn(2, gamma, d, generator=gen)
    with torch.no_grad():
        if drafter.markov_head is None:
            ours = torch.zeros(2, gamma, drafter.config.vocab_size)
        else:
            ours = drafter.markov_head.bias(drafter.markov_head.features(prev, hidden))
        state = head.init_state(hidden[:, 0])
        theirs = []
        for k in range(gamma):
            bias, state = head.step_bias(prev[:, k], hidden_states=hidden[:, k], state=state)
            theirs.append(bias)
    assert (torch.stack(theirs, 1) - ours).abs().max() < 1e-5


@pytest.mark.parametrize("kind", ["vanilla", "vanilla-conf-h", "gated", "rnn"])
def test_sglangs_confidence_head_with_our_weights(exports, kind, monkeypatch):
    model = sglang_module("sglang.srt.models.dspark")
    drafter, folder = exports[kind]
    cfg = head_config(config_of(folder))
    assert model.build_confidence_head(cfg) is None  # static mode (the default) drops the head
    monkeypatch.setenv("SGLANG_RAGGED_VERIFY_MODE", "compact")
    conf = model.build_confidence_head(cfg)
    conf.load_state_dict(prefixed(load_file(str(Path(folder) / "model.safetensors")), "confidence_head."))
    hidden = torch.randn(3, drafter.config.block_size, drafter.config.hidden_size,
                         generator=torch.Generator().manual_seed(4))
    prev = torch.randint(0, drafter.config.vocab_size, (3, drafter.config.block_size),
                         generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        e = drafter.markov_head.embed_prev(prev)
        ours = drafter.confidence_head(hidden, e)
        theirs = conf(hidden, e if conf.with_markov else None)
    assert (theirs - ours).abs().max() < 1e-5


class _RecordingBackbone(torch.nn.Module):
    """Stands in for SGLang's DFlashDraftModel (GPU layers): records the backbone weights routed to it."""

    def __init__(self, config, quant_config=None, prefix: str = "") -> None:
        super().__init__()
        self.config = config
        self.block_size = config.block_size
        self.is_nemotron_35_draft = False
        self.routed: list[str] = []

    def load_weights(self, weights) -> None:
        self.routed += [name for name, _ in weights]


def sglang_draft(cfg: dict):
    model = sglang_module("sglang.srt.models.dspark")

    class Draft(model.DSparkDraftMixin, _RecordingBackbone):
        pass

    return Draft(head_config(cfg))


@pytest.mark.parametrize("kind", DSPARK_KINDS)
@pytest.mark.parametrize("mode", ["static", "compact"])
def test_sglangs_load_weights_takes_every_head_tensor(exports, kind, mode, monkeypatch):
    monkeypatch.setenv("SGLANG_RAGGED_VERIFY_MODE", mode)
    drafter, folder = exports[kind]
    cfg = config_of(folder)
    tensors = load_file(str(Path(folder) / "model.safetensors"))
    draft = sglang_draft(cfg)
    if mode == "compact" and not cfg["enable_confidence_head"]:
        # SGLang builds a confidence head in compact mode whatever the config says: export check
        # tells users to serve such a drafter in static mode.
        with pytest.raises(ValueError, match="confidence head is enabled"):
            draft.load_weights(tensors.items())
        return
    draft.load_weights(tensors.items())
    params = dict(draft.named_parameters())
    heads = {k: v for k, v in tensors.items() if k.startswith(("markov_head.", "confidence_head."))}
    if mode == "static":
        assert draft.confidence_head is None
        heads = {k: v for k, v in heads.items() if not k.startswith("confidence_head.")}
    assert set(heads) == set(params), "every head parameter written, every head tensor used"
    for name, t in heads.items():
        assert torch.equal(params[name], t), name
    backbone = {k for k in tensors if not k.startswith(("markov_head.", "confidence_head.", "embed_tokens.",
                                                        "lm_head."))}
    assert set(draft.routed) == backbone


def test_sglang_rejects_the_first_releases_gated_names(exports):
    """What the issue saw: `unexpected markov_head.gate.bias`. Our names now match SGLang's."""
    _, folder = exports["gated"]
    tensors = load_file(str(Path(folder) / "model.safetensors"))
    old = {k.replace("gate_proj", "gate"): v for k, v in tensors.items()}
    with pytest.raises(ValueError, match="unexpected markov weight"):
        sglang_draft(config_of(folder)).load_weights(old.items())


@pytest.mark.parametrize("folder", DEMO_EXPORTS, ids=lambda p: p.parent.parent.name)
def test_the_demos_real_exports_parse_and_load_in_sglang(folder, monkeypatch):
    if not (folder / "config.json").exists():
        pytest.skip(absent(folder))
    assert_real_export_loads_in_sglang(folder, monkeypatch)


def test_the_rehearsals_real_size_export_parses_and_loads_in_sglang(monkeypatch):
    """`make rehearse`'s Qwen3-4B-size export (DSPARK_REHEARSE_EXPORT) in SGLang's parser and loader."""
    if REHEARSAL[0] is None:
        pytest.skip("DSPARK_REHEARSE_EXPORT unset (make rehearse sets it)")
    assert_real_export_loads_in_sglang(Path(REHEARSAL[0]), monkeypatch)


def assert_real_export_loads_in_sglang(folder: Path, monkeypatch) -> None:
    cfg = config_of(str(folder))
    if cfg["architectures"] == ["DFlashDraftModel"]:
        utils = sglang_module("sglang.srt.speculative.dflash_utils")
        assert utils.parse_dflash_draft_config(draft_hf_config=cfg).block_size == cfg["block_size"]
        return
    monkeypatch.setenv("SGLANG_RAGGED_VERIFY_MODE", "compact" if cfg["enable_confidence_head"] else "static")
    draft = sglang_draft(cfg)
    draft.load_weights(load_file(str(folder / "model.safetensors")).items())
    assert draft.routed


def test_sglang_refuses_a_reduced_draft_vocabulary(reduced_export):
    """SGLang 0.5.23's DSpark loader builds markov_w2 with the target's vocabulary and reads no d2t:
    the export of model.draft_vocab_size fails its load, as `dspark export check` says."""
    _, folder = reduced_export
    cfg = config_of(folder)
    draft = sglang_draft(cfg)
    assert draft.markov_head.markov_w2.weight.shape[0] == cfg["vocab_size"]
    with pytest.raises((ValueError, AssertionError), match="shape|load weight"):
        draft.load_weights(load_file(str(Path(folder) / "model.safetensors")).items())


@pytest.mark.parametrize("kind", ["vanilla", "gated"])
def test_sglang_serves_a_widened_reduced_vocabulary_as_we_draft_it(widened_exports, kind, monkeypatch):
    """The default export of model.draft_vocab_size: SGLang's loader takes every head tensor, its
    Markov bias equals ours on the draft tokens and holds every other token 10,000 below, and its
    confidence head (reading its own W1 rows) gives our confidences."""
    monkeypatch.setenv("SGLANG_RAGGED_VERIFY_MODE", "compact")
    model = sglang_module("sglang.srt.models.dspark")
    drafter, folder = widened_exports[kind]
    cfg = config_of(folder)
    tensors = load_file(str(Path(folder) / "model.safetensors"))
    draft = sglang_draft(cfg)
    draft.load_weights(tensors.items())
    params = dict(draft.named_parameters())
    for name, t in tensors.items():
        if name.startswith(("markov_head.", "confidence_head.")):
            assert torch.equal(params[name], t), name
    ids = drafter.draft_token_ids
    gen = torch.Generator().manual_seed(3)
    gamma, d = drafter.config.block_size, drafter.config.hidden_size
    prev = torch.randint(0, drafter.config.vocab_size, (2, gamma), generator=gen)
    hidden = torch.randn(2, gamma, d, generator=gen)
    with torch.no_grad():
        ours = drafter.markov_head.bias(drafter.markov_head.features(prev, hidden))  # [2, γ, N]
        ours_conf = drafter.confidence_head(hidden, drafter.markov_head.embed_prev(prev))
        head = model.build_markov_head(head_config(cfg))
        head.load_state_dict(prefixed(tensors, "markov_head."), strict=True)
        state = head.init_state(hidden[:, 0])
        theirs = []
        for k in range(gamma):
            bias, state = head.step_bias(prev[:, k], hidden_states=hidden[:, k], state=state)
            theirs.append(bias)
        theirs = torch.stack(theirs, 1)  # [2, γ, V]
        conf = model.build_confidence_head(head_config(cfg))
        conf.load_state_dict(prefixed(tensors, "confidence_head."))
        theirs_conf = conf(hidden, head.markov_w1(prev))
    assert (theirs[..., ids] - ours).abs().max() < 1e-5
    others = torch.ones(drafter.config.vocab_size, dtype=torch.bool)
    others[ids] = False
    assert theirs[..., others].max() < -9_000
    assert (theirs_conf - ours_conf).abs().max() < 1e-5

