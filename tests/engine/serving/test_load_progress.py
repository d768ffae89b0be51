"""While `engine serve` loads its weights it says how far it is: a log line every few seconds
(kubectl logs) and /health's `loading` figures (bytes loaded of the plan's weight bytes), which the
operator shows in the resource's Ready condition. The real engine on CPU, held mid-load."""

from __future__ import annotations

import logging
import threading

import httpx

from specdeploy.engine.models.checkpoint import LoadProgress
from specdeploy.engine.serving.cli import ServerThread, free_port

from engine_server import serve_argv


class HeldProgress(LoadProgress):
    """Logs at every tensor and holds the loader after its first one until `go` is set."""

    def __init__(self):
        super().__init__(log_every_s=0.0)
        self.first, self.go = threading.Event(), threading.Event()
        self.finished_at: dict[str, int] = {}

    def add(self, nbytes: int) -> None:
        super().add(nbytes)
        self.first.set()
        assert self.go.wait(timeout=60), "the test never let loading go on"

    def finish(self) -> None:
        self.finished_at = {"loaded_bytes": self.loaded_bytes, "total_bytes": self.total_bytes}
        super().finish()


def test_health_and_the_log_say_how_much_of_the_weights_is_loaded(model_dirs, caplog):
    caplog.set_level(logging.INFO, logger="specdeploy")
    running = ServerThread(serve_argv(*model_dirs, free_port()))
    progress = running.state.load_progress = HeldProgress()
    seen: dict = {}

    def look_mid_load() -> None:
        try:
            if progress.first.wait(timeout=60):
                seen.update(httpx.get(f"{running.base_url}/health", timeout=10).json())
        finally:
            progress.go.set()

    watcher = threading.Thread(target=look_mid_load)
    watcher.start()
    try:
        running.start(timeout_s=120)
        watcher.join()
        after = httpx.get(f"{running.base_url}/health", timeout=10).json()
    finally:
        progress.go.set()
        running.stop()
    plan_bytes = progress.finished_at["total_bytes"]
    assert seen["status"] == "ok" and seen["loading"]["total_bytes"] == plan_bytes > 0
    assert 0 < seen["loading"]["loaded_bytes"] < plan_bytes
    # Every parameter of target and draft counted once: what the plan said the checkpoints hold.
    assert progress.finished_at["loaded_bytes"] == plan_bytes
    assert after == {"status": "ok"}  # loaded: the figures are gone
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("loading weights: ")]
    assert len(lines) > 2 and lines[-1].startswith(f"loading weights: {plan_bytes / 2**30:.2f} of ")
    assert "(100%" in lines[-1] and "MiB/s" in lines[-1]


def test_progress_logs_every_few_seconds_and_reports_only_while_loading():
    now = [0.0]
    logged: list[str] = []
    progress = LoadProgress(log_every_s=5.0, clock=lambda: now[0])
    assert progress.figures() is None
    progress.start(4 * 2**30)
    handler = logging.Handler()
    handler.emit = lambda record: logged.append(record.getMessage())
    logger = logging.getLogger("specdeploy.engine.load")
    logger.addHandler(handler)
    old_level = logger.level
    logger.setLevel(logging.INFO)
    try:
        for _ in range(4):  # 1 GiB a second: a line at 5 s, none before
            now[0] += 1.0
            progress.add(2**30 // 4)
        assert logged == []
        now[0] = 5.0
        progress.add(2**30)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old_level)
    assert logged == ["loading weights: 2.00 of 4.00 GiB (50%), 410 MiB/s"]
    assert progress.figures() == {"loaded_bytes": 2 * 2**30, "total_bytes": 4 * 2**30}
    progress.finish()
    assert progress.figures() is None
