"""`dspark model convert`: GGUF / Transformers folder → plain safetensors folder, verified."""

from __future__ import annotations

import json

import pytest
import torch

from dspark_cli.cli import main
from dspark_cli.convert import convert_model, find_smollm2_gguf, max_logit_difference, read_record


def _run(argv: list[str]) -> int:
    try:
        main(argv)
    except SystemExit as e:
        return int(e.code or 0)
    return 0


class TestConvertLibrary:
    def test_folder_round_trip_keeps_logits_and_template(self, tiny_llama_target, tmp_path):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        out = convert_model(str(tiny_llama_target), tmp_path / "converted")
        record = read_record(out)
        assert record["format"] == "transformers" and record["max_abs_logit_diff"] <= 1e-3
        assert (out / "model.safetensors").is_file()
        config = json.loads((out / "config.json").read_text())
        assert "quantization_config" not in config
        tok = AutoTokenizer.from_pretrained(out)
        assert tok.chat_template == AutoTokenizer.from_pretrained(tiny_llama_target).chat_template
        ids = torch.tensor([tok.apply_chat_template([{"role": "user", "content": "What is 12 plus 30?"}],
                                                    add_generation_prompt=True, return_dict=False)])
        a = AutoModelForCausalLM.from_pretrained(tiny_llama_target, dtype=torch.float32)
        b = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
        assert max_logit_difference(a, b, ids) == 0.0
        assert not list(tmp_path.glob(".converted.tmp-*")), "temporary folder left behind"

    def test_bfloat16_output_is_smaller_and_close(self, tiny_llama_target, tmp_path):
        out = convert_model(str(tiny_llama_target), tmp_path / "bf16", dtype="bfloat16")
        f32 = convert_model(str(tiny_llama_target), tmp_path / "f32")
        assert (out / "model.safetensors").stat().st_size < 0.6 * (f32 / "model.safetensors").stat().st_size
        assert read_record(out)["max_abs_logit_diff"] < 1.0

    def test_smollm2_gguf_is_found(self):
        path = find_smollm2_gguf()
        assert path.name.endswith(".gguf") and path.read_bytes()[:4] == b"GGUF"


class TestConvertCommand:
    def test_second_run_is_a_no_op(self, tiny_llama_target, tmp_path, capsys):
        out = tmp_path / "m"
        assert _run(["model", "convert", str(tiny_llama_target), str(out)]) == 0
        stamp = (out / "model.safetensors").stat().st_mtime_ns
        capsys.readouterr()
        assert _run(["model", "convert", str(tiny_llama_target), str(out)]) == 0
        assert "nothing to do" in capsys.readouterr().err
        assert (out / "model.safetensors").stat().st_mtime_ns == stamp

    def test_missing_gguf_is_one_line_error(self, tmp_path, capsys):
        assert _run(["model", "convert", str(tmp_path / "nope.gguf"), str(tmp_path / "o")]) == 2
        err = capsys.readouterr().err
        assert "error:" in err and "nope.gguf" in err and "Traceback" not in err

    def test_not_a_gguf_file(self, tmp_path, capsys):
        fake = tmp_path / "fake.gguf"
        fake.write_bytes(b"NOPE" * 10)
        assert _run(["model", "convert", str(fake), str(tmp_path / "o")]) == 2
        assert "not a GGUF file" in capsys.readouterr().err

    def test_unknown_folder(self, tmp_path, capsys):
        (tmp_path / "empty").mkdir()
        assert _run(["model", "convert", str(tmp_path / "empty"), str(tmp_path / "o")]) == 2
        assert "cannot read a Transformers config" in capsys.readouterr().err

    def test_out_holding_user_files_or_a_file_is_never_replaced(self, tiny_llama_target, tmp_path, capsys):
        """Issue 29: OUT with the user's own files was removed and replaced (exit 0)."""
        mine = tmp_path / "mine"
        mine.mkdir()
        (mine / "notes.txt").write_text("keep me")
        afile = tmp_path / "afile"
        afile.write_text("keep me too")
        for out, says in ((mine, "holding other files"), (afile, "existing file")):
            assert _run(["model", "convert", str(tiny_llama_target), str(out)]) == 2
            err = capsys.readouterr().err
            assert says in err and str(out) in err and "Traceback" not in err
        assert (mine / "notes.txt").read_text() == "keep me" and afile.read_text() == "keep me too"
        assert sorted(p.name for p in tmp_path.iterdir()) == ["afile", "mine"]  # no temporary left
        assert _run(["model", "convert", str(tiny_llama_target), str(mine), "--force"]) == 0
        assert read_record(mine) and not (mine / "notes.txt").exists()

    def test_a_failed_conversion_leaves_no_temporary_and_keeps_the_old_folder(
            self, tiny_llama_target, tmp_path, monkeypatch, capsys):
        import dspark_cli.convert as convert

        out = tmp_path / "m"
        assert _run(["model", "convert", str(tiny_llama_target), str(out)]) == 0
        before = (out / "model.safetensors").read_bytes()

        def broken(*_args, **_kwargs):
            raise convert.DsparkError("the converted model's logits differ (injected)")

        monkeypatch.setattr(convert, "_verify", broken)
        assert _run(["model", "convert", str(tiny_llama_target), str(out), "--dtype", "bfloat16"]) == 2
        assert "injected" in capsys.readouterr().err
        assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]
        assert (out / "model.safetensors").read_bytes() == before

    def test_smollm2_flag_takes_only_out(self, tmp_path, capsys):
        assert _run(["model", "convert", "--smollm2", "a", "b"]) == 2
        assert "--smollm2 takes only OUT" in capsys.readouterr().err


@pytest.mark.slow
def test_real_smollm2_gguf_matches_converted_folder(tmp_path):
    """The real target: the folder's logits equal the GGUF-loaded model's (independent load)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(1)
    gguf = find_smollm2_gguf()
    out = convert_model(str(gguf), tmp_path / "smollm2")
    record = read_record(out)
    assert record["num_hidden_layers"] == 30 and record["vocab_size"] == 49152
    tok = AutoTokenizer.from_pretrained(out)
    assert "<|im_start|>assistant" in tok.apply_chat_template([{"role": "user", "content": "hi"}],
                                                               add_generation_prompt=True, tokenize=False)
    ids = torch.tensor([tok("def add(a, b):\n    return a + b")["input_ids"]])
    src = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    dst = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    assert max_logit_difference(src, dst, ids) <= 1e-3
