"""Watching the queue: what the admin, the metrics, the probes and ``Queue.stats()`` read.

- ``reads``: the read model (the dashboard's numbers, the stuck page, ``Queue.stats()``);
- ``chart``: the dashboard's throughput chart;
- ``metrics``: a consumer's Prometheus counters; ``collector``: the gauges read from the
  database at scrape time; ``exposition``: ``--metrics-port``; ``views``: the metrics view;
- ``health``: the probes (``txqueue_health`` and the JSON view);
- ``tracing``: OpenTelemetry spans; ``logs``: log records' fields.
"""
