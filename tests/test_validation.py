"""django_txqueue.validation: the checks every entry point runs before writing anything."""

import datetime as dt
import decimal
import re
import uuid

import pytest
from django.utils import timezone

from django_txqueue.validation import (
    INT_RANGE,
    MAX_LABEL,
    MAX_QUEUE_NAME,
    check_json,
    queue_name_problem,
    to_timedelta,
    validate_int,
    validate_label,
    validate_pid,
    validate_queue_name,
    validate_run_at,
)


class TestQueueName:
    @pytest.mark.parametrize("name", ["a", "sms", "x" * MAX_QUEUE_NAME, "with space", "ü-名"])
    def test_valid(self, name):
        assert queue_name_problem(name) is None
        assert validate_queue_name(name) == name

    @pytest.mark.parametrize("name", [None, 1, b"sms", ["sms"]])
    def test_not_a_string_is_a_type_error(self, name):
        assert (
            queue_name_problem(name) == f"a queue name must be a string, not {type(name).__name__}"
        )
        with pytest.raises(TypeError, match=f"must be a string, not {type(name).__name__}"):
            validate_queue_name(name)

    def test_empty(self):
        with pytest.raises(ValueError, match="1 to 100 characters, got 0"):
            validate_queue_name("")

    def test_101_characters(self):
        assert MAX_QUEUE_NAME == 100
        with pytest.raises(ValueError, match="1 to 100 characters, got 101"):
            validate_queue_name("q" * 101)


class TestLabel:
    def test_none_and_valid(self):
        assert validate_label(None, "key") is None
        assert validate_label("k", "key") == "k"
        assert validate_label("k" * MAX_LABEL, "dedup_key") == "k" * MAX_LABEL

    @pytest.mark.parametrize("value", [1, b"k", ["k"]])
    def test_not_a_string(self, value):
        with pytest.raises(
            TypeError, match=f"dedup_key must be a string, not {type(value).__name__}"
        ):
            validate_label(value, "dedup_key")

    @pytest.mark.parametrize("value", ["", "k" * (MAX_LABEL + 1)])
    def test_length(self, value):
        with pytest.raises(ValueError, match=f"key must be 1 to 255 characters, got {len(value)}"):
            validate_label(value, "key")


class TestInt:
    def test_in_range(self):
        assert validate_int(0, "priority", *INT_RANGE) == 0
        assert validate_int(INT_RANGE[0], "priority", *INT_RANGE) == INT_RANGE[0]
        assert validate_int(INT_RANGE[1], "priority", *INT_RANGE) == INT_RANGE[1]
        assert validate_int(10**9, "max_attempts", 1) == 10**9

    @pytest.mark.parametrize("value", [True, False, 1.0, "1", None, decimal.Decimal(1)])
    def test_not_an_integer_bool_included(self, value):
        with pytest.raises(
            ValueError, match=re.escape(f"priority must be an integer, got {value!r}")
        ):
            validate_int(value, "priority", *INT_RANGE)

    @pytest.mark.parametrize("value", [INT_RANGE[0] - 1, INT_RANGE[1] + 1])
    def test_out_of_range(self, value):
        with pytest.raises(ValueError, match=f"between .* got {value}"):
            validate_int(value, "priority", *INT_RANGE)

    def test_below_the_lower_bound(self):
        with pytest.raises(ValueError, match="max_attempts must be between 1 and"):
            validate_int(0, "max_attempts", 1)


class TestPid:
    def test_valid(self):
        assert validate_pid(None) is None
        assert validate_pid("host:1:abcd") == "host:1:abcd"

    @pytest.mark.parametrize("pid", ["", "p" * 256, 7])
    def test_invalid(self, pid):
        with pytest.raises(ValueError, match="pid must be a string of 1 to 255 characters"):
            validate_pid(pid)


class TestCheckJson:
    @pytest.mark.parametrize(
        "value",
        [
            None,
            1,
            "s",
            [1, {"a": None}],
            (1, 2),
            dt.datetime(2026, 1, 1, tzinfo=dt.UTC),
            decimal.Decimal("1.5"),
            uuid.uuid4(),
        ],
    )
    def test_json_and_djangos_extras_pass(self, value):
        check_json(value, "payload")

    @pytest.mark.parametrize(
        ("value", "type_name"),
        [({1, 2}, "set"), (object(), "object"), ({"nested": [b"x"]}, "bytes")],
    )
    def test_names_the_type_in_pythons_wording(self, value, type_name):
        with pytest.raises(TypeError) as raised:
            check_json(value, "payload for queue 'q'")
        message = str(raised.value)
        assert message.startswith("payload for queue 'q': ")
        assert f"Object of type {type_name} is not JSON serializable" in message

    def test_keys_that_json_cannot_take(self):
        with pytest.raises(TypeError, match="result: keys must be"):
            check_json({(1, 2): "tuple key"}, "result")

    def test_circular_reference(self):
        loop: list[object] = []
        loop.append(loop)
        with pytest.raises(TypeError, match="result: Circular reference"):
            check_json(loop, "result")


class TestToTimedelta:
    @pytest.mark.parametrize(
        ("value", "expected"),
        [
            (0, dt.timedelta(0)),
            (1.5, dt.timedelta(seconds=1.5)),
            (3600, dt.timedelta(hours=1)),
            (dt.timedelta(minutes=2), dt.timedelta(minutes=2)),
        ],
    )
    def test_seconds_or_timedelta(self, value, expected):
        assert to_timedelta(value, "delay") == expected

    @pytest.mark.parametrize("value", [True, "5", None, decimal.Decimal(1)])
    def test_anything_else_is_a_type_error(self, value):
        with pytest.raises(TypeError, match="lease must be seconds"):
            to_timedelta(value, "lease")

    @pytest.mark.parametrize("value", [-1, -0.001, dt.timedelta(seconds=-1)])
    def test_negative(self, value):
        with pytest.raises(ValueError, match="delay must not be negative"):
            to_timedelta(value, "delay")


class TestRunAt:
    def test_aware_with_use_tz(self):
        when = timezone.now()
        assert validate_run_at(when) is when

    def test_naive_with_use_tz_is_refused(self):
        with pytest.raises(ValueError, match="naive while USE_TZ is on"):
            validate_run_at(dt.datetime(2026, 1, 1, 12, 0))

    def test_naive_without_use_tz(self, settings):
        settings.USE_TZ = False
        when = dt.datetime(2026, 1, 1, 12, 0)
        assert validate_run_at(when) is when

    def test_aware_without_use_tz_becomes_naive_local_time(self, settings):
        settings.USE_TZ = False
        settings.TIME_ZONE = "UTC"
        when = dt.datetime(2026, 1, 1, 12, 0, tzinfo=dt.timezone(dt.timedelta(hours=2)))
        assert validate_run_at(when) == dt.datetime(2026, 1, 1, 10, 0)

    @pytest.mark.parametrize("value", [dt.date(2026, 1, 1), "2026-01-01T00:00:00Z", 0])
    def test_not_a_datetime(self, value):
        with pytest.raises(
            TypeError, match=f"run_at must be a datetime, not {type(value).__name__}"
        ):
            validate_run_at(value)
