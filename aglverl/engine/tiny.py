"""The default model: a tiny random-init Qwen2 and a byte-level BPE tokenizer, built locally, never downloaded.

Model hubs are unreachable where aglverl runs its tests and CPU demo, so the default model is made here: a
Qwen2-architecture causal LM (hidden 128, 2 layers, 4 heads / 2 KV heads, vocabulary 512, tied embeddings,
~0.5 M float32 parameters) and a byte-level BPE tokenizer trained in memory on a small built-in corpus, with
ChatML special tokens (``<|endoftext|>`` = 0 = padding, ``<|im_start|>`` = 1, ``<|im_end|>`` = 2 = EOS), the
Hermes / Qwen2.5 markup as single non-special tokens (``<tool_call>``, ``</tool_call>``, ``<tool_response>``,
``</tool_response>``, ``<think>``, ``</think>``: ids 506-511, kept in decoded text as Qwen's are) and a ChatML
chat template with a tool section in the Qwen2.5 style (:data:`CHAT_TEMPLATE`). Both are written once, in Hugging Face format, to a directory that
``AutoModelForCausalLM.from_pretrained(path)``, ``AutoTokenizer.from_pretrained(path)`` and verl load by path.

The build is seeded and deterministic: building twice gives byte-identical files. It is atomic: files are
written to a temporary sibling directory that is renamed into place, so concurrent processes (several Ray
workers starting at once) either find the finished directory or build their own copy and lose the rename
race harmlessly; nobody ever sees a half-written model.

:func:`resolve_model` is the one place that turns what a user typed (``"tiny"`` or a local path) into a
directory; the CLI and the trainer both use it.
"""

from __future__ import annotations

import os
import random
import shutil
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

__all__ = [
    "CHAT_TEMPLATE",
    "MARKUP_TOKENS",
    "TINY_NAME",
    "TINY_VERSION",
    "build_tiny_model",
    "default_tiny_dir",
    "resolve_model",
    "tiny_model_path",
]

#: What users type to get the built-in model (``--model tiny``).
TINY_NAME = "tiny"
#: Bumped whenever the recipe (corpus, architecture, seed, tokenizer, chat template) changes, so a stale cache
#: is never reused. 2: the tool / reasoning tokens (the BPE keeps 6 merges fewer) and the template's tool section.
TINY_VERSION = "2"
#: Where the default directory lives: ``$AGLVERL_HOME/tiny-<version>`` (else ``~/.cache/aglverl/...``).
HOME_ENV = "AGLVERL_HOME"
SEED = 20240601
VOCAB_SIZE = 512
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
PAD_TOKEN, EOS_TOKEN = "<|endoftext|>", "<|im_end|>"
PAD_ID, EOS_ID = 0, 2
#: Hermes / Qwen2.5 markup, single tokens at the end of the vocabulary (not special: decoded text keeps them, so
#: a tool-call or reasoning parser sees them, as with Qwen's tokenizers).
MARKUP_TOKENS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>")
#: ChatML, as Qwen models use it; ``add_generation_prompt`` opens the assistant turn. Without ``tools`` (and
#: without assistant ``tool_calls`` or ``tool`` messages) it renders exactly the plain ChatML of version 1.
#: With ``tools``: the Qwen2.5 tool section in the system turn (the tools as JSON lines inside
#: ``<tools></tools>``, the ``<tool_call>`` convention), assistant ``tool_calls`` as ``<tool_call>`` blocks,
#: consecutive ``tool`` messages as ``<tool_response>`` blocks of one user turn (Qwen2.5's rendering).
CHAT_TEMPLATE = (
    # (Hugging Face renders with trim_blocks: a newline right after a tag is written as an expression.)
    "{% if tools %}<|im_start|>system{{ '\n' }}"
    "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] + '\n\n' }}{% endif %}"
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
    "{% for tool in tools %}{{ '\n' + (tool | tojson) }}{% endfor %}{{ '\n' }}</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
    "{% endif %}"
    "{% for m in messages %}"
    "{% if m['role'] == 'system' and tools and loop.first %}"
    "{% elif m['role'] == 'assistant' and m['tool_calls'] %}<|im_start|>assistant"
    "{% if m['content'] %}{{ '\n' + m['content'] }}{% endif %}"
    "{% for call in m['tool_calls'] %}"
    "{% if call['function'] is defined %}{% set call = call['function'] %}{% endif %}"
    "{{ '\n<tool_call>\n{\"name\": \"' + call['name'] + '\", \"arguments\": ' }}"
    "{{ call['arguments'] | tojson }}{{ '}\n</tool_call>' }}"
    "{% endfor %}<|im_end|>\n"
    "{% elif m['role'] == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}<|im_start|>user{% endif %}"
    "{{ '\n<tool_response>\n' + m['content'] + '\n</tool_response>' }}"
    "{% if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}<|im_end|>\n{% endif %}"
    "{% else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
#: Model construction draws from torch's global RNG; builds in one process take turns.
_BUILD_LOCK = threading.Lock()
#: Written last; its presence marks a complete directory (a rename makes the whole directory appear at once,
#: but a directory copied by hand might be partial).
_MARKER = "model.safetensors"

_WORDS = """
the be to of and a in that have it for not on with he as you do at this but his by from they we say her she
or an will my one all would there their what so up out if about who get which go me when make can like time
no just him know take people into year your good some could them see other than then now look only come its
over think also back after use two how our work first well way even new want because any these give day most
us is are was were been has had did does said yes okay sure right wrong true false answer question number
count add plus minus times equal sum total result hello hi thanks please sorry done task tool call file run
error value list name text word line step next last left right up down start stop end open close read write
find search help agent user system assistant model reply message think reason check test pass fail score
reward good bad better best more less many much few each every zero one two three four five six seven eight
nine ten hundred thousand red blue green big small long short fast slow hot cold old young high low
""".split()
_SENTENCES = (
    "Say yes.",
    "Say no.",
    "The answer is yes.",
    "The answer is no.",
    "Yes, that is right.",
    "No, that is wrong.",
    "You are a helpful assistant.",
    "You are terse.",
    "Count to ten.",
    "What is the sum?",
    "Think step by step, then answer.",
    "Call the tool and read the result.",
    "The task is done.",
    "Hello! How can I help you today?",
)


def _corpus() -> Iterator[str]:
    """The tokenizer's training text: words, sentences, digits and arithmetic, in a fixed seeded order."""
    rng = random.Random(SEED)
    yield from _SENTENCES * 20
    yield " ".join(_WORDS)
    for _ in range(400):
        yield " ".join(rng.choice(_WORDS) for _ in range(12)).capitalize() + rng.choice(".?!")
    for _ in range(400):
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        op = rng.choice("+-*")
        value = a + b if op == "+" else a - b if op == "-" else a * b
        yield f"{a} {op} {b} = {value}"
    for role in ("system", "user", "assistant"):
        yield f"<|im_start|>{role}\nSay yes.<|im_end|>\n" * 10


def _train_tokenizer() -> object:
    """A byte-level BPE ``tokenizers.Tokenizer`` with the ChatML specials first (ids 0, 1, 2)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE - len(MARKUP_TOKENS),
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=1,
        show_progress=False,
    )
    tokenizer.train_from_iterator(_corpus(), trainer)
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in MARKUP_TOKENS])
    if tokenizer.get_vocab_size() != VOCAB_SIZE:
        raise RuntimeError(f"the tiny tokenizer has {tokenizer.get_vocab_size()} tokens, not {VOCAB_SIZE}")
    return tokenizer


def _model_config() -> object:
    from transformers import Qwen2Config

    return Qwen2Config(
        vocab_size=VOCAB_SIZE,
        hidden_size=128,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
        dtype="float32",
    )


def _init_weights(model: Any) -> None:
    """Hugging Face's Qwen2 initialisation (normal(0, 0.02), zero biases and padding row, unit norms), drawn
    from a private generator: the weights depend on nothing but ``SEED`` (not on other threads' use of the
    global RNG, nor on the order in which a transformers version happens to initialise modules)."""
    import torch

    generator = torch.Generator().manual_seed(SEED)
    with torch.no_grad():
        for name, param in model.named_parameters():  # tied embeddings appear once
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            elif name.endswith(".bias"):
                param.zero_()
            else:
                param.normal_(0.0, 0.02, generator=generator)
        model.model.embed_tokens.weight[PAD_ID].zero_()


@contextmanager
def quiet_progress_bars() -> Iterator[None]:
    """Hide transformers' progress bars ("Writing model shards", "Loading weights") for the block: noise in a
    server's log. The switch is process-wide; it is restored on exit."""
    from transformers.utils import logging as hf_logging

    shown = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if shown:
            hf_logging.enable_progress_bar()


def build_tiny_model(directory: str | os.PathLike[str]) -> Path:
    """Write the tiny model and tokenizer to ``directory`` (created; must not exist or be empty).

    Deterministic: the weights come from a private seeded ``torch.Generator`` (the global RNG, which model
    construction draws from, is saved and restored, so callers' randomness is untouched). Takes well under a
    second once torch and transformers are imported.
    """
    import torch
    from transformers import GenerationConfig, PreTrainedTokenizerFast, Qwen2ForCausalLM

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=_train_tokenizer(),
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        chat_template=CHAT_TEMPLATE,
    )
    tokenizer.save_pretrained(out)
    with _BUILD_LOCK, torch.random.fork_rng(devices=[]):  # construction draws from the global RNG
        model = Qwen2ForCausalLM(_model_config())
    _init_weights(model)
    model.generation_config = GenerationConfig(bos_token_id=None, eos_token_id=EOS_ID, pad_token_id=PAD_ID)
    with quiet_progress_bars():
        model.save_pretrained(out)
    return out


def default_tiny_dir() -> Path:
    """``$AGLVERL_HOME/tiny-<version>``, or ``~/.cache/aglverl/tiny-<version>`` without the variable."""
    home = os.environ.get(HOME_ENV) or os.path.join("~", ".cache", "aglverl")
    return Path(home).expanduser() / f"tiny-{TINY_VERSION}"


def tiny_model_path(path: str | os.PathLike[str] | None = None) -> Path:
    """The tiny model's directory (default :func:`default_tiny_dir`), built first if it does not exist.

    Safe to call from many processes at once: each missing caller builds into a temporary sibling and renames
    it into place; a caller that loses the race discards its copy and uses the winner's (identical) files.
    """
    target = Path(path) if path is not None else default_tiny_dir()
    if (target / _MARKER).is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    scratch.chmod(0o755)  # mkdtemp makes it private; the model is no secret and may be shared
    try:
        build_tiny_model(scratch)
        try:
            os.rename(scratch, target)
        except OSError:
            if not (target / _MARKER).is_file():
                raise  # not a lost race: a stray non-empty directory is in the way
    finally:
        shutil.rmtree(scratch, ignore_errors=True)  # gone already after a successful rename
    return target


def resolve_model(model: str | os.PathLike[str]) -> Path:
    """``"tiny"`` -> the built-in model's directory (built if needed); anything else must be a local directory.

    Raises ``FileNotFoundError`` naming the path when it is not a directory holding a ``config.json``: a hub
    name is never downloaded.
    """
    if str(model) == TINY_NAME:
        return tiny_model_path()
    path = Path(model).expanduser()
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"model {str(model)!r} is neither {TINY_NAME!r} nor a local Hugging Face model directory "
            "(no config.json there); models are never downloaded"
        )
    return path
