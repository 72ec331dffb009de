"""The benchmarks' shared helpers: what bench-quality and bench-factors evaluate on."""

from __future__ import annotations

import argparse

import pytest

from benchmarks import common
from dspark_cli.config import load_config


@pytest.mark.parametrize("present", [True, False])
def test_mt_bench_joins_the_eval_sets_or_its_absence_is_said(tmp_path, monkeypatch, capsys, present):
    mt_bench = tmp_path / "shared" / "eval_datasets" / "mt-bench.jsonl"
    if present:
        mt_bench.parent.mkdir(parents=True)
        mt_bench.write_text('{"turns": ["Hi"]}\\n')
    monkeypatch.setattr(common, "MT_BENCH", mt_bench)
    cfg = load_config(common.REPO / common.DSPARK_CFG)
    own = list(cfg.eval.datasets)
    paths = common.eval_sets(cfg, argparse.Namespace(no_mt_bench=False))
    err = capsys.readouterr().err
    assert paths == ([*own, str(mt_bench)] if present else own)
    assert ("MT-Bench left out" in err and str(mt_bench) in err) is not present
    assert common.eval_sets(cfg, argparse.Namespace(no_mt_bench=True)) == own
    assert capsys.readouterr().err == ""
