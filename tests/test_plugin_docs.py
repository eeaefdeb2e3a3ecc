"""What the plugin pages say of rallypoint's own names and output stays true: every
``rallypoint.X`` they name can be imported, the registration dataclasses are in
``rallypoint.sdk`` as the page says, an error in a sample traceback is named as Python
names it, and ``rallypoint plugins``' sample output is the real one."""

from __future__ import annotations

import importlib
import json
import re
from pathlib import Path

import pytest

from launch import rallypoint
from rallypoint import sdk

DOCS = Path(__file__).parent.parent / "docs"
#: The pages a plugin author reads (a plugin imports ``rallypoint.sdk`` only).
PAGES = [*sorted((DOCS / "plugins").glob("*.md")), DOCS / "checkpoint-storage.md"]
#: And where a training script's errors are shown (it imports ``rallypoint.checkpoint``).
TRACEBACKS = [*PAGES, DOCS / "checkpointing.md"]
NAMED = re.compile(r"`(rallypoint(?:\.[A-Za-z_]\w*)+)")
#: ``rallypoint.interfaces.CheckpointError: ...`` as the last line of a traceback.
RAISED = re.compile(r"^\s*(rallypoint(?:\.\w+)+): ", re.MULTILINE)


def resolve(dotted: str) -> object:
    """The module or attribute ``dotted`` names: the longest importable module, then
    attributes; raises if neither."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            found: object = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for attribute in parts[cut:]:
            found = getattr(found, attribute)
        return found
    raise ModuleNotFoundError(dotted)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_rallypoint_name_of_a_plugin_page_exists(page: Path) -> None:
    text = page.read_text()
    for dotted in sorted(set(NAMED.findall(text))):
        try:
            resolve(dotted)
        except (ImportError, AttributeError) as error:
            pytest.fail(f"{page.name} names `{dotted}`, which does not exist ({error})")
        module, _, name = dotted.rpartition(".")
        if module == "rallypoint.sdk":
            assert name in sdk.__all__, f"{page.name}: `{dotted}` is not exported by rallypoint.sdk"
        elif name in sdk.__all__:
            # A plugin imports rallypoint.sdk only (import-linter holds it to that): a page
            # that names the module a name comes from sends the author to the wrong one.
            pytest.fail(f"{page.name} names `{dotted}`: call it `rallypoint.sdk.{name}`")


@pytest.mark.parametrize("page", TRACEBACKS, ids=lambda p: p.name)
def test_a_sample_traceback_names_the_error_as_python_does(page: Path) -> None:
    for dotted in RAISED.findall(page.read_text()):
        error = resolve(dotted)
        assert isinstance(error, type), dotted
        assert f"{error.__module__}.{error.__qualname__}" == dotted, (
            f"{page.name}: a traceback would say {error.__module__}.{error.__qualname__}, "
            f"the page says {dotted}"
        )


def test_the_registration_dataclasses_are_in_the_sdk() -> None:
    text = (DOCS / "plugins" / "writing.md").read_text()
    assert "All are frozen dataclasses in `rallypoint.sdk`." in text
    section = text.split("## The registration dataclasses", 1)[1]
    table = "\n".join(line for line in section.splitlines() if line.startswith("| `register_"))
    names = re.findall(r"^\| `register_\w+` \| `(\w+)` \|", table, re.MULTILINE)
    assert len(names) == 5, table
    for name in names:
        assert name in sdk.__all__, name
        fields = set(getattr(sdk, name).__dataclass_fields__)
        row = next(line for line in table.splitlines() if f"| `{name}` |" in line)
        documented = set(re.findall(r"`(\w+)`", row.split("|")[3]))
        assert fields <= documented, f"{name}'s row leaves out {sorted(fields - documented)}"


def test_the_sample_output_of_rallypoint_plugins_is_the_real_one() -> None:
    text = (DOCS / "plugins" / "installing.md").read_text()
    shown = text.split("$ rallypoint plugins\n", 1)[1].split("```", 1)[0]
    real = rallypoint("plugins")
    assert real.returncode == 0, real.stderr
    assert shown == real.stdout, "docs/plugins/installing.md shows another output"
    sample = json.loads(text.split("```json\n", 1)[1].split("```", 1)[0])
    data = json.loads(rallypoint("plugins", "--json").stdout)
    assert sample == {
        "available": data["available"],
        "conflicts": data["conflicts"],
        "plugins": data["plugins"][:1],
    }
