"""Tensor parallelism across machines: two network namespaces joined by a veth pair stand for two hosts, each
runs one torchrun rank, and the split model computes what the whole one does (the TP=2 parity test).

Making namespaces needs root (CI runs as root). Where the machine cannot, the test fails and says so rather
than passing without having run."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from .torchrun_rank import OPTIONS, PARAMS, PROMPTS
from .tp_helpers import REL_TOL, run_capturing_logits, worst_relative_difference

HERE = Path(__file__).parent
SUBNET = "10.231.{}.{}"


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=30)


@pytest.fixture
def two_hosts():
    """Two namespaces, ns0 at .1 and ns1 at .2, joined by one veth pair. Yields (names, addresses, interfaces)."""
    tag = os.getpid() % 10000
    names, links = [f"kvtp{tag}a", f"kvtp{tag}b"], [f"kvv{tag}a", f"kvv{tag}b"]
    addresses = [SUBNET.format(tag % 250, 1), SUBNET.format(tag % 250, 2)]
    try:
        for name in names:
            _ip("netns", "add", name)
        _ip("link", "add", links[0], "type", "veth", "peer", "name", links[1])
        for name, link, address in zip(names, links, addresses):
            _ip("link", "set", link, "netns", name)
            _ip("-n", name, "addr", "add", f"{address}/24", "dev", link)
            _ip("-n", name, "link", "set", link, "up")
            _ip("-n", name, "link", "set", "lo", "up")
    except (OSError, subprocess.CalledProcessError) as exc:
        detail = getattr(exc, "stderr", "") or exc
        for name in names:
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
        pytest.fail(f"this machine cannot make network namespaces (needs root and iproute2): {detail}")
    try:
        yield names, addresses, links
    finally:
        for name in names:
            subprocess.run(["ip", "netns", "del", name], capture_output=True)


def test_two_ranks_in_two_namespaces_match_one_rank(two_hosts, tiny_checkpoints, tmp_path):
    names, addresses, links = two_hosts
    model = str(tiny_checkpoints["llama"])
    out = tmp_path / "rank0.pt"
    port = 29400 + os.getpid() % 500
    procs = []
    for rank, (name, link) in enumerate(zip(names, links)):
        env = dict(os.environ, GLOO_SOCKET_IFNAME=link, OMP_NUM_THREADS="1", PYTHONPATH=str(HERE.parent.parent))
        procs.append(subprocess.Popen(
            ["ip", "netns", "exec", name, sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
             "--nproc-per-node", "1", "--node-rank", str(rank), "--master-addr", addresses[0],
             "--master-port", str(port), str(HERE / "torchrun_rank.py"), model, str(out)],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    logs = []
    for proc in procs:
        try:
            logs.append(proc.communicate(timeout=240)[0])
        except subprocess.TimeoutExpired:
            proc.kill()
            logs.append(proc.communicate()[0])
    assert all(p.returncode == 0 for p in procs), "\n\n".join(log[-3000:] for log in logs)
    split = torch.load(out)
    whole_tokens, whole_logits = run_capturing_logits(model, 1, PROMPTS, PARAMS, **OPTIONS)
    assert split["tokens"] == whole_tokens
    assert worst_relative_difference(whole_logits, split["logits"]) < REL_TOL
