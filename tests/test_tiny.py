"""The built-in tiny model: deterministic, Hugging Face loadable by path, built once and atomically."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from aglverl.engine.tiny import (
    EOS_ID,
    PAD_ID,
    TINY_VERSION,
    build_tiny_model,
    default_tiny_dir,
    resolve_model,
    tiny_model_path,
)


def _files(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


def test_building_twice_gives_identical_files(tmp_path: Path) -> None:
    first = _files(build_tiny_model(tmp_path / "a"))
    second = _files(build_tiny_model(tmp_path / "b"))
    assert {"config.json", "model.safetensors", "tokenizer.json", "generation_config.json"} <= set(first)
    assert first == second


def test_build_leaves_the_global_torch_rng_alone(tmp_path: Path) -> None:
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    build_tiny_model(tmp_path / "m")
    assert torch.equal(torch.rand(3), expected)


def test_transformers_loads_model_and_tokenizer_by_path(tiny_model: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    config = model.config
    assert (config.model_type, config.hidden_size, config.num_hidden_layers) == ("qwen2", 128, 2)
    assert (config.num_attention_heads, config.num_key_value_heads, config.vocab_size) == (4, 2, 512)
    assert config.tie_word_embeddings and model.lm_head.weight is model.model.embed_tokens.weight
    assert 400_000 < sum(p.numel() for p in model.parameters()) < 700_000
    assert model.dtype == torch.float32
    assert (tokenizer.pad_token_id, tokenizer.eos_token_id, len(tokenizer)) == (PAD_ID, EOS_ID, 512)
    assert tokenizer.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>"]) == [0, 1, 2]
    assert model.generation_config.eos_token_id == EOS_ID


def test_chat_template_is_chatml_with_a_generation_prompt(tiny_model: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say yes."}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nSay yes.<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert ids[0] == 1 and ids.count(2) == 2
    assert tokenizer.decode(ids) == text
    # Common words and numbers are single tokens or nearly so: the corpus taught the merges.
    assert len(tokenizer.encode(" yes", add_special_tokens=False)) == 1
    assert len(tokenizer.encode("The answer is 42.", add_special_tokens=False)) <= 8


def test_tiny_model_path_builds_once_then_reuses(tmp_path: Path) -> None:
    target = tmp_path / "tiny"
    assert tiny_model_path(target) == target
    stamp = (target / "model.safetensors").stat().st_mtime_ns
    assert tiny_model_path(target) == target
    assert (target / "model.safetensors").stat().st_mtime_ns == stamp


def test_concurrent_builders_all_get_a_complete_directory(tmp_path: Path) -> None:
    target = tmp_path / "shared" / "tiny"
    results: list[Path] = []
    errors: list[BaseException] = []

    def build() -> None:
        try:
            results.append(tiny_model_path(target))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=build) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and results == [target] * 3
    assert sorted(p.name for p in target.parent.iterdir()) == ["tiny"]  # no scratch directory left
    assert _files(target) == _files(build_tiny_model(tmp_path / "reference"))


def test_resolve_model(tiny_model: Path, tmp_path: Path) -> None:
    assert resolve_model("tiny") == tiny_model == default_tiny_dir()
    assert tiny_model.name == f"tiny-{TINY_VERSION}"
    assert resolve_model(tiny_model) == tiny_model
    assert resolve_model(str(tiny_model)) == tiny_model
    with pytest.raises(FileNotFoundError, match="never downloaded"):
        resolve_model("Qwen/Qwen2.5-0.5B-Instruct")
    with pytest.raises(FileNotFoundError):
        resolve_model(tmp_path)  # a directory, but not a model


def test_verl_loads_the_tokenizer_by_path(tiny_model: Path) -> None:
    from verl.utils import hf_tokenizer

    tokenizer = hf_tokenizer(str(tiny_model))
    assert tokenizer.eos_token_id == EOS_ID and tokenizer.pad_token_id == PAD_ID
