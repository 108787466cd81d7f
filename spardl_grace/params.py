"""Declarative parameters: each key of grace_from_params with its default, what it accepts
and what it means, in one row. The registry validates from these rows, the training CLI
and the tests enumerate them, and the docs' parameter table is generated from them."""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass
from typing import Any


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


#: (check, rule): a predicate on a value and what it accepts, in words
Rule = tuple[Callable[[Any], bool], str]


def int_at_least(low: int) -> Rule:
    """(check, rule) for an int >= low."""
    return (lambda v: _int(v) and v >= low), f"an int >= {low}"


def number_above(low: float) -> Rule:
    """(check, rule) for a number > low."""
    return (lambda v: _number(v) and v > low), f"a number > {low}"


def number_at_least(low: float) -> Rule:
    """(check, rule) for a number >= low."""
    return (lambda v: _number(v) and v >= low), f"a number >= {low}"


def fraction(low_open: bool) -> Rule:
    """(check, rule) for a number in (0, 1] (low_open) or in [0, 1)."""
    if low_open:
        return (lambda v: _number(v) and 0 < v <= 1), "a number in (0, 1]"
    return (lambda v: _number(v) and 0 <= v < 1), "a number in [0, 1)"


def an_int() -> Rule:
    """(check, rule) for any int (not a bool)."""
    return _int, "an int"


def boolean() -> Rule:
    """(check, rule) for True or False."""
    return (lambda v: isinstance(v, bool)), "True or False"


def optional(rule: Rule) -> Rule:
    """(check, rule) for None (off) or what `rule` accepts."""
    check, words = rule
    return (lambda v: v is None or check(v)), f"None (off) or {words}"


@dataclass(frozen=True)
class Param:
    """One key: its `default`, what it means (`doc`), and what it accepts: either one of
    `choices` (named `kind` in errors), or a value for which `check` holds, described by
    `rule` ('an int >= 1'). `default_doc` replaces the default in the docs where it depends
    on other keys."""

    key: str
    default: Any
    doc: str
    check: Callable[[Any], bool] | None = None
    rule: str = ""
    choices: Collection[Any] | None = None
    kind: str = ""
    default_doc: str | None = None

    def validate(self, value: Any) -> None:
        """ValueError naming the key, the value and what is valid, unless `value` is valid."""
        if self.choices is not None:
            if value not in self.choices:
                valid = ", ".join(sorted(str(c) for c in self.choices))
                raise ValueError(
                    f"unknown {self.kind or self.key} {value!r}; valid choices: {valid}"
                )
        elif self.check is not None and not self.check(value):
            raise ValueError(f"{self.key} must be {self.rule}, got {value!r}")

    def accepts(self) -> str:
        """What the key accepts, in words (for the docs)."""
        if self.choices is not None:
            return ", ".join(str(c) for c in self.choices)
        return self.rule


def ranged(key: str, default: Any, doc: str, check_rule: Rule, **more: Any) -> Param:
    """A Param whose check and rule come as a pair (int_at_least, number_above)."""
    check, rule = check_rule
    return Param(key, default, doc, check=check, rule=rule, **more)


def markdown_table(params: Iterable[Param]) -> str:
    """The rows as a markdown table: key, default, what it accepts, meaning."""
    lines = ["| key | default | accepts | meaning |", "|---|---|---|---|"]
    for p in params:
        default = p.default_doc if p.default_doc is not None else repr(p.default)
        lines.append(f"| {p.key} | {default} | {p.accepts()} | {p.doc} |")
    return "\n".join(lines)
