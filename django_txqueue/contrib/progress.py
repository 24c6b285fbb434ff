"""The live progress line of a tool's run (``txqueue_bench``, ``txqueue_chaos``).

Progress goes to stderr (one line rewritten in place on a terminal, plain lines
otherwise, nothing with ``--json``), so stdout holds only the result.
"""

from __future__ import annotations

import time
from typing import TextIO


class Progress:
    def __init__(self, stream: TextIO | None) -> None:
        self.stream = stream
        self.live = bool(stream is not None and stream.isatty())
        self.began = time.monotonic()
        self._width = 0

    def phase(self, text: str) -> None:
        """A new step: rewritten in place on a terminal, a line of its own otherwise."""
        if self.stream is None:
            return
        if self.live:
            self.tick(text)
        else:
            self.stream.write(f"[{time.monotonic() - self.began:6.1f} s] {text}\n")
            self.stream.flush()

    def tick(self, text: str) -> None:
        """A passing update within a step: shown on a terminal only."""
        if not self.live or self.stream is None:
            return
        line = f"[{time.monotonic() - self.began:6.1f} s] {text}"
        self.stream.write("\r" + line.ljust(self._width))
        self.stream.flush()
        self._width = len(line)

    def close(self) -> None:
        if self.live and self.stream is not None and self._width:
            self.stream.write("\r" + " " * self._width + "\r")
            self.stream.flush()
