"""Config YAML and ``key=value`` overrides never crash or hang (issue 25, points 2 and 5): a
fixed-seed fuzzer over mutated config files and random overrides, each through ``hpctrain
config show`` in this process; the outcome is exit 0, or exit 2 with one error line, never a
traceback. Plus the cases the attack found: a 700-byte alias bomb (``config show`` and
``train`` return at once), a non-UTF-8 byte, YAML indicators in override values."""

from __future__ import annotations

import contextlib
import random
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from hpctrain.cli import main
from hpctrain.config import key_names, load_config

SEED, FILES, OVERRIDES = 20251126, 250, 250
BASE = b"""seed: 3
model:
  name: mnist_cnn
data:
  name: synthetic_tiny
  batch_size: 16
optim:
  lr: 0.05
  kwargs: {}
train:
  epochs: 2
run:
  dir: runs/{data.name}
"""
SNIPPETS = [b"&a ", b"*a", b"[", b"]", b"{", b"}", b"`", b"@", b"%", b"!!python/object:os.system ", b"|", b">",
            b"'", b'"', b"#", b": ", b"- ", b"\t", b"\n  ", b"\xff", b"\xc3", b"\x00", b"\x01", b"~", b"null",
            b"<<: *a\n", b"? ", b",", b"&b [*a, *a, *a, *a]\n", b"\xe2\x80\xa8", b"\r", b"---\n", b"...\n", b"1e6",
            b"!!timestamp 2020-99-99 ", b"!!float x ", b"1" * 5000]
VALUE_PARTS = ["`id`", "@x", "%x", "[x", "{x", "]", "}", "&a", "*a", "!!binary", "~", "null", "[1, 2]", "{a: 1}",
               "1e-3", "off", "yes", "'", '"', "#", ": ", "- ", "|", ">", "\udcff", "\x01", "\t", " ", "0x10", "-1",
               "3", "2.5", "x", "runs/{data.name}", "{nope}", "$HOME", "~/r", "\n", "é", "[&a [1], *a]", "!!float x",
               "!!timestamp 2020-99-99", "1" * 5000, "!!int 1_000"]


def _bomb() -> bytes:
    """A billion laughs: 9 levels of 9 aliases, 700 bytes, 9**9 values expanded."""
    lines = [b'a: &a ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    for level, name in enumerate("bcdefghi"):
        prev = "abcdefgh"[level]
        lines.append(f"{name}: &{name} [{', '.join(['*' + prev] * 9)}]".encode())
    return b"\n".join(lines) + b"\n"


@contextlib.contextmanager
def _hang_guard(seconds: int) -> Iterator[None]:
    """A case that does not return is a hang: fail with it instead of waiting for the suite's end."""
    def hung(signum: int, frame: object) -> None:
        raise TimeoutError("a config case hung")

    previous = signal.signal(signal.SIGALRM, hung)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def _outcome(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    capsys.readouterr()
    code = main(argv)
    return code, capsys.readouterr().err


def _assert_clean(code: int, err: str, case: object) -> None:
    assert code in (0, 2), (case, code, err)
    if code == 2:
        lines = err.strip().splitlines()
        assert len(lines) == 1 and ": error: " in lines[0], (case, err)
    assert "Traceback" not in err and "internal error" not in err, (case, err)


def _mutated(rng: random.Random) -> bytes:
    text = bytearray(BASE)
    for _ in range(rng.randint(1, 4)):
        at = rng.randrange(len(text) + 1)
        action = rng.random()
        if action < 0.6:
            text[at:at] = rng.choice(SNIPPETS)
        elif action < 0.8:
            del text[at:at + rng.randint(1, 6)]
        else:
            text[at:at] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 3)))
    return bytes(text)


def test_mutated_config_files(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rng = random.Random(SEED)
    path = tmp_path / "fuzz.yaml"
    codes = set()
    with _hang_guard(60):
        for case in range(FILES):
            data = _mutated(rng)
            path.write_bytes(data)
            code, err = _outcome(["config", "show", str(path)], capsys)
            _assert_clean(code, err, (case, data))
            codes.add(code)
    assert codes == {0, 2}  # the mutations reach both outcomes


def test_random_overrides(capsys: pytest.CaptureFixture[str]) -> None:
    rng = random.Random(SEED + 1)
    keys = [f"{section}.{k}" if section else k for section, names in key_names().items() for k in names]
    keys += ["optim.kwargs.eps", "nope.x", "model..name", "model.name.x", ".", ""]
    codes = set()
    with _hang_guard(60):
        for _ in range(OVERRIDES):
            argv = [f"{rng.choice(keys)}={''.join(rng.choices(VALUE_PARTS, k=rng.randint(1, 3)))}"
                    for _ in range(rng.randint(1, 3))]
            code, err = _outcome(["config", "show", *argv], capsys)
            _assert_clean(code, err, argv)
            codes.add(code)
    assert codes == {0, 2}


@pytest.mark.parametrize("command", ["config show", "train"])
@pytest.mark.parametrize("where", ["top", "optim.kwargs"])
def test_alias_bomb_is_refused_at_once(command: str, where: str, tmp_path: Path,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    bomb = _bomb()
    if where == "optim.kwargs":
        bomb = b"optim:\n  name: torch.optim:AdamW\n  kwargs:\n" + b"".join(b"    " + line + b"\n"
                                                                           for line in bomb.splitlines())
    assert len(_bomb()) <= 700
    path = tmp_path / "bomb.yaml"
    path.write_bytes(bomb)
    with _hang_guard(30):
        code, err = _outcome([*command.split(), str(path)], capsys)
    _assert_clean(code, err, bomb)
    assert code == 2 and "aliases (*name) expand to more than 100000 values" in err, err


def test_aliases_of_ordinary_size_still_work(tmp_path: Path) -> None:
    path = tmp_path / "anchors.yaml"
    path.write_text("optim: &o\n  lr: 0.25\nx_shared: &lr 0.25\ntrain:\n  epochs: 3\n")
    with pytest.raises(Exception, match="unknown key 'x_shared'"):
        load_config(path)
    path.write_text("optim:\n  lr: &lr 0.25\n  momentum: *lr\n")
    cfg = load_config(path)
    assert cfg.optim.lr == cfg.optim.momentum == 0.25


def test_non_utf8_config_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "latin1.yaml"
    path.write_bytes(b"model:\n  name: caf\xe9\n")
    code, err = _outcome(["config", "show", str(path)], capsys)
    _assert_clean(code, err, path)
    assert code == 2 and f"config file {path} is not UTF-8 text (byte 0xe9 on line 2)" in err


@pytest.mark.parametrize("override, key, value", [
    ("model.name=`id`", "name", "`id`"), ("run.dir=@x", "dir", "@x"), ("run.dir=%x", "dir", "%x"),
    ("data.path=[x", "path", "[x"), ("data.path={x", "path", "{x"), ("model.name=&a", "name", "&a"),
    ("run.dir=~", "dir", "~"),
])
def test_indicator_values_are_kept_verbatim(override: str, key: str, value: str) -> None:
    cfg = load_config(None, [override])
    assert getattr(getattr(cfg, override.split(".")[0]), key) == value


def test_indicator_value_of_a_number_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    code, err = _outcome(["config", "show", "optim.lr=`x"], capsys)
    _assert_clean(code, err, "optim.lr=`x")
    assert code == 2 and "override optim.lr='`x' is not valid YAML" in err
