"""``rallypoint run``'s flags, declared once (``rallypoint.flags.FLAGS``): the command's options
are made from the table, its parser is pure, the checks of the machine are ``preflight``'s,
on/off is spelt one way everywhere, and ``rallypoint rendezvous status`` and ``clear`` take
its rendezvous flags as ``run`` does."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import os
from pathlib import Path
from typing import Any

import pytest
import typer.main

from rallypoint.config import LaunchConfig
from rallypoint.errors import UsageError
from rallypoint.extensions import ConfigOption
from rallypoint.flags import FLAGS, RENDEZVOUS_FLAGS, format_size, parse_flags, parse_size
from rallypoint.plugins import get_plugin_manager
from rallypoint.preflight import preflight
from rallypoint_cli.main import build_app, main

#: The words docs/user-guide.md gives for on and off.
ON = ("1", "true", "yes", "on")
OFF = ("0", "false", "no", "off")


@pytest.fixture
def script(tmp_path: Path) -> str:
    path = tmp_path / "train.py"
    path.write_text("")
    return str(path)


def run(
    args: list[str],
    env: dict[str, str],
    monkeypatch: pytest.MonkeyPatch,
    handed: list[LaunchConfig],
) -> tuple[int, str, LaunchConfig | None]:
    """``rallypoint run ARGS`` in this process with only ``env``'s launcher variables: the
    exit code, stderr and the configuration the agent was handed (None: not started);
    ``handed``: the ``handed_configs`` fixture."""
    for name in list(os.environ):
        if name.startswith(("RALLYPOINT_", "PET_", "TORCH_ELASTIC_", "CUDA_VISIBLE_DEVICES")):
            monkeypatch.delenv(name)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    before = len(handed)
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = main(["run", *args])
    return code, err.getvalue(), handed[before] if len(handed) > before else None


def test_the_options_of_run_are_the_table() -> None:
    command = typer.main.get_command(build_app(get_plugin_manager()))
    options = [p for p in command.commands["run"].params if p.param_type_name == "option"]
    assert [option.name for option in options] == [flag.dest for flag in FLAGS]
    for flag, option in zip(FLAGS, options, strict=True):
        underscored = flag.name.replace("-", "_")
        spellings = {flag.option, f"--{underscored}"} | ({flag.short} if flag.short else set())
        assert set(option.opts) == spellings, flag.name
        variables = [f"RALLYPOINT_{underscored.upper()}", f"PET_{underscored.upper()}"]
        assert option.envvar == variables
        assert option.is_flag == flag.switch and option.multiple == flag.repeated


def test_a_flag_left_out_means_the_same_to_the_cli_and_to_python(
    script: str, monkeypatch: pytest.MonkeyPatch, handed_configs: list[LaunchConfig]
) -> None:
    """One default per flag: what the command passes for a flag not given is the table's."""
    code, stderr, given = run([script], {}, monkeypatch, handed_configs)
    assert code == 0, stderr
    assert given is not None
    python = LaunchConfig.from_flags(get_plugin_manager().registry, training_script=script)
    # The run id of a one-node job is fresh every time.
    assert dataclasses.replace(given, rdzv_id="") == dataclasses.replace(python, rdzv_id="")


def test_the_parser_reads_only_the_environment_it_is_handed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "12")
    assert parse_flags({"training_script": "t.py"}, {})["shutdown_timeout"] == 30.0
    torch = {"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "12"}
    assert parse_flags({"training_script": "t.py"}, torch)["shutdown_timeout"] == 12.0
    given = {"training_script": "t.py", "shutdown_timeout": "3"}
    assert parse_flags(given, torch)["shutdown_timeout"] == 3.0  # the flag wins


def test_a_bad_torch_shutdown_timeout_is_one_line(
    script: str, monkeypatch: pytest.MonkeyPatch, handed_configs: list[LaunchConfig]
) -> None:
    code, stderr, given = run(
        [script], {"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "soon"}, monkeypatch, handed_configs
    )
    assert (code, given) == (2, None)
    assert stderr == (
        "rallypoint: error: TORCH_ELASTIC_SHUTDOWN_TIMEOUT 'soon': expected a number.\n"
    )


def test_a_name_that_is_no_flag_is_the_callers_mistake() -> None:
    with pytest.raises(TypeError, match="not flags of rallypoint run: nnode"):
        parse_flags({"nnode": "2", "training_script": "t.py"}, {})


@pytest.mark.parametrize(
    ("name", "text"),
    [
        ("max_restarts", "1.5"),
        ("max_restarts", "-1"),
        ("monitor_interval", "0"),
        ("exit_barrier_timeout", "nan"),
        ("checkpoint_memory_keep", "0"),
        ("master_port", "http"),
    ],
)
def test_numbers_are_checked_as_a_plugin_s_options_are(name: str, text: str) -> None:
    """One conversion of numbers: a flag's and a ``key=value`` option's say the same."""
    (flag,) = (flag for flag in FLAGS if flag.dest == name)
    option = ConfigOption(
        name, flag.type, minimum=flag.minimum, exclusive_minimum=flag.exclusive_minimum
    )
    with pytest.raises(ValueError) as reason:
        option.parse(text)
    with pytest.raises(UsageError) as error:
        parse_flags({"training_script": "t.py", name: text}, {})
    assert str(error.value) == f"{flag.option} {text!r}: {reason.value}."


@pytest.mark.parametrize("word", [*ON, *OFF, "ON", " Yes ", "False"])
def test_on_and_off_are_spelt_one_way(
    word: str, script: str, monkeypatch: pytest.MonkeyPatch, handed_configs: list[LaunchConfig]
) -> None:
    expected = word.strip().lower() in ON
    assert ConfigOption("tls", bool).parse(word) is expected
    flags = parse_flags({"training_script": script, "warm_start": word, "standalone": word}, {})
    assert flags["warm_start"] is flags["standalone"] is expected
    env = {"RALLYPOINT_VIRTUAL_LOCAL_RANK": word, "PET_WARM_START": word}
    code, stderr, given = run([script], env, monkeypatch, handed_configs)
    assert code == 0, stderr
    assert given is not None
    assert given.virtual_local_rank is given.warm_start is expected


@pytest.mark.parametrize("word", ["y", "n", "t", "f", "2", "maybe"])
def test_other_words_are_neither_on_nor_off(
    word: str, script: str, monkeypatch: pytest.MonkeyPatch, handed_configs: list[LaunchConfig]
) -> None:
    with pytest.raises(ValueError, match="expected true or false"):
        ConfigOption("tls", bool).parse(word)
    for flag, variable in (("--standalone", "PET_STANDALONE"), ("--warm-start", "PET_WARM_START")):
        code, stderr, given = run([script], {variable: word}, monkeypatch, handed_configs)
        assert (code, given) == (2, None)
        assert stderr == f"rallypoint: error: {flag} {word!r}: choose on or off.\n"


def test_the_checks_of_the_machine_are_preflight_s(tmp_path: Path) -> None:
    """``from_flags`` reads the flags; what this machine lacks is ``preflight``'s to refuse."""
    registry = get_plugin_manager().registry
    missing = str(tmp_path / "nope.py")

    def config(**flags: Any) -> LaunchConfig:
        return LaunchConfig.from_flags(registry, training_script=missing, **flags)

    with pytest.raises(UsageError, match=r"^--logs-specs 'nowhere': no torchrun.logs_specs"):
        preflight(config(logs_specs="nowhere"))
    with pytest.raises(UsageError, match=r"^--checkpoint-memory 100000TB: needs 100000000\.0 GB"):
        preflight(config(checkpoint_memory="100000TB"))
    with pytest.raises(UsageError, match="CUDA_VISIBLE_DEVICES='0' names 1 devices"):
        preflight(
            config(nproc_per_node="2", virtual_local_rank=True), {"CUDA_VISIBLE_DEVICES": "0"}
        )
    with pytest.raises(UsageError, match=r"^training script '.*nope\.py' does not exist\.$"):
        preflight(config(nproc_per_node="2", virtual_local_rank=True), {})
    (tmp_path / "train.py").write_text("")
    logged = config(event_log=str(tmp_path))
    with pytest.raises(UsageError, match=r"^--event-log '.*': is a directory; name a file in it"):
        preflight(dataclasses.replace(logged, training_script=str(tmp_path / "train.py")))


@pytest.mark.parametrize("text", ["4GB", "2GiB", "1500MB", "512MB", "100000TB", "1KiB", "123"])
def test_a_size_is_shown_as_it_is_read(text: str) -> None:
    assert format_size(parse_size(text, "--checkpoint-memory")) == text


# --- rallypoint rendezvous status and clear: run's rendezvous flags ---------------------------


def rendezvous(
    args: list[str], env: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> tuple[int, str, str]:
    """``rallypoint rendezvous ARGS`` in this process with only ``env``'s launcher
    variables: the exit code, stdout and stderr."""
    for name in list(os.environ):
        if name.startswith(("RALLYPOINT_", "PET_")):
            monkeypatch.delenv(name)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
        code = main(["rendezvous", *args])
    return code, out.getvalue(), err.getvalue()


@pytest.mark.parametrize("name", ["status", "clear"])
def test_the_rendezvous_commands_take_run_s_rendezvous_flags(name: str) -> None:
    """The same options as ``run``'s: names, defaults, help and variables."""
    command = typer.main.get_command(build_app(get_plugin_manager()))
    group = command.commands["rendezvous"]
    run_options = {p.name: p for p in command.commands["run"].params}
    options = {p.name: p for p in group.commands[name].params}  # type: ignore[attr-defined]
    assert [flag.dest for flag in RENDEZVOUS_FLAGS] == [
        "rdzv_backend", "rdzv_endpoint", "rdzv_id", "rdzv_conf",
    ]  # fmt: skip
    for flag in RENDEZVOUS_FLAGS:
        ours, runs = options[flag.dest], run_options[flag.dest]
        for attribute in ("opts", "envvar", "default", "help", "show_default", "required"):
            assert getattr(ours, attribute) == getattr(runs, attribute), (flag.name, attribute)
    assert options["rdzv_backend"].default == "static"


@pytest.fixture
def tcp_store() -> Any:
    """A torch TCPStore on a free loopback port, with no rendezvous in it."""
    from datetime import timedelta

    import torch.distributed as dist

    return dist.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10)
    )


def test_the_rendezvous_commands_read_the_environment_as_run_does(
    tcp_store: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    endpoint = f"127.0.0.1:{tcp_store.port}"
    env = {"PET_RDZV_ENDPOINT": endpoint, "PET_RDZV_ID": "job", "PET_RDZV_BACKEND": "c10d"}
    code, out, err = rendezvous(["status"], env, monkeypatch)
    assert (code, out, err) == (0, "run job: no rendezvous in this store\n", "")
    # RALLYPOINT_* wins over PET_*, and the command line over both.
    env["RALLYPOINT_RDZV_ID"] = "a/b"
    code, out, err = rendezvous(["status"], env, monkeypatch)
    assert code == 2 and err.startswith("rallypoint: error: --rdzv-id 'a/b': use 1 to 128")
    code, out, err = rendezvous(["status", "--rdzv-id", "other"], env, monkeypatch)
    assert (code, out) == (0, "run other: no rendezvous in this store\n")


def test_status_of_a_static_job_reads_the_store_at_its_endpoint(
    tcp_store: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``run``'s default backend: a static job's store is a TCPStore like c10d's."""
    args = ["status", "--rdzv-endpoint", f"127.0.0.1:{tcp_store.port}", "--rdzv-id", "job"]
    code, out, err = rendezvous(args, {}, monkeypatch)
    assert (code, out, err) == (0, "run job: no rendezvous in this store\n", "")


def test_status_of_a_static_job_needs_its_endpoint(monkeypatch: pytest.MonkeyPatch) -> None:
    code, out, err = rendezvous(["status", "--rdzv-id", "job"], {}, monkeypatch)
    assert (code, out) == (2, "")
    assert err == (
        "rallypoint: error: --rdzv-backend static: give --rdzv-endpoint MASTER_ADDR:MASTER_PORT "
        "of the job's node rank 0, which hosts its store, or the --rdzv-backend and "
        "--rdzv-endpoint the job was given.\n"
    )
    code, out, err = rendezvous(["status", "--rdzv-backend", "c10d"], {}, monkeypatch)
    assert (code, out) == (2, "")
    assert err == (
        "rallypoint: error: --rdzv-endpoint is required with --rdzv-backend c10d "
        "(give host:port of the job's rendezvous store).\n"
    )


def test_clear_of_a_static_job_says_there_is_nothing_to_clear(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    code, out, err = rendezvous(["clear", "--rdzv-id", "job"], {}, monkeypatch)
    assert (code, out) == (2, "")
    assert err == (
        "rallypoint: error: --rdzv-backend static: its store lives in the agent that hosts it "
        "and ends with it; there is nothing to clear.\n"
    )
