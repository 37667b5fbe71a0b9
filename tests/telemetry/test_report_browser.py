"""``hpctrain report --html`` in a real headless browser: the page loads, and its inlined
figures decode and draw. ``scripts/setup.sh --test`` installs Debian's chromium (as root); where
no Chromium-family browser exists the test skips, with the reason."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from hpctrain.cli import main

pytest.importorskip("matplotlib", reason="hpctrain report needs the report extra (matplotlib)")
Image = pytest.importorskip("PIL.Image", reason="pillow reads the screenshot")

BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable", "chromium-headless-shell",
            "headless_shell")
PLOT_BLUE = (31, 119, 180)  # matplotlib's first line colour (#1f77b4): the loss curve
WINDOW = (1000, 1400)


@pytest.fixture
def browser() -> str:
    """Looked up first, so that a machine without one skips before training anything."""
    for name in BROWSERS:
        path = shutil.which(name)
        if path:
            return path
    pytest.skip(f"no headless browser on PATH (looked for {', '.join(BROWSERS)}); hint: as root, "
                "`bash scripts/setup.sh --test` installs Debian's chromium (or: apt-get install chromium)")


def _headless(browser: str, profile: Path, page: Path, *args: str) -> str:
    # --no-sandbox: Chromium refuses to start its sandbox as root (CI containers); the page is our own file
    cmd = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
           "--hide-scrollbars", f"--user-data-dir={profile}", f"--window-size={WINDOW[0]},{WINDOW[1]}", *args,
           page.as_uri()]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def _blue_pixels(png: Path) -> int:
    with Image.open(png) as img:
        rgb = img.convert("RGB")
        assert rgb.size == WINDOW
        return sum(n for n, c in rgb.getcolors(WINDOW[0] * WINDOW[1]) if all(abs(a - b) <= 8
                                                                            for a, b in zip(c, PLOT_BLUE)))


def _non_white_share(png: Path) -> float:
    with Image.open(png) as img:
        colors = img.convert("L").getcolors(256)
    return sum(n for n, level in colors if level < 245) / (WINDOW[0] * WINDOW[1])


@pytest.fixture
def report_page(tmp_path, monkeypatch) -> Path:
    """A small finished run's ``report.html``, as a user gets it."""
    monkeypatch.chdir(tmp_path)
    run = tmp_path / "run"
    assert main(["train", "data.name=synthetic_tiny", "data.synthetic_size=64", "model.name=tests.user_models:tiny_mlp",
                 "data.batch_size=8", "train.max_steps=6", "train.log_every=2", "train.progress=false",
                 f"run.dir={run}", "checkpoint.enabled=false"]) == 0
    assert main(["report", str(run), "--html"]) == 0
    return run / "report" / "report.html"


def test_report_html_loads_and_draws_its_figures_in_a_headless_browser(browser, report_page, tmp_path):
    figures = {p.stem for p in report_page.parent.glob("*.png")}
    assert "loss" in figures

    dom = _headless(browser, tmp_path / "profile", report_page, "--dump-dom")
    assert set(re.findall(r'<img alt="([^"]+)" src="data:image/png;base64,', dom)) == figures
    assert "<table>" in dom and "<td>6</td>" in dom  # the summary table, with the run's 6 steps

    shot = tmp_path / "page.png"
    _headless(browser, tmp_path / "profile", report_page, f"--screenshot={shot}")
    assert _non_white_share(shot) > 0.02, "the screenshot is blank"
    drawn = _blue_pixels(shot)

    # The control: the same page with undecodable image data shows text and tables but no curve,
    # so the blue pixels above come from the inlined PNGs, decoded and drawn by the browser.
    broken = tmp_path / "broken.html"
    broken.write_text(re.sub(r"base64,[^\"]+", "base64,AAAA", report_page.read_text()))
    control = tmp_path / "broken.png"
    _headless(browser, tmp_path / "profile", broken, f"--screenshot={control}")
    assert _blue_pixels(control) == 0
    assert drawn > 200, f"only {drawn} pixels of the loss curve's colour: the figures did not render"
