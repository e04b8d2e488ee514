"""The run's task inputs as verl's dataset (``data.custom_cls``)."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from torch.utils.data import Dataset

from .active_run import INPUT_KEY, current_run

logger = logging.getLogger(__name__)


# ---------------------------------------------------------------------------------------------- dataset
class SampleDataset(Dataset):
    """The run's task inputs as verl's dataset (``data.custom_cls``), built by verl's ``create_rl_dataset``.

    ``data_files`` is :data:`TRAIN_FILES` or :data:`VAL_FILES`; the samples are taken from the active run when
    the dataset is built, so the object pickles (data-loader workers) with them. Each item carries the task
    input under ``raw_prompt``, its position (``index``) and ``data_source`` (the sample's, or ``"aglverl"``).
    """

    def __init__(
        self,
        data_files: Any,
        tokenizer: Any = None,
        processor: Any = None,
        config: Any = None,
        max_samples: int = -1,
    ) -> None:
        name = data_files if isinstance(data_files, str) else next(iter(data_files))
        samples = current_run().datasets.get(str(name))
        if samples is None:
            raise ValueError(f"{name!r} is not a dataset of the active aglverl run")
        self.samples = samples if max_samples is None or max_samples < 0 else samples[:max_samples]

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> dict[str, Any]:
        sample = self.samples[index]
        source = sample.get("data_source") if isinstance(sample, Mapping) else None
        return {INPUT_KEY: sample, "index": index, "data_source": str(source or "aglverl")}
