"""System checks for the TXQUEUE setting: each names the bad key and the valid ones."""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any

from django.conf import settings
from django.core.checks import CheckMessage, Error, Tags, Warning, register
from django.db import DatabaseError, connections

from . import conf, schedule
from .consumer import registry
from .db import dialect
from .models import Schedule
from .validation import (
    INT_RANGE,
    MAX_LABEL,
    check_json,
    cron_problem,
    parse_rate,
    queue_name_problem,
    validate_int,
    validate_label,
)


def _positive_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _rate(value: Any) -> bool:
    try:
        parse_rate(value)
    except ValueError:
        return False
    return True


# A century: beyond any real retention, and within every vendor's date arithmetic.
MAX_RETENTION = timedelta(days=36500)


def _retention(value: Any) -> bool:
    if _positive_number(value):
        return bool(value <= MAX_RETENTION.total_seconds())
    if isinstance(value, timedelta):
        return timedelta(0) < value <= MAX_RETENTION
    return value is None


def _database(value: Any) -> bool:
    return value is None or value in settings.DATABASES


def _flag(value: Any) -> bool:
    return isinstance(value, bool)


def _aliases(value: Any) -> bool:
    return isinstance(value, dict) and all(
        isinstance(alias, str) and alias in settings.DATABASES
        for pair in value.items()
        for alias in pair
    )


VALUE_RULES: dict[str, tuple[Callable[[Any], bool], str]] = {
    "DATABASE": (_database, "None or an alias in settings.DATABASES"),
    "LEASE": (_positive_number, "a positive number of seconds"),
    "MAX_ATTEMPTS": (_positive_int, "a positive integer"),
    "RETRY_DELAY": (_positive_number, "a positive number of seconds"),
    "MAX_SNOOZES": (
        lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 0,
        "an integer >= 0",
    ),
    "RETRY_MAX_DELAY": (_positive_number, "a positive number of seconds"),
    "CLAIM_STRATEGY": (lambda v: v in conf.STRATEGIES, f"one of {', '.join(conf.STRATEGIES)}"),
    "CONSUMER_TIMEOUT": (_positive_number, "a positive number of seconds"),
    "QUEUES": (lambda v: isinstance(v, dict), "a dict of queue name to overrides"),
    "HEARTBEAT_INTERVAL": (_positive_number, "a positive number of seconds"),
    "RESCUE_INTERVAL": (_positive_number, "a positive number of seconds"),
    "PURGE_INTERVAL": (_positive_number, "a positive number of seconds"),
    "RETENTION": (_retention, "None, or seconds or a timedelta, positive and at most 36500 days"),
    "POLL_INTERVAL": (_positive_number, "a positive number of seconds"),
    "SHUTDOWN_TIMEOUT": (_positive_number, "a positive number of seconds"),
    "LOCAL_WAKEUP": (_flag, "True or False"),
    "LISTEN_DATABASES": (
        _aliases,
        "a dict of database alias to database alias, both in settings.DATABASES",
    ),
    "SCHEDULE": (lambda v: isinstance(v, dict), "a dict of entry name to its options"),
    "METRICS_TOKEN": (lambda v: v is None or isinstance(v, str), "None or a string"),
    "RESCUE": (lambda v: v in (None, "retry", "fail"), "None, 'retry' or 'fail'"),
    "TIMEOUT": (lambda v: v is None or _positive_number(v), "None or a positive number"),
    "MAX_SIZE": (lambda v: v is None or _positive_int(v), "None or a positive integer"),
    "FAIR": (_flag, "True or False"),
    "ORDERED": (_flag, "True or False"),
    "MAX_IN_FLIGHT": (lambda v: v is None or _positive_int(v), "None or a positive integer"),
    "MAX_IN_FLIGHT_PER_KEY": (
        lambda v: v is None or _positive_int(v),
        "None or a positive integer",
    ),
    "RATE_LIMIT": (lambda v: v is None or _rate(v), "None or a rate such as '50/s', '10/m'"),
    "RATE_LIMIT_PER_KEY": (
        lambda v: v is None or _rate(v),
        "None or a rate such as '50/s', '10/m'",
    ),
}


def _check_value(path: str, key: str, value: Any) -> list[CheckMessage]:
    rule, expected = VALUE_RULES[key]
    if rule(value):
        return []
    return [Error(f"{path} is {value!r}; it must be {expected}.", id="txqueue.E003")]


@register()
def check_settings(**kwargs: Any) -> list[CheckMessage]:
    raw = getattr(settings, "TXQUEUE", {})
    if not isinstance(raw, dict):
        return [Error(f"TXQUEUE must be a dict, not {type(raw).__name__}.", id="txqueue.E001")]
    errors: list[CheckMessage] = []
    for key, value in raw.items():
        if key not in conf.DEFAULTS:
            errors.append(
                Error(
                    f"TXQUEUE has an unknown key {key!r}.",
                    hint=f"Valid keys: {', '.join(sorted(conf.DEFAULTS))}.",
                    id="txqueue.E002",
                )
            )
        else:
            errors += _check_value(f"TXQUEUE[{key!r}]", key, value)
    queues = raw.get("QUEUES", {})
    if isinstance(queues, dict):
        for name, options in queues.items():
            errors += _check_queue(name, options)
    entries = raw.get("SCHEDULE", {})
    if isinstance(entries, dict):
        for name, options in entries.items():
            errors += _check_schedule_entry(name, options)
    return errors


def _check_queue(name: Any, options: Any) -> list[CheckMessage]:
    path = f"TXQUEUE['QUEUES'][{name!r}]"
    problem = queue_name_problem(name)
    if problem is not None:
        return [Error(f"{path}: {problem}.", id="txqueue.E004")]
    if not isinstance(options, dict):
        return [Error(f"{path} must be a dict of overrides.", id="txqueue.E004")]
    errors: list[CheckMessage] = []
    for key, value in options.items():
        upper = str(key).upper()
        if upper not in conf.QUEUE_KEYS:
            errors.append(
                Error(
                    f"{path} has an unknown key {key!r}.",
                    hint=f"Valid keys: {', '.join(sorted(conf.QUEUE_KEYS))}.",
                    id="txqueue.E005",
                )
            )
            continue
        errors += _check_value(f"{path}[{key!r}]", upper, value)
    upper_options = {str(key).upper(): value for key, value in options.items()}
    if upper_options.get("ORDERED") is True and upper_options.get("MAX_IN_FLIGHT_PER_KEY") not in (
        None,
        1,
    ):
        errors.append(
            Error(
                f"{path} is ORDERED, which runs one item per key at a time, and sets "
                f"MAX_IN_FLIGHT_PER_KEY to {upper_options['MAX_IN_FLIGHT_PER_KEY']!r}.",
                hint="Leave MAX_IN_FLIGHT_PER_KEY out (or 1), or ORDERED off.",
                id="txqueue.E006",
            )
        )
    return errors


# -- TXQUEUE["SCHEDULE"] (docs/control.md: Periodic items) -----------------------------


def _check_schedule_entry(name: Any, options: Any) -> list[CheckMessage]:
    """An entry's keys (E007), its timing (E008), its queue and item (E009), its task
    (E010); each message names the entry."""
    path = f"TXQUEUE['SCHEDULE'][{name!r}]"
    if not isinstance(name, str) or not 1 <= len(name) <= MAX_LABEL:
        problem = f"{path}: an entry's name is 1 to {MAX_LABEL} characters."
        return [Error(problem, id="txqueue.E007")]
    if not isinstance(options, dict):
        return [Error(f"{path} must be a dict of options.", id="txqueue.E007")]
    unknown = [key for key in options if str(key).upper() not in schedule.KEYS]
    if unknown:
        return [
            Error(
                f"{path} has an unknown key {key!r}.",
                hint=f"Valid keys: {', '.join(schedule.KEYS)}.",
                id="txqueue.E007",
            )
            for key in unknown
        ]
    upper = {str(key).upper(): value for key, value in options.items()}
    problems = [
        Error(f"{path}: {problem}.", id=code)
        for code, found in (
            ("txqueue.E008", _schedule_timing_problems(upper)),
            ("txqueue.E008", _schedule_catch_up_problems(upper)),
            ("txqueue.E009", _schedule_item_problems(upper)),
            ("txqueue.E010", schedule_task_problems(upper)),
        )
        for problem in found
    ]
    return list(problems)


def _schedule_timing_problems(options: dict[str, Any]) -> list[str]:
    if ("CRON" in options) == ("EVERY" in options):
        return ["give CRON (a cron expression) or EVERY (seconds), one of them"]
    if "CRON" in options:
        problem = cron_problem(options["CRON"])
        return [f"CRON {problem}"] if problem else []
    if not _positive_int(options["EVERY"]):
        return [f"EVERY is {options['EVERY']!r}; it must be a positive whole number of seconds"]
    return []


def _schedule_catch_up_problems(options: dict[str, Any]) -> list[str]:
    choices = Schedule.CatchUp.values
    if options.get("CATCH_UP", choices[0]) in choices:
        return []
    return [
        f"CATCH_UP is {options['CATCH_UP']!r}; it must be one of {', '.join(map(repr, choices))}"
    ]


def _schedule_item_problems(options: dict[str, Any]) -> list[str]:
    if "TASK" in options:
        given = [key for key in ("QUEUE", "PAYLOAD", "PRIORITY", "KEY") if key in options]
        return [
            f"{key} does not go with TASK (a task has its own queue, arguments and priority: "
            "set them on the task, and its ARGS and KWARGS here)"
            for key in given
        ]
    if "QUEUE" not in options:
        return ["give QUEUE (a queue name, with an optional PAYLOAD) or TASK (a task's path)"]
    problems = [key + " goes with TASK only" for key in ("ARGS", "KWARGS") if key in options]
    if (problem := queue_name_problem(options["QUEUE"])) is not None:
        problems.append(f"QUEUE: {problem}")
    # What enqueue would refuse, in enqueue's own words.
    for check in (
        lambda: validate_int(options.get("PRIORITY", 0), "PRIORITY", *INT_RANGE),
        lambda: validate_label(options.get("KEY"), "KEY"),
        lambda: check_json(options.get("PAYLOAD"), "PAYLOAD"),
    ):
        try:
            check()
        except (TypeError, ValueError) as exc:
            problems.append(str(exc))
    return problems


def schedule_task_problems(options: dict[str, Any]) -> list[str]:
    if "TASK" not in options:
        return []
    from .tasks.backend import TxQueueBackend  # only then: it imports the Tasks framework

    path = options["TASK"]
    try:
        task = schedule.Entry.of("", options).load_task()
        backend = task.get_backend()
    except Exception as exc:  # an import of the user's module, whatever it raises
        return [f"TASK {path!r} is not a Django Task: {exc}"]
    problems = []
    if not isinstance(backend, TxQueueBackend):
        problems.append(
            f"TASK {path!r} goes to TASKS[{task.backend!r}], which is not a TxQueueBackend"
        )
    if not isinstance(options.get("ARGS", []), (list, tuple)):
        problems.append("ARGS must be a list")
    if not isinstance(options.get("KWARGS", {}), dict):
        problems.append("KWARGS must be a dict")
    try:
        check_json([options.get("ARGS"), options.get("KWARGS")], "ARGS and KWARGS")
    except TypeError as exc:
        problems.append(str(exc))
    return problems


@register()
def check_sqlite_transactions(**kwargs: Any) -> list[CheckMessage]:
    """SQLite transactions that read before they write fail at once when another
    process writes ("database is locked"): IMMEDIATE transactions wait their turn."""
    alias = conf.get("DATABASE") or "default"
    if alias not in settings.DATABASES:
        return []
    connection = connections[alias]
    if not hasattr(connection, "transaction_modes"):  # only SQLite has the option
        return []
    mode = str(connection.settings_dict["OPTIONS"].get("transaction_mode")).upper()
    if mode == "IMMEDIATE":
        return []
    return [
        Warning(
            f"DATABASES[{alias!r}] is SQLite with transaction_mode {mode!r}; consumers and "
            "producers in several processes can then fail with 'database is locked'.",
            hint=f"Set DATABASES[{alias!r}]['OPTIONS'] = "
            "{'transaction_mode': 'IMMEDIATE', 'timeout': 20}.",
            id="txqueue.W002",
        )
    ]


@register(Tags.database)
def check_galera_strategy(databases: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """On a Galera cluster every node's consumers claim from the same head of the queue;
    update_limit claims, which lock every row they read, were refused there three to
    four times as often as skip_locked ones (docs/scaling.md). Both stay correct."""
    if conf.get("CLAIM_STRATEGY") != "update_limit":
        return []
    warnings: list[CheckMessage] = []
    for alias in databases or []:
        connection = connections[alias]
        try:
            galera = dialect(connection).is_galera(connection)
        except DatabaseError:  # not a database the queue runs on, or unreachable now
            continue
        if galera:
            warnings.append(
                Warning(
                    f"TXQUEUE['CLAIM_STRATEGY'] is 'update_limit' and DATABASES[{alias!r}] "
                    "is a Galera cluster node, where its claims conflict with other "
                    "nodes' several times as often as 'skip_locked' ones.",
                    hint="Use 'auto' (skip_locked on MariaDB 10.6+).",
                    id="txqueue.W003",
                )
            )
    return warnings


# -- TXQUEUE["METRICS_TOKEN"] (docs/metrics.md) ------------------------------------------

# Shorter than this, a token could be guessed: secrets.token_urlsafe(32) gives 43 characters.
MIN_TOKEN_LENGTH = 32


@register()
def check_metrics_token(**kwargs: Any) -> list[CheckMessage]:
    token = conf.user_settings().get("METRICS_TOKEN")
    if not isinstance(token, str) or len(token) >= MIN_TOKEN_LENGTH:
        return []  # None, or a type E003 reports
    return [
        Error(
            f"TXQUEUE['METRICS_TOKEN'] is {len(token)} characters long; a bearer token must "
            f"have at least {MIN_TOKEN_LENGTH}.",
            hint="Make one with: python -c 'import secrets; print(secrets.token_urlsafe(32))'",
            id="txqueue.E011",
        )
    ]


# -- queues with no handler ------------------------------------------------------------


@register()
def check_handlers(**kwargs: Any) -> list[CheckMessage]:
    """A queue that TXQUEUE["QUEUES"] or a SCHEDULE entry names and no handler serves: its
    items wait READY for ever. Said here, not by ``enqueue``: producers run in processes
    that never import the handlers (the web server), so only the handlers' own discovery,
    which the consumer runs too, can tell."""
    raw = getattr(settings, "TXQUEUE", {})
    named = _named_queues(raw) if isinstance(raw, dict) else {}
    if not named:
        return []
    registry.autodiscover()
    if registry.takes_any_queue():  # a TxQueueBackend with QUEUES = [] may serve any name
        return []
    known = registry.handlers()
    return [
        Warning(
            f"{path} names queue {queue!r}, which has no handler: its items would wait "
            "READY, taken by no consumer.",
            hint=f"Register one with @handler({queue!r}) in a queues.py module of an "
            "installed app, or list the queue in a TxQueueBackend's QUEUES. If another "
            "project consumes it, add 'txqueue.W004' to SILENCED_SYSTEM_CHECKS.",
            id="txqueue.W004",
        )
        for path, queue in named.items()
        if queue not in known
    ]


def _named_queues(raw: dict[str, Any]) -> dict[str, str]:
    """Setting path to the valid queue name it gives (the others are E004's and E009's)."""
    named: dict[str, str] = {}
    queues = raw.get("QUEUES", {})
    for name in queues if isinstance(queues, dict) else ():
        named[f"TXQUEUE['QUEUES'][{name!r}]"] = name
    entries = raw.get("SCHEDULE", {})
    for name, options in entries.items() if isinstance(entries, dict) else ():
        upper = (
            {str(k).upper(): v for k, v in options.items()} if isinstance(options, dict) else {}
        )
        if "QUEUE" in upper and "TASK" not in upper:
            named[f"TXQUEUE['SCHEDULE'][{name!r}]"] = upper["QUEUE"]
    return {path: queue for path, queue in named.items() if queue_name_problem(queue) is None}
