"""benchmarks/task_probe.py: every dataset it probes composes into a task with its
worked examples, and a failed probe is one row saying why (the probe itself, SmolLM2 for
minutes, is the benchmark)."""

import random

import pytest

pytest.importorskip("reasoning_gym")

from benchmarks.common import compose  # noqa: E402
from benchmarks.task_probe import COLUMNS, DATASETS, PROBE_OVERRIDES, SYSTEM, row_cells  # noqa: E402


@pytest.mark.parametrize("dataset", list(DATASETS))
def test_every_dataset_builds_with_its_config_and_three_shots(dataset):
    from asyncrl.wiring import build_task

    cfg = compose("model=smollm2", "task=reasoning_gym", f"task.dataset={dataset}",
                  f"+task.config={DATASETS[dataset]}", f"task.system='{SYSTEM}'",
                  "task.shots=3", *PROBE_OVERRIDES)  # fmt: skip
    task = build_task(cfg)  # reasoning-gym accepted the config's fields and values
    assert task.dataset_name == dataset and len(task.chat_form.examples) == 3
    assert task.chat_form.system == SYSTEM
    assert task.sample(random.Random(0)).answer != ""


def test_a_failed_probe_is_one_row_with_its_error():
    assert row_cells({"error": "VLLMValidationError: too long"}) == [
        "VLLMValidationError: too long", *[""] * (len(COLUMNS) - 1)
    ]  # fmt: skip
    figures = {c: float(i) for i, c in enumerate(COLUMNS)}
    assert row_cells(figures) == [float(i) for i in range(len(COLUMNS))]
