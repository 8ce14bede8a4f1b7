"""Loads sonic_world.jsonl in memory for lm-eval (no Hub, no datasets cache: works offline)."""
from __future__ import annotations

import json
from pathlib import Path

DATA_FILE = Path(__file__).with_name("sonic_world.jsonl")


def load(**_metadata):
    """lm-eval `custom_dataset` hook; it passes the task metadata, which this task does not need."""
    import datasets

    rows = [json.loads(line) for line in DATA_FILE.read_text().splitlines() if line.strip()]
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})
