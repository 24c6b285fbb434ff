"""A Sphinx directive that prints a management command's own ``--help`` at build time.

    ```{txqueue-command} run_queue_consumer
    ```

renders ``manage.py run_queue_consumer --help`` as argparse formats it, so the reference
cannot drift from the commands: nothing is pasted by hand.
"""

from __future__ import annotations

import os
from typing import Any

from django.core.management import get_commands, load_command_class
from docutils import nodes
from sphinx.application import Sphinx
from sphinx.util.docutils import SphinxDirective

# argparse wraps to the terminal's width; a fixed one keeps the build the same everywhere.
WIDTH = "88"


class CommandHelp(SphinxDirective):
    required_arguments = 1
    has_content = False

    def run(self) -> list[nodes.Node]:
        name = self.arguments[0]
        commands = get_commands()
        if name not in commands:
            raise self.error(f"no management command {name!r} in the docs project")
        command = load_command_class(commands[name], name)
        previous = os.environ.get("COLUMNS")
        os.environ["COLUMNS"] = WIDTH
        try:
            text = command.create_parser("manage.py", name).format_help()
        finally:
            if previous is None:
                del os.environ["COLUMNS"]
            else:
                os.environ["COLUMNS"] = previous
        block = nodes.literal_block(text, text)
        block["language"] = "text"
        return [block]


def setup(app: Sphinx) -> dict[str, Any]:
    app.add_directive("txqueue-command", CommandHelp)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
