"""Claimed rows into model instances, at a consumer's rate.

``ClaimStatement.fetch`` loads each row through ``Model.from_db``, that is
``Model.__init__``: a ``setattr`` per field and the ``pre_init`` / ``post_init``
signals, for every item of every claim. ``Claim`` builds the same instance directly
(every column converted as Django converts it, each value stored where ``__init__``
stores it, the same ``_state``) whenever nothing could tell the two apart: no receiver
of those signals for the model, no ``from_db`` or ``__init__`` of its own, no field that
intercepts assignment. Otherwise it falls back to ``from_db``.
"""

from __future__ import annotations

from functools import cached_property
from typing import Any

from django.db.models import Model
from django.db.models.base import ModelState
from django.db.models.signals import post_init, pre_init

from ..signals import heard
from .compiler import ClaimStatement


class Claim(ClaimStatement):
    def fetch(self, sql: str, params: list[Any]) -> list[Any]:
        model = self.model
        if not self.plain or heard(pre_init, model) or heard(post_init, model):
            return super().fetch(sql, params)
        connection = self.connection
        with connection.cursor() as cursor:
            cursor.execute(sql, params)
            rows = cursor.fetchall()
        converters = self.converters(connection)
        fields, names, alias = self.fields, self.attnames, self.alias
        new = object.__new__
        items = []
        for row in rows:
            values = list(row)
            for index, functions in converters:
                for convert in functions:
                    values[index] = convert(values[index], fields[index], connection)
            state = ModelState()
            state.adding, state.db = False, alias
            item = new(model)
            item.__dict__ = {"_state": state}  # first, as in Model.__init__
            item.__dict__.update(zip(names, values, strict=True))
            items.append(item)
        return items

    @cached_property
    def attnames(self) -> list[str]:
        return [field.attname for field in self.fields]

    @cached_property
    def plain(self) -> bool:
        """Whether ``Model.from_db`` comes to storing each value in ``__dict__``."""
        model = self.model
        return (
            model.from_db.__func__ is Model.from_db.__func__  # type: ignore[attr-defined]
            and model.__init__ is Model.__init__
            and len(self.fields) == len(model._meta.concrete_fields)
            and not any(hasattr(getattr(model, name, None), "__set__") for name in self.attnames)
        )
