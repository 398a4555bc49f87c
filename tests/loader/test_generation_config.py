"""generation_config.json's end-of-turn tokens join config.json's: gpt-oss stops on <|call|> as on
<|return|>, Llama 3 instruct on <|eot_id|> as on <|end_of_text|>."""

from __future__ import annotations

import json
import shutil

from kvflow import LLM, SamplingParams
from kvflow.config import ModelConfig
from kvflow.executors.model_setup import load_model


def test_generation_config_eos_tokens_stop_generation(tiny_checkpoints, tmp_path):
    folder = tmp_path / "model"
    shutil.copytree(tiny_checkpoints["llama"], folder)
    plain = load_model(ModelConfig(model=str(folder), dtype="float32", device="cpu"))
    prompt = {"prompt_token_ids": list(range(5, 30))}
    params = SamplingParams(temperature=0, max_tokens=12)
    tokens = LLM(loaded_model=plain, kv_cache_memory=8 << 20).generate([prompt], params)[0].outputs[0].token_ids
    stop = tokens[5]
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, stop]}))
    loaded = load_model(ModelConfig(model=str(folder), dtype="float32", device="cpu"))
    assert loaded.arch.eos_token_ids == [2, stop]  # config.json's first, then the new one
    out = LLM(loaded_model=loaded, kv_cache_memory=8 << 20).generate([prompt], params)[0].outputs[0]
    assert out.token_ids == tokens[:tokens.index(stop) + 1] and out.finish_reason == "stop"


def test_a_broken_generation_config_changes_nothing(tiny_checkpoints, tmp_path):
    folder = tmp_path / "model"
    shutil.copytree(tiny_checkpoints["llama"], folder)
    (folder / "generation_config.json").write_text("{not json")
    assert load_model(ModelConfig(model=str(folder), dtype="float32", device="cpu")).arch.eos_token_ids == [2]
