"""`specdeploy engine serve` as a LeaderWorkerSet group of two pods, played by two processes on
loopback (gloo): LWS's variables tell each its place; the leader is not ready until the worker
pod has joined and loaded its shards; the group serves the same greedy completion as the
one-process server, token for token; every rank's log says its rank and node; a killed worker
pod stops the leader with a non-zero exit within the bound; SIGTERM ends both with exit 0; a
worker pod that never comes, and a leader address that does not resolve, end in one line each."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import time

import httpx
import openai

from specdeploy.engine.runtime.group import HEARTBEAT_TIMEOUT_S

PROMPT = "def main(argv):\n    "


def group_port() -> int:
    """A free port whose successor (torch's store) is free too."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        try:
            with socket.socket() as s:
                s.bind(("127.0.0.1", port + 1))
            return port
        except OSError:
            continue


def pod_env(index: int, leader: str = "localhost", size: int = 2) -> dict[str, str]:
    return dict(os.environ, OMP_NUM_THREADS="1", LWS_LEADER_ADDRESS=leader, LWS_GROUP_SIZE=str(size),
                LWS_WORKER_INDEX=str(index), NODE_NAME=f"node-{'ab'[index]}")


def start(argv: list[str], env: dict[str, str], log_path) -> subprocess.Popen:
    with open(log_path, "w") as log:
        return subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env)


def ready(url: str) -> bool:
    try:
        return httpx.get(f"{url}/ready", timeout=2).status_code == 200
    except httpx.TransportError:
        return False


def health(url: str) -> int | None:
    try:
        return httpx.get(f"{url}/health", timeout=2).status_code
    except httpx.TransportError:
        return None


def stop(*procs: subprocess.Popen) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def wait_until(predicate, timeout_s: float, what: str, procs=()):
    deadline = time.monotonic() + timeout_s
    while not predicate():
        for proc, log in procs:
            assert proc.poll() is None, f"{what}: a process exited:\n" + log.read_text(errors="replace")[-3000:]
        assert time.monotonic() < deadline, f"{what}: not within {timeout_s} s"
        time.sleep(0.2)


def test_two_pods_serve_as_one_and_a_lost_worker_stops_the_leader(serve_process_command, server, tmp_path):
    one_process = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)
    want = one_process.completions.create(model=server.model, prompt=PROMPT, max_tokens=24, temperature=0)

    port = group_port()
    argv, url, _ = serve_process_command("--tensor-parallel-size", "2", "--group-port", str(port))
    leader_log, worker_log = tmp_path / "leader.log", tmp_path / "worker.log"
    leader = start(argv, pod_env(0), leader_log)
    worker = None
    try:
        # The leader answers /health while it waits, but is not ready without its worker pod.
        wait_until(lambda: health(url) == 200, 120, "leader /health", [(leader, leader_log)])
        time.sleep(2)
        assert not ready(url)
        worker = start(argv, pod_env(1), worker_log)
        wait_until(lambda: ready(url), 240, "group ready", [(leader, leader_log), (worker, worker_log)])

        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
        got = client.completions.create(model=server.model, prompt=PROMPT, max_tokens=24, temperature=0)
        assert got.choices[0].text == want.choices[0].text
        assert got.usage.completion_tokens == want.usage.completion_tokens

        leader_text, worker_text = leader_log.read_text(), worker_log.read_text()
        assert "[tp0 node-a]" in leader_text and "[tp1 node-b]" in worker_text
        assert "group: worker 1 (rank 1, node node-b) joined" in leader_text
        assert "group: worker pod 1 of 2 on node node-b: ranks 1..1 of 2" in worker_text
        assert "rank 1 of 2" in worker_text  # it loaded its own shards

        worker.send_signal(signal.SIGKILL)
        t0 = time.monotonic()
        code = leader.wait(timeout=60)
        elapsed = time.monotonic() - t0
        assert code != 0
        assert elapsed < HEARTBEAT_TIMEOUT_S + 5
        assert re.search(r"group: lost worker 1 \(rank 1, node node-b\): connection \w+.*: stopping the server",
                         leader_log.read_text())
    finally:
        stop(leader, *([worker] if worker else []))


def test_sigterm_ends_the_group_with_exit_zero(serve_process_command, tmp_path):
    port = group_port()
    argv, url, _ = serve_process_command("--tensor-parallel-size", "2", "--group-port", str(port))
    leader_log, worker_log = tmp_path / "leader.log", tmp_path / "worker.log"
    leader = start(argv, pod_env(0), leader_log)
    worker = start(argv, pod_env(1), worker_log)
    try:
        wait_until(lambda: ready(url), 240, "group ready", [(leader, leader_log), (worker, worker_log)])
        leader.send_signal(signal.SIGTERM)
        assert leader.wait(timeout=60) == 0, leader_log.read_text()[-3000:]
        assert worker.wait(timeout=60) == 0, worker_log.read_text()[-3000:]
        assert "the leader ended the group; exiting" in worker_log.read_text()
    finally:
        stop(leader, worker)


def test_a_worker_pod_that_never_joins_is_named(serve_process_command, tmp_path):
    port = group_port()
    argv, url, _ = serve_process_command("--tensor-parallel-size", "2", "--group-port", str(port),
                                         "--rendezvous-timeout-s", "3")
    log = tmp_path / "leader.log"
    leader = start(argv, pod_env(0), log)
    try:
        assert leader.wait(timeout=120) == 1
        text = log.read_text()
        lines = [line for line in text.splitlines() if "rendezvous timeout" in line]
        assert len(lines) == 1
        assert lines[0].endswith(f"rendezvous timeout: worker 1 (rank 1) did not join the leader at port {port} "
                                 "within 3 s")
        assert "Traceback" not in text
    finally:
        stop(leader)


def test_a_leader_address_that_does_not_resolve_is_one_line(serve_process_command, tmp_path):
    argv, _, _ = serve_process_command("--tensor-parallel-size", "2", "--group-port", str(group_port()),
                                       "--rendezvous-timeout-s", "2")
    log = tmp_path / "worker.log"
    worker = start(argv, pod_env(1, leader="no-such-leader.invalid"), log)
    try:
        assert worker.wait(timeout=120) == 1
        text = log.read_text()
        assert "the leader address 'no-such-leader.invalid' (LWS_LEADER_ADDRESS) does not resolve" in text
        assert "Traceback" not in text
        assert len([line for line in text.splitlines() if "does not resolve" in line]) == 1
    finally:
        stop(worker)


def test_bad_group_variables_exit_2(serve_process_command, tmp_path):
    argv, _, _ = serve_process_command("--tensor-parallel-size", "2")
    out = subprocess.run(argv, env={**pod_env(1), "LWS_WORKER_INDEX": "5"}, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 2
    assert out.stderr.strip().endswith("LWS_WORKER_INDEX=5 is not a pod of a group of 2 (LWS_GROUP_SIZE)")
    assert "Traceback" not in out.stderr
