"""Settings of embedding models: PoolerConfig / PoolingParams validation, the task check, the
CLI flags, and sentence-transformers files that ask for a pooling tokenwise cannot do."""

from __future__ import annotations

import argparse
import json

import pytest

from tokenwise.config import PoolerConfig
from tokenwise.entrypoints.engine_args import add_engine_args, engine_kwargs
from tokenwise.pooling.params import PoolingParams
from tokenwise.pooling.st_config import load_sentence_transformers_pooler
from tokenwise.pooling.task import resolve_task


def test_pooler_config_and_pooling_params_name_bad_values() -> None:
    assert PoolerConfig("mean").pooling_type == "MEAN"
    with pytest.raises(ValueError, match="pooling_type must be one of CLS, MEAN, LAST, got 'MAX'"):
        PoolerConfig("MAX")
    with pytest.raises(ValueError, match="normalize"):
        PoolerConfig(normalize="yes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="dimensions must be an integer >= 1, got 0"):
        PoolingParams(dimensions=0)
    with pytest.raises(ValueError, match="dimensions=16 is not supported"):
        PoolingParams(dimensions=16).verify("bert")
    PoolingParams(normalize=False).verify("bert")


def test_task_resolution() -> None:
    assert resolve_task("auto", ["BertModel"]) == "embed"
    assert resolve_task("auto", ["LlamaForCausalLM"]) == "generate"
    assert resolve_task("embed", ["XLMRobertaModel"]) == "embed"
    with pytest.raises(
        ValueError, match="task must be one of auto, generate, embed, score, classify"
    ):
        resolve_task("rerank", ["BertModel"])
    with pytest.raises(ValueError, match="use task='embed'"):
        resolve_task("generate", ["BertForMaskedLM"])
    with pytest.raises(ValueError, match="use task='generate'"):
        resolve_task("embed", ["Qwen3ForCausalLM"])


def test_cli_flags(capsys: pytest.CaptureFixture) -> None:
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(
        [
            "--task",
            "embed",
            "--override-pooler-config",
            '{"pooling_type": "last", "normalize": false}',
        ]
    )
    kwargs = engine_kwargs(args)
    assert kwargs["task"] == "embed"
    assert kwargs["override_pooler_config"] == PoolerConfig("LAST", False)
    assert engine_kwargs(parser.parse_args([]))["task"] == "generate"
    for bad in ('{"pooling_type": "MAX"}', "[1]", "not json", '{"pool": 1}'):
        with pytest.raises(SystemExit, match="^2$"):  # argparse's exit status for a usage error
            parser.parse_args(["--override-pooler-config", bad])
        assert f"invalid pooler config {bad!r}" in capsys.readouterr().err


def test_sentence_transformers_files(tmp_path) -> None:
    assert load_sentence_transformers_pooler(str(tmp_path)) is None
    pooling = {"type": "sentence_transformers.models.Pooling", "path": "1_Pooling"}
    (tmp_path / "modules.json").write_text(json.dumps([pooling]))
    (tmp_path / "1_Pooling").mkdir()
    config = tmp_path / "1_Pooling" / "config.json"
    config.write_text(json.dumps({"pooling_mode_cls_token": True}))
    assert load_sentence_transformers_pooler(str(tmp_path)) == PoolerConfig("CLS", False)
    config.write_text(
        json.dumps({"pooling_mode_cls_token": True, "pooling_mode_mean_tokens": True})
    )
    with pytest.raises(ValueError, match="exactly one of"):
        load_sentence_transformers_pooler(str(tmp_path))
    (tmp_path / "modules.json").write_text("{broken")
    with pytest.raises(ValueError, match="modules.json"):
        load_sentence_transformers_pooler(str(tmp_path))
