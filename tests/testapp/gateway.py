"""A fake SMS provider for the tests of ``once``: each delivery is a line appended to
the file named by TXQUEUE_TEST_GATEWAY, outside every database transaction, as a real
provider's would be: a rollback does not take a message back."""

import json
import os


def send(to, text):
    with open(os.environ["TXQUEUE_TEST_GATEWAY"], "a") as log:
        log.write(json.dumps({"to": to, "text": text, "pid": os.getpid()}) + "\n")


def delivered():
    """Every message delivered so far."""
    try:
        with open(os.environ["TXQUEUE_TEST_GATEWAY"]) as log:
            return [json.loads(line) for line in log]
    except FileNotFoundError:
        return []
