"""Text data after set-up (issue 38, point 3): ``data.name=jsonl:``/``parquet:`` (and
``data.packing=documents`` over them) read through pyarrow, so pyarrow is a core dependency of
hpctrain, installed by ``bash scripts/setup.sh`` (README command 1), not a test extra. (The
fresh-venv run of a jsonl job is a manual check: CHANGELOG, issue 38.)"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")  # Python 3.11+; 3.10 reads the same file in CI's other jobs

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"


def _names(requirements: list[str]) -> set[str]:
    return {re.split(r"[<>=!~\[; ]", req, maxsplit=1)[0].lower() for req in requirements}


def test_pyarrow_is_a_core_dependency_and_peft_a_test_extra() -> None:
    project = tomllib.loads(PYPROJECT.read_text())["project"]
    assert "pyarrow" in _names(project["dependencies"])
    assert "peft" in _names(project["optional-dependencies"]["test"])  # tests/test_lora.py
    assert "torch" not in _names(project["dependencies"])  # cluster users bring their own CUDA build
