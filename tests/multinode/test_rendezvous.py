"""Two hosts, no Slurm: `hpctrain run --nnodes 2 --rdzv-endpoint node1:PORT` started on node1 and node2 (two
network namespaces, each its own address and hostname) trains one job over the bridge, bit-identical to
`hpctrain run -n 2` on one host."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from tests.slurm.cluster import FAST, JOB, ROOT, SCRIPTS, STEPS, Up, base_env, summary

pytestmark = [pytest.mark.multinode, pytest.mark.slow]
TIMEOUT = 420  # a 600-step job takes ~40 s on a quiet 2-core machine; far more when it is shared


def _on_node(node: int, *cmd: str) -> subprocess.Popen[str]:
    return subprocess.Popen(["bash", str(SCRIPTS / "node-exec.sh"), str(node), *cmd], cwd=ROOT, env=base_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)


def _finish(procs: list[subprocess.Popen[str]], run_dir: object) -> list[tuple[int, str]]:
    results = []
    for proc in procs:
        try:
            out, _ = proc.communicate(timeout=TIMEOUT)
        except subprocess.TimeoutExpired:
            for p in procs:
                os.killpg(p.pid, signal.SIGKILL)
            # torch starts every rank in its own session: the group kill misses them, and a live
            # rank keeps the output pipe open (communicate() would then wait forever)
            subprocess.run(["pkill", "-KILL", "-f", f"run.dir={run_dir}"], check=False)
            pytest.fail(f"2-node run did not finish in {TIMEOUT} s:\n{proc.communicate(timeout=60)[0][-3000:]}")
        results.append((proc.returncode, out))
    return results


def test_two_hosts_train_one_job_bit_identical_to_one_host(network: Up, reference, tmp_path):
    run_dir = tmp_path / "run"

    def launch(node_rank: int) -> list[str]:
        return [sys.executable, "-m", "hpctrain", "run", "-n", "1", "--nnodes", "2", "--node-rank", str(node_rank),
                "--rdzv-endpoint", "node1:29400", "--rdzv-id", "netns-test", "train", FAST, *JOB, f"run.dir={run_dir}"]

    results = _finish([_on_node(1, *launch(0)), _on_node(2, *launch(1))], run_dir)
    for code, out in results:
        assert code == 0, out[-3000:]
    assert "world size 2" in results[0][1] + results[1][1]
    got = summary(run_dir)
    assert got["steps"] == STEPS
    assert got["params_sha256"] == reference["params_sha256"]
