"""``hpctrain report``: PNGs that are valid images, tables, and one self-contained HTML page."""

from __future__ import annotations

import base64
import json
import re

import pytest

from hpctrain.cli import main

pytest.importorskip("matplotlib", reason="hpctrain report needs the report extra (matplotlib)")
Image = pytest.importorskip("PIL.Image", reason="pillow checks the PNGs")

ALL_FIGURES = {"loss", "val_loss", "validation", "throughput", "data_wait", "mfu", "memory", "step_time", "stragglers"}


def _write_run(path, world: int = 2, slow_rank: int = 1) -> None:
    """A finished multi-rank run as the meter will write it: training rows with the step-time
    breakdown, memory and MFU; validation rows; straggler rows naming ``slow_rank``."""
    path.mkdir(parents=True)
    rows = []
    for step in range(10, 110, 10):
        rows.append({"step": step, "epoch": 0, "loss": 2.0 / step, "lr": 0.1, "samples_per_s": 900.0 + step,
                     "tokens_per_s": 9e4, "data_wait_share": 0.05, "mfu": 0.3, "mem_peak_gb": 1.5,
                     "time_data_s": 0.01, "time_fwd_bwd_s": 0.08, "time_optim_s": 0.01, "time_ckpt_s": 0.0})
        if step % 50 == 0:
            rows.append({"step": step, "epoch": 0, "val_loss": 1.0 / step, "val_accuracy": 0.9, "val_count": 100})
            ranks = [{"rank": r, "node": f"node{r // 2}", "step_s": 0.1, "data_wait_s": 0.01,
                      "compute_s": 0.2 if r == slow_rank else 0.08, "work_s": 0.21 if r == slow_rank else 0.09,
                      "relative": 0.43 if r == slow_rank else 1.0, "individual": 1.0} for r in range(world)]
            rows.append({"step": step, "kind": "straggler", "imbalance": 1.6, "stragglers": [slow_rank],
                         "ranks": ranks})
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 11')  # cut short
    (path / "summary.json").write_text(json.dumps({"steps": 100, "world_size": world, "val_loss": 0.01,
                                                   "val_accuracy": 0.9, "samples_per_s": 950.0}))


def _valid_png(path) -> bool:
    with Image.open(path) as img:
        img.verify()
        return img.format == "PNG" and img.size[0] > 100 and img.size[1] > 100


def test_report_of_a_multi_rank_run_writes_every_figure_and_html(tmp_path, capsys):
    run = tmp_path / "runs" / "gpt-ddp"
    _write_run(run, world=4, slow_rank=2)
    assert main(["report", str(run), "--html"]) == 0
    out = run / "report"
    pngs = {p.stem: p for p in out.glob("*.png")}
    assert set(pngs) == ALL_FIGURES
    assert all(_valid_png(p) for p in pngs.values())
    page = (out / "report.html").read_text()
    inlined = re.findall(r'<img alt="([^"]+)" src="data:image/png;base64,([^"]+)"', page)
    assert {name for name, _ in inlined} == ALL_FIGURES
    assert all(base64.b64decode(data) == pngs[name].read_bytes() for name, data in inlined)
    assert "<td>node1</td>" in page and "<td>2/2</td>" in page  # rank 2 on node1, named twice
    assert "src=\"http" not in page and "<script" not in page  # self-contained
    printed = capsys.readouterr().out
    assert "gpt-ddp" in printed and "950" in printed


def test_several_runs_side_by_side_including_a_real_finished_run(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    real = tmp_path / "real"
    assert main(["train", "data.name=synthetic_tiny", "data.synthetic_size=64", "model.name=tests.user_models:tiny_mlp",
                 "data.batch_size=8", "train.max_steps=6", "train.log_every=2", "train.progress=false",
                 f"run.dir={real}", "checkpoint.enabled=false"]) == 0
    _write_run(tmp_path / "other" / "real", world=2)  # same folder name: told apart by the parent
    capsys.readouterr()
    assert main(["report", str(real), str(tmp_path / "other" / "real"), "--out", "cmp"]) == 0
    pngs = {p.stem for p in (tmp_path / "cmp").glob("*.png")}
    assert {"loss", "throughput", "data_wait", "stragglers"} <= pngs
    assert all(_valid_png(p) for p in (tmp_path / "cmp").glob("*.png"))
    md = (tmp_path / "cmp" / "report.md").read_text()
    assert f"| {tmp_path.name}/real |" in md and "| other/real |" in md and "![loss](loss.png)" in md
    assert not (tmp_path / "cmp" / "report.html").exists()


def test_not_a_run_dir_is_a_user_error(tmp_path, capsys):
    assert main(["report", str(tmp_path)]) == 2
    assert "holds neither metrics.jsonl nor summary.json" in capsys.readouterr().err
    assert main(["report", str(tmp_path / "missing")]) == 2
