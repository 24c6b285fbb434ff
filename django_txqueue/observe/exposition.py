"""``run_queue_consumer --metrics-port``: the HTTP endpoint Prometheus scrapes.

One process: its own counters (``metrics.py``) and the database-side gauges
(``collector.py``), served by prometheus_client's ``start_http_server`` on a daemon
thread. With ``--processes N``, prometheus-client's multiprocess mode: the supervisor
makes a temporary ``PROMETHEUS_MULTIPROC_DIR`` before it starts the children (who
inherit it, and write their counters there every second), serves their sum
(``MultiProcessCollector``) and the gauges, and removes the directory when it ends; each
child writes its last counts and marks itself dead as it exits.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from typing import Any

from . import metrics
from .collector import QueueCollector

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"


def serve(registry: Any, port: int, address: str) -> Any:
    """Serve ``registry`` on ``address:port`` from a daemon thread; the server."""
    client = metrics.prometheus()
    server, _thread = client.start_http_server(port, addr=address, registry=registry)
    return server


def serve_this_process(port: int, address: str) -> Any:
    """A single consumer process: record its metrics and serve them with the gauges."""
    client = metrics.prometheus()
    client.disable_created_metrics()  # no *_created series beside each counter
    registry = client.CollectorRegistry(auto_describe=False)
    server = serve(registry, port, address)  # first: a port in use enables nothing
    metrics.enable(registry)
    registry.register(QueueCollector(close_connections=True))
    return server


class Multiprocess:
    """The supervisor's side of ``--processes N --metrics-port``: ``start()`` before the
    children are spawned, ``close()`` after the last has exited."""

    def __init__(self) -> None:
        self.directory = tempfile.mkdtemp(prefix="txqueue-metrics-")
        self.server: Any = None

    def start(self, port: int, address: str) -> None:
        # Before prometheus_client is first imported here, and before any child starts.
        os.environ[MULTIPROC_ENV] = self.directory
        client = metrics.prometheus()
        from prometheus_client import multiprocess

        registry = client.CollectorRegistry(auto_describe=False)
        multiprocess.MultiProcessCollector(registry, path=self.directory)  # type: ignore[no-untyped-call]
        registry.register(QueueCollector(close_connections=True))
        self.server = serve(registry, port, address)

    def close(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
        os.environ.pop(MULTIPROC_ENV, None)
        shutil.rmtree(self.directory, ignore_errors=True)


def record_as_child() -> None:
    """In a child of ``--processes``: record into the supervisor's directory (inherited
    in ``PROMETHEUS_MULTIPROC_DIR``), and mark this process dead as it exits."""
    recorder = metrics.enable(None)
    recorder.flush_periodically()
    from prometheus_client import multiprocess

    atexit.register(multiprocess.mark_process_dead, os.getpid())
    atexit.register(recorder.flush)  # first: atexit runs the last registered first
