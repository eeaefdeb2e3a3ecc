"""Every flag that ``LaunchConfig.from_flags`` parses reaches the configuration: a field of
its name, or the fields ``DECIDED_FLAGS`` says are decided from it. A flag added to the
table without either fails here, and ``from_flags`` refuses it rather than drop it."""

from __future__ import annotations

import dataclasses

import pytest

import rallypoint.flags
from rallypoint.config import DECIDED_FLAGS, LaunchConfig
from rallypoint.flags import FLAGS, Flag
from rallypoint.plugins import get_plugin_manager

FIELDS = {field.name for field in dataclasses.fields(LaunchConfig)}


@pytest.mark.parametrize("flag", FLAGS, ids=lambda flag: flag.name)
def test_every_flag_reaches_a_field(flag: Flag) -> None:
    assert flag.dest in FIELDS or flag.dest in DECIDED_FLAGS, (
        f"{flag.option} reaches no field of LaunchConfig: add one named {flag.dest}, or "
        "name the fields decided from it in DECIDED_FLAGS"
    )


def test_the_decided_flags_are_flags_and_decide_fields() -> None:
    """No stale entry: each is a flag without a field of its own name, and what it decides
    is a field."""
    dests = {flag.dest for flag in FLAGS}
    for name, decided in DECIDED_FLAGS.items():
        assert name in dests, f"DECIDED_FLAGS names {name}, which is no flag"
        assert name not in FIELDS, f"{name} is a field of its own: drop it from DECIDED_FLAGS"
        assert decided and set(decided) <= FIELDS, f"{name}: {decided} are not all fields"


def test_a_flag_without_a_field_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    extra = Flag("new-knob", "A flag someone forgot to give a field.", "7", int)
    monkeypatch.setattr(rallypoint.flags, "FLAGS", (*FLAGS, extra))
    with pytest.raises(TypeError, match="reach no field of LaunchConfig: new_knob;"):
        LaunchConfig.from_flags(get_plugin_manager().registry, training_script="t.py")


def test_a_name_that_is_no_flag_is_refused() -> None:
    with pytest.raises(TypeError, match="not flags of rallypoint run: nnode"):
        LaunchConfig.from_flags(get_plugin_manager().registry, training_script="t.py", nnode="2")
