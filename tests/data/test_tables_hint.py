"""A table whose only column is text, trained without train.task=causal_lm, is refused with a hint
that names train.task=causal_lm and data.input_key (issue 24, point 5): not only "no column 'label'"."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hpctrain.cli import main


def _write(path: Path) -> None:
    rows = [{"body": f"document {i}: some words to train a language model on"} for i in range(8)]
    if path.suffix == ".csv":
        path.write_text("body\n" + "".join(f"{r['body']}\n" for r in rows))
    else:
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))


@pytest.mark.parametrize("kind", ["jsonl", "csv"])
def test_a_text_only_table_hints_at_causal_lm(kind: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = tmp_path / f"docs.{kind}"
    _write(data)
    code = main(["train", f"data.name={kind}:{data}", "model.name=tests.user_models:tiny_mlp", "train.max_steps=1",
                 "train.progress=false", f"run.dir={tmp_path / 'run'}"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "has no column 'label'; its columns are ['body']; hint: set data.label_column (--label-column), or train " \
           "a language model on its text column 'body': train.task=causal_lm data.input_key=body" in err
    assert "Traceback" not in err

