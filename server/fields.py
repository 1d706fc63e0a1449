"""The field policy of the request routes: one rule per top-level field, per route.

Clients move faster than this server, so a request the hosted API accepts is served unless a field asks for
something this server cannot do that would change the answer; only then is it a 400 naming the field. Each field
is one of:

* HONOURED: it does what the hosted API documents (or this server's own extension does what docs/api.md says);
* HINT: accepted and ignored, logged at debug: metadata, routing and billing hints, identities, service tiers,
  storage for later retrieval; none of them changes the tokens generated;
* DEFAULT_ONLY: accepted with the value clients send by default (or null), refused with any other, because that
  value would change the answer and the server cannot honour it (penalties, logit_bias, best_of, suffix);
* REFUSED: a known field the server never honours (it would run something the server does not have).

A field in no table is refused by name too, so a client never believes an unknown setting took effect. Each
protocol of server/protocols/ holds its table; server/docs.py publishes the same fields in /openapi.json and
writes docs/api.md's field tables with `markdown`. This module imports nothing of server/.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any, Callable

from orchestrator.errors import InvalidRequest

HONOURED, HINT, DEFAULT_ONLY, REFUSED = "honoured", "hint", "default-only", "refused"
_TITLES = {HONOURED: "honoured", HINT: "accepted and ignored (a hint)", DEFAULT_ONLY: "accepted with its default "
           "value only", REFUSED: "refused (400)"}

log = logging.getLogger("orchestrator.server")


@dataclass(frozen=True)
class Rule:
    """How one field is treated on the routes that list it.

    kind: HONOURED | HINT | DEFAULT_ONLY | REFUSED; routes: the routes that accept the field (by the route names
    of the table's module); accepts: DEFAULT_ONLY only, whether a (non-null) value is the default; note: what the
    server does with it (docs/api.md's text; for DEFAULT_ONLY the values accepted, for REFUSED why)."""

    kind: str
    routes: tuple[str, ...]
    note: str = ""
    accepts: Callable[[Any], bool] | None = None

    def __contains__(self, route: str) -> bool:  # `route in FIELDS[key]`: the field is known on that route
        return route in self.routes


def check(body: dict, table: dict[str, Rule], route: str, where: str) -> None:
    """Refuse, by name, a field `table` does not list for `route`, a REFUSED one, and a DEFAULT_ONLY one with
    another value than its default; log the HINT fields given at debug. `where`: the route's path, for the
    message. Raises InvalidRequest with `param` the field."""
    for key, value in body.items():
        rule = table.get(key)
        name = str(key)[:80]
        if rule is None or route not in rule.routes:
            raise InvalidRequest(f"unrecognized request argument supplied: {name!r} is not supported by {where}",
                                 param=name)
        if rule.kind == REFUSED and value is not None:
            raise InvalidRequest(f"'{name}' is not supported by {where}: {rule.note}", param=name)
        if rule.kind == DEFAULT_ONLY and value is not None and not rule.accepts(value):
            raise InvalidRequest(f"'{name}' is not supported with the value {json.dumps(value)[:60]}; accepted: "
                                 f"{rule.note}", param=name)
        if rule.kind == HINT and value is not None:
            log.debug("%s: %s accepted as a hint and ignored", where, name)


def markdown(table: dict[str, Rule], route: str, title: str) -> str:
    """docs/api.md's table of `route`'s fields: one row per field, in the table's order."""
    rows = [f"| {title} | policy | what the server does |", "|---|---|---|"]
    rows += [f"| `{key}` | {_TITLES[rule.kind]} | {rule.note} |" for key, rule in table.items() if route in rule]
    return "\n".join(rows)
