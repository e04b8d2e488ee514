"""A run's task inputs: lists of dicts, or parquet / JSON-lines / JSON files, and their prompts measured against
``data.max_prompt_length``."""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from .validation import ConfigError

logger = logging.getLogger(__name__)


# ---------------------------------------------------------------------------------------------- datasets
Samples = Sequence[Mapping[str, Any]] | str | os.PathLike[str] | None


def load_samples(source: Samples, files: Any = None) -> list[dict[str, Any]] | None:
    """Task inputs for agents: a list of dicts as given, or read from parquet / JSON-lines files.

    ``source=None`` falls back to ``files`` (verl's ``data.train_files`` / ``data.val_files``: a path or a list
    of paths); no source at all gives ``None``. Raises ``ConfigError`` naming a missing file or unknown format.
    """
    if source is None:
        if files is None:
            return None
        paths = [files] if isinstance(files, (str, os.PathLike)) else list(files)
        return [row for path in paths for row in _read_file(Path(os.path.expanduser(str(path))))]
    if isinstance(source, (str, os.PathLike)):
        return _read_file(Path(source))
    rows = list(source)
    for i, row in enumerate(rows):
        if not isinstance(row, Mapping):
            raise ConfigError(f"dataset row {i} must be a mapping (the task input), got {type(row).__name__}")
    return [dict(row) for row in rows]


def _read_file(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        raise ConfigError(f"dataset file {str(path)!r} does not exist")
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        import pyarrow.parquet as pq

        return list(pq.read_table(path).to_pylist())
    if suffix in (".jsonl", ".json"):
        return _read_json_rows(path)
    raise ConfigError(f"dataset file {str(path)!r}: expected .parquet, .jsonl or .json")


def _read_json_rows(path: Path) -> list[dict[str, Any]]:
    """JSON lines (one object a line), or for ``.json`` also one JSON array of objects; a line or item that is
    not an object is a :class:`ConfigError` naming it."""
    import orjson

    data = path.read_bytes()
    if path.suffix.lower() == ".json" and data.lstrip().startswith(b"["):
        try:
            rows = orjson.loads(data)
        except orjson.JSONDecodeError as exc:
            raise ConfigError(f"dataset file {str(path)!r} is not valid JSON: {exc}") from None
        where = "item"
    else:
        rows = []
        for number, line in enumerate(data.splitlines(), 1):
            if line.strip():
                try:
                    rows.append(orjson.loads(line))
                except orjson.JSONDecodeError as exc:
                    raise ConfigError(
                        f"dataset file {str(path)!r}, line {number}: not JSON ({exc})"
                    ) from None
        where = "row"
    for i, row in enumerate(rows):
        if not isinstance(row, dict):
            raise ConfigError(
                f"dataset file {str(path)!r}: {where} {i} must be a JSON object (a task input), got {row!r:.80}"
            )
    return rows


PROMPTS_MEASURED = 256
WIDTH_SLACK = 8


def _prompt_messages(row: Mapping[str, Any]) -> list[dict[str, Any]] | None:
    """The chat messages a task input carries as its prompt (``prompt``: a string or messages, as verl's
    datasets; or ``messages``); ``None`` when it carries none (the agent builds its prompt)."""
    prompt = row.get("prompt", row.get("messages"))
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    if (
        isinstance(prompt, (list, tuple))
        and prompt
        and all(isinstance(m, Mapping) and "role" in m for m in prompt)
    ):
        return [dict(m) for m in prompt]
    return None


def check_prompt_widths(config: Any, width_given: bool, rows: Sequence[Mapping[str, Any]]) -> None:
    """Measure the prompts the task inputs carry (chat template included) against ``data.max_prompt_length``
    (blocking: loads the tokenizer). A prompt longer than it is cut to its last ids and its row kept out of
    the loss: a warning. verl's default width (512) left alone (``width_given`` false) and far wider than
    every prompt: a warning too, since it is also each sequence's context in the engine. Inputs without a prompt, or a tokenizer that cannot be
    loaded here, are not measured."""
    step = max(1, len(rows) // PROMPTS_MEASURED)
    conversations = [m for row in rows[::step] if (m := _prompt_messages(row)) is not None]
    if not conversations:
        return
    try:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(config.actor_rollout_ref.model.path))
        lengths = [_rendered_length(tokenizer, messages) for messages in conversations]
    except Exception as exc:  # a hub id unreachable from here, a template that needs other fields
        logger.debug("prompts not measured: %s", exc)
        return
    width, longest = int(config.data.max_prompt_length), max(lengths)
    over = sum(length > width for length in lengths)
    if over:
        logger.warning(
            "aglverl: %d of %d prompts measured are longer than data.max_prompt_length (%d; the longest has %d "
            "tokens with the chat template): such a prompt is cut to its last %d ids and its row kept out of "
            "the loss; raise data.max_prompt_length",
            over,
            len(lengths),
            width,
            longest,
            width,
        )
    elif not width_given and width > WIDTH_SLACK * longest:
        logger.warning(
            "aglverl: data.max_prompt_length is verl's default (%d), %dx the longest prompt of the training data "
            "(%d tokens with the chat template); it bounds prompts and, with max_response_length, each "
            "sequence's context in the engine: set it to what your agent's prompts need (history and tool "
            "results included)",
            width,
            width // longest,
            longest,
        )


def _rendered_length(tokenizer: Any, messages: list[dict[str, Any]]) -> int:
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    else:
        text = "\n".join(str(m.get("content", "")) for m in messages)
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


def rollouts_per_step(config: Any) -> int:
    return int(config.data.train_batch_size) * int(config.actor_rollout_ref.rollout.n)
