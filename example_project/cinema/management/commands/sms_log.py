"""``sms_log``: what the fake SMS provider delivered, and how its calls ended."""

import json
from dataclasses import asdict

from django.core.management.base import BaseCommand

from cinema.gateway import default_gateway


class Command(BaseCommand):
    help = "List the messages the fake SMS gateway delivered (CINEMA_SMS_GATEWAY_PATH)."

    def add_arguments(self, parser):
        parser.add_argument("--json", action="store_true", help="Messages and calls as JSON.")

    def handle(self, *args, **options):
        gateway = default_gateway()
        messages, calls = gateway.messages(), gateway.calls()
        if options["json"]:
            data = {"messages": [asdict(message) for message in messages], "calls": calls}
            self.stdout.write(json.dumps(data, indent=2))
            return
        for message in messages:
            self.stdout.write(f"{message.id}  {message.recipient}  {message.body}")
        summary = ", ".join(f"{outcome} {n}" for outcome, n in sorted(calls.items()))
        self.stdout.write(f"{len(messages)} messages delivered; calls: {summary or 'none'}.")
