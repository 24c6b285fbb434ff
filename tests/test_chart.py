"""django_txqueue.observe.chart: the dashboard's throughput chart, a bar per minute."""

import datetime as dt
import re

from django_txqueue.observe.chart import HEIGHT, throughput_chart
from django_txqueue.observe.reads import Minute


class TestThroughputChart:
    START = dt.datetime(2030, 1, 2, 3, 0, tzinfo=dt.UTC)

    def minutes(self, *counts):
        return [
            Minute(self.START + dt.timedelta(minutes=n), done, failed)
            for n, (done, failed) in enumerate(counts)
        ]

    def test_a_bar_per_minute_scaled_to_the_busiest_with_its_numbers(self):
        svg = str(throughput_chart(self.minutes((4, 0), (1, 1), (0, 0))))
        titles = re.findall(r"<title>(.*?)</title>", svg)
        assert titles == [
            "03:00 UTC: 4 done, 0 failed",
            "03:01 UTC: 1 done, 1 failed",
            "03:02 UTC: 0 done, 0 failed",
        ]
        heights = [float(h) for h in re.findall(r'height="([\d.]+)" fill', svg)]
        # done then failed, per bar: the busiest minute fills the chart.
        assert heights == [HEIGHT, 0.0, HEIGHT / 4, HEIGHT / 4, 0.0, 0.0]
        assert (
            'aria-label="Throughput, last 3 minutes: 5 done, 1 failed; busiest minute 4."' in svg
        )

    def test_an_idle_hour_draws_empty_bars(self):
        svg = str(throughput_chart(self.minutes(*[(0, 0)] * 60)))
        assert svg.count("<g>") == 60
        assert set(re.findall(r'height="([\d.]+)" fill', svg)) == {"0.0"}
        assert "0 done, 0 failed; busiest minute 0." in svg
