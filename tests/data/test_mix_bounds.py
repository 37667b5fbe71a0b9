"""Bounds of weighted mixtures (data.mix, issue 42): today's sample order pinned exactly (exact
resume and the behaviour matrix depend on it), the interleave's memory linear in the sources
(never positions x sources), the documented count of sources, and weights that are no weights
(huge, inf, nan, negative, all zero, an integer past a float) refused with exit 2 in one line.

The fingerprints below were computed by the interleave before issue 42 changed how it counts
(one-hot matrices of a block's positions x sources); any change to them changes every saved
mixture position's meaning."""

from __future__ import annotations

import contextlib
import hashlib
import io
import math
import tracemalloc

import numpy as np
import pytest
import torch

from hpctrain.cli import main
from hpctrain.config.mix import MAX_SOURCES
from hpctrain.core.env import ClusterEnv
from hpctrain.data.batch import ArrayDataset
from hpctrain.data.loader import IndexedBatches
from hpctrain.data.mixture import Interleave, MixSource, MixtureLoader, mixture_codes, source_seed

BLOCK_MAX = 2 * 2**20  # the largest block: a share of one quantum (MIN_SHARE)


def _hash(values: object) -> str:
    return hashlib.sha256(np.ascontiguousarray(np.asarray(values, dtype=np.int64)).tobytes()).hexdigest()[:16]


# name: (weights, seed, start, count) -> (block, sources hash, running-index hash, first sources, counts_before)
INTERLEAVES = {
    "three": (([0.5, 0.3, 0.2], 7, 0, 5000),
              (1024, "f302cc8d2bc8e99b", "f7183c92bbe591cc", [0, 0, 0, 1, 0, 1, 1, 0, 0, 0, 0, 1], [2494, 1497, 1002])),
    "three_mid": (([0.5, 0.3, 0.2], 7, 1234, 2000),
                  (1024, "d6d7782dcb347b56", "68f5425dba2e3989", [0, 0, 0, 2, 2, 2, 0, 0, 0, 0, 0, 1],
                   [1610, 974, 643])),
    "zero": (([1.0, 0.0, 1.0], 3, 0, 4096),
             (1024, "b616b50986f9a612", "473ef39ca85573a7", [2, 0, 0, 0, 0, 0, 0, 0, 2, 0, 0, 0], [2044, 0, 2045])),
    "seven_equal": (([1.0] * 7, 11, 1000, 3000),  # the rounding takes 3 quanta from the largest
                    (1024, "6e86a0043641a549", "24efd3129443d499", [3, 2, 6, 2, 1, 3, 4, 6, 2, 3, 5, 3],
                     [572, 568, 568, 571, 569, 572, 573])),
    "tiny_share": (([1.0, 1e-5], 3, 209000, 2000),  # across a block boundary of a block of 209,716
                   (209716, "f85f2c34eb2843d2", "65b90e84662f7441", [0] * 12, [210990, 3])),
    "uneven": (([5.0, 3.0, 1.5, 0.5, 2e-3, 7.25], 0, 0, 6000),
               (17190, "d395ce7fef141c44", "76c5cbd6520bd25f", [1, 0, 5, 2, 2, 5, 5, 5, 5, 5, 0, 2],
                [1727, 1046, 505, 170, 1, 2544])),
    "forty": (([float(1 + (i * 37) % 11) for i in range(40)], 5, 500, 4000),
              (1024, "cc66aa961813b749", "a54e3ce51668ea82", [34, 24, 5, 16, 27, 12, 13, 5, 35, 27, 13, 8],
               [18, 94, 170, 39, 117, 197, 55, 134, 215, 77, 152, 19, 96, 170, 39, 117, 194, 58, 132, 215, 76, 153,
                19, 95, 171, 40, 116, 191, 53, 139, 210, 77, 152, 19, 94, 175, 39, 116, 189, 61])),
    "min_share": (([1.0, 1.05e-6, 0.5], 2, BLOCK_MAX - 500, 1000),  # one quantum: the largest block
                  (BLOCK_MAX, "6a3d10c66f9abc81", "c8d5dc9b078aab90", [0, 0, 2, 2, 0, 0, 0, 0, 2, 0, 0, 2],
                   [1398452, 2, 699191])),
    # the issue's case: 300 sources and one at two quanta; before issue 42 this read took 90 s and 5.5 GB
    "many_small": (([1.0] * 300 + [300 * 2e-6], 9, 3 * BLOCK_MAX - 40, 100),
                   (BLOCK_MAX // 2, "cae513f0c96b395e", "fb9c36b00ec71e1c",
                    [91, 51, 49, 71, 218, 209, 83, 234, 243, 251, 193, 257], [20970, 20971, 12])),
}


@pytest.mark.parametrize("name", list(INTERLEAVES))
def test_the_interleave_is_the_one_of_before_issue_42(name: str) -> None:
    (weights, seed, start, count), (block, src_hash, run_hash, head, counts) = INTERLEAVES[name]
    inter = Interleave(weights, seed)
    src, run = inter.take(start, count)
    assert inter.block == block
    assert (_hash(src), _hash(run), src[:12].tolist()) == (src_hash, run_hash, head)
    assert inter.counts_before(start + count - 7).tolist()[-len(counts):] == counts


SIZES = {"big": 60, "mid": 25, "tiny": 5}
WEIGHTS = {"big": 0.5, "mid": 0.3, "tiny": 0.2}


def _sources(shuffle: str = "shard") -> list[MixSource]:
    """Sources whose input is (source number, sample id), two parts each (so shuffles differ)."""
    out = []
    for s, (label, n) in enumerate(SIZES.items()):
        x = torch.stack([torch.full((n,), float(s)), torch.arange(n, dtype=torch.float32)], dim=1)
        data = ArrayDataset(x, torch.zeros(n, dtype=torch.long), 10, label)
        out.append(MixSource(label, WEIGHTS[label], IndexedBatches(data), [n // 2, n - n // 2], n,
                             source_seed(7, label), shuffle, 4))  # type: ignore[arg-type]
    return out


@pytest.mark.parametrize(("shuffle", "digest", "head"), [
    ("shard", "a3bf2579423e3f79", [14, 1, 2, 1099511627798, 26, 1099511627792, 1099511627791, 4, 21, 18]),
    ("global", "17def7c9c0d7673d", [25, 36, 5, 1099511627789, 18, 1099511627785, 1099511627794, 35, 41, 48]),
    ("window", "57868a75454af3b4", [2, 3, 0, 1099511627795, 1, 1099511627794, 1099511627793, 4, 7, 5]),
    ("none", "84616c27f1f93b2c", [0, 1, 2, 1099511627776, 3, 1099511627777, 1099511627778, 4, 5, 6]),
])
def test_the_codes_of_three_epochs_are_the_ones_of_before(shuffle: str, digest: str, head: list[int]) -> None:
    codes = mixture_codes(Interleave(list(WEIGHTS.values()), 7), _sources(shuffle), 0, 270)  # sources wrap
    assert (_hash(codes), codes[:10].tolist()) == (digest, head)


def test_a_loader_at_world_size_2_yields_the_samples_of_before() -> None:
    loaders = [MixtureLoader(_sources(), ClusterEnv(rank=r, world_size=2), 3, seed=7, drop_last=False)
               for r in range(2)]
    rows = []
    for parts in zip(*loaders):
        for b in parts:
            mask = [True] * len(b) if b.mask is None else b.mask.tolist()
            rows += [int(v[0]) * 1000 + int(v[1]) for v, m in zip(b.inputs, mask) if m]
    assert (_hash(rows), rows[:10], len(rows)) == ("f11cc5b84ce7aa8b", [14, 1, 2, 1022, 26, 1016, 1015, 4, 21, 18], 90)
    assert {k: v["samples"] for k, v in loaders[0].stats()["mix"].items()} == {"big": 42, "mid": 30, "tiny": 18}
    assert loaders[0].source_epochs() == [0, 1, 3]


# ---------------------------------------------------------------- memory and the count of sources


def test_a_batch_of_301_sources_costs_a_block_not_positions_x_sources() -> None:
    """The issue's 301 sources (one at the minimum share: a block of 2,097,152 positions): one batch
    of 16 cost 10.7 GB; a block now costs a few bytes a position, whatever the count of sources."""
    inter = Interleave([1.0] * 300 + [300 * 1.05e-6], 4)
    assert inter.block == BLOCK_MAX
    tracemalloc.start()
    try:
        src, run = inter.take(BLOCK_MAX - 8, 16)  # a batch across two blocks
        counts = inter.counts_before(BLOCK_MAX + 8)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 40 * BLOCK_MAX, peak  # 2 blocks x (int16 sources + indexes): ~20 B a position, not 300 x 8 B
    assert len(src) == 16 and counts.sum() == BLOCK_MAX + 8 and counts[-1] in (1, 2)
    again = Interleave([1.0] * 300 + [300 * 1.05e-6], 4)  # a fresh one (no cached block) says the same
    assert np.array_equal(again.take(BLOCK_MAX - 8, 16)[1], run)


def test_the_documented_count_of_equal_sources_keeps_every_share() -> None:
    """At the limit every share is positive and the rounding never makes one negative (10,000
    equal sources made the largest share negative: "repeats may not contain negative values")."""
    inter = Interleave([1.0] * MAX_SOURCES, 0)
    shares = np.diff(inter.cuts)
    assert shares.min() > 0 and shares.sum() == 2**20
    counts = inter.counts_before(4 * inter.block)
    assert counts.sum() == 4 * inter.block and counts.max() - counts.min() <= 1
    with pytest.raises(ValueError, match=f"data.mix has {MAX_SOURCES + 1} sources; at most {MAX_SOURCES}"):
        Interleave([1.0] * (MAX_SOURCES + 1), 0)


@pytest.mark.parametrize(("weights", "says"), [
    ([1.0, math.nan], "data.mix[1].weight=nan must be a number >= 0 and finite"),
    ([math.inf, 1.0], "data.mix[0].weight=inf must be a number >= 0 and finite"),
    ([1.0, -2.0], "data.mix[1].weight=-2 must be a number >= 0 and finite"),
    ([0.0, 0.0], "data.mix: the weights sum to 0"),
    ([1e308, 1e308], "data.mix: the weights sum to more than a float holds"),
])
def test_the_interleave_refuses_weights_that_are_no_shares(weights: list[float], says: str) -> None:
    with pytest.raises(ValueError, match=f"^{says}".replace("[", r"\[").replace("]", r"\]")):
        Interleave(weights, 0)


def _config_show(mix: str) -> tuple[int, str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        code = main(["config", "show", "model.name=tests.user_models:tiny_mlp", f"data.mix={mix}"])
    return code, out.getvalue()


def _entries(weights: list[str]) -> str:
    return "[" + ", ".join(f"{{name: synthetic_tiny, weight: {w}, label: s{i}}}" for i, w in enumerate(weights)) + "]"


@pytest.mark.parametrize(("weights", "says"), [
    (["1.0e+308", "1.0e+308"], "data.mix: the weights sum to more than a float holds (inf); hint: scale them down"),
    (["1" + "0" * 400, "1"], "data.mix[0].weight (an integer of 401 digits) is too large for a float"),
    ([".nan", "1"], "data.mix[0].weight=nan must be a number >= 0 and finite"),
    (["1", "-.inf"], "data.mix[1].weight=-inf must be a number >= 0 and finite"),
    ([".inf", "1"], "data.mix[0].weight=inf must be a number >= 0 and finite"),
    (["-1", "1"], "data.mix[0].weight=-1 must be a number >= 0 and finite"),
    (["0", "0.0"], "data.mix: the weights sum to 0; at least one must be > 0"),
    (["true", "1"], "data.mix[0].weight=True must be a number >= 0 and finite"),
    (["1.0e+300", "1"], "data.mix[1].weight=1 is below 1e-06 of the total (1e+300)"),
])
def test_weights_that_are_no_shares_exit_2_in_one_line(weights: list[str], says: str) -> None:
    code, out = _config_show(_entries(weights))
    assert code == 2 and says in out and len(out.strip().splitlines()) == 1 and "Traceback" not in out, out


def test_more_sources_than_documented_exit_2_naming_data_mix_and_the_count() -> None:
    code, out = _config_show(_entries(["1"] * (MAX_SOURCES + 1)))
    assert code == 2 and len(out.strip().splitlines()) == 1, out
    assert f"data.mix has {MAX_SOURCES + 1} sources; at most {MAX_SOURCES} are supported" in out, out
    code, out = _config_show(_entries(["1"] * 3 + ["1.0e+200"]))  # huge but finite: only the ratios count
    assert code == 2 and "data.mix[0].weight=1 is below 1e-06 of the total" in out, out
    code, out = _config_show(_entries(["1.0e+200", "3.0e+200"]))
    assert code == 0, out
