"""The conformance suite every restart policy must pass.

A policy's tests subclass ``RestartPolicyConformance`` and provide one fixture, ``policy``:
the ``RestartPolicy`` registration, as the plugin's ``register_restart_policies`` returns
it. The suite asks its ``decide`` about many failures (exit codes, signals, no failure
report, short and long attempts, every restart count around ``--max-restarts``) and
checks what rallypoint relies on:

* every answer is a ``RestartDecision``: ``restart`` a bool, ``delay`` a finite number of
  seconds, not negative, ``reason`` a string, not empty when the policy gives up;
* ``decide`` is a pure function: the same request gives the same answer, in any order, and
  it changes neither the request nor its options;
* it never restarts once ``--max-restarts`` restarts are used up (unless the ``honours_max_restarts``
  fixture says the policy promises otherwise);
* its declared ``--restart-conf`` options are well formed, and their defaults are used.

Optional fixtures: ``options`` (the ``--restart-conf`` values to test with; default: every
declared option at its default), ``honours_max_restarts`` (default ``True``) and
``deterministic_delay`` (default ``True``; ``False`` for a policy that spreads its delays
at random, like ``backoff`` with ``jitter``: then only the decision to restart must be
deterministic, and the delay must stay within ``max_delay`` when the policy declares one).

    import pytest
    from rallypoint_mypolicy import POLICY
    from rallypoint.testing.restart_policy_conformance import RestartPolicyConformance

    class TestMyPolicy(RestartPolicyConformance):
        @pytest.fixture
        def policy(self):
            return POLICY
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator, Mapping
from types import MappingProxyType
from typing import Any

import pytest

from rallypoint.events import WorkerFailure
from rallypoint.extensions import ConfigOption, RestartDecision, RestartPolicy, RestartRequest

#: Failures the policy is asked about: an ordinary crash, an exit code some policies treat
#: as fatal, a kill by signal, a worker with no exit code or message, and no report at all.
FAILURES: tuple[WorkerFailure | None, ...] = (
    WorkerFailure(local_rank=0, rank=0, pid=1001, exit_code=1, message="RuntimeError: boom"),
    WorkerFailure(local_rank=1, rank=3, pid=1002, exit_code=2, timestamp=1_700_000_000.0),
    WorkerFailure(local_rank=0, rank=7, pid=1003, exit_code=None, signal="SIGKILL"),
    WorkerFailure(local_rank=3, rank=11, pid=1004, exit_code=137, signal=None, message=""),
    None,
)

#: How long the failed attempts ran, oldest first: none recorded, crashes at start, a
#: healthy run then a crash, a long history.
UPTIMES: tuple[tuple[float, ...], ...] = (
    (),
    (0.0,),
    (0.5, 0.5, 0.5),
    (3600.0, 2.0),
    tuple(float(i % 7) * 10.0 for i in range(25)),
)


def option_defaults(policy: RestartPolicy) -> dict[str, Any]:
    """Every declared option at its default, as the command line hands them over."""
    return {option.name: option.default for option in policy.options}


class RestartPolicyConformance:
    """Subclass with a ``policy`` fixture returning the ``RestartPolicy`` to check."""

    @pytest.fixture
    def options(self, policy: RestartPolicy) -> Mapping[str, Any]:
        return option_defaults(policy)

    @pytest.fixture
    def honours_max_restarts(self) -> bool:
        return True

    @pytest.fixture
    def deterministic_delay(self) -> bool:
        return True

    def requests(self, options: Mapping[str, Any]) -> Iterator[RestartRequest]:
        """Every request the suite asks about, options read-only."""
        frozen = MappingProxyType(dict(options))
        for max_restarts, restarts_done, failure, uptimes in itertools.product(
            (0, 1, 3, 100), (0, 1, 2, 3, 5, 150), FAILURES, UPTIMES
        ):
            yield RestartRequest(
                restarts_done=restarts_done,
                max_restarts=max_restarts,
                failure=failure,
                options=frozen,
                attempt_uptimes=uptimes,
            )

    # --- the registration ---------------------------------------------------------------

    def test_registration_is_well_formed(self, policy: RestartPolicy) -> None:
        assert isinstance(policy, RestartPolicy)
        assert policy.name == policy.name.strip().lower()
        assert policy.description.strip(), "describe the policy in one line for --help"
        assert callable(policy.decide)

    def test_options_are_well_formed(self, policy: RestartPolicy) -> None:
        names = [option.name for option in policy.options]
        assert len(names) == len(set(names)), f"an option is declared twice: {names}"
        for option in policy.options:
            assert isinstance(option, ConfigOption)
            assert option.name.isidentifier(), f"{option.name!r}: use a key like max_delay"
            assert option.help, f"option {option.name!r} needs a help line"
            if option.default is not None:
                # The command line converts given values to the type; defaults must match.
                assert isinstance(option.default, option.type), (
                    f"option {option.name!r}: default {option.default!r} is not a "
                    f"{option.type.__name__}"
                )
                assert option.parse(str(option.default)) == option.default

    # --- the decisions ------------------------------------------------------------------

    def test_answers_are_restart_decisions(
        self, policy: RestartPolicy, options: Mapping[str, Any]
    ) -> None:
        for request in self.requests(options):
            decision = policy.decide(request)
            assert isinstance(decision, RestartDecision), f"{request}: got {decision!r}"
            assert isinstance(decision.restart, bool), f"{request}: restart={decision.restart!r}"
            assert isinstance(decision.delay, (int, float)), f"{request}: {decision!r}"
            assert math.isfinite(decision.delay), f"{request}: delay {decision.delay}"
            assert decision.delay >= 0, f"{request}: negative delay {decision.delay}"
            assert isinstance(decision.reason, str), f"{request}: {decision!r}"

    def test_giving_up_says_why(self, policy: RestartPolicy, options: Mapping[str, Any]) -> None:
        for request in self.requests(options):
            decision = policy.decide(request)
            if not decision.restart:
                assert decision.reason.strip(), f"{request}: gave up without a reason"

    def test_never_restarts_past_max_restarts(
        self, policy: RestartPolicy, options: Mapping[str, Any], honours_max_restarts: bool
    ) -> None:
        if not honours_max_restarts:
            pytest.skip("this policy does not promise to honour --max-restarts")
        for request in self.requests(options):
            if request.restarts_done >= request.max_restarts:
                decision = policy.decide(request)
                assert not decision.restart, (
                    f"restarted with {request.restarts_done} of {request.max_restarts} "
                    f"restarts used: {request}"
                )

    def test_same_request_same_answer(
        self, policy: RestartPolicy, options: Mapping[str, Any], deterministic_delay: bool
    ) -> None:
        """A pure function: asked twice, or after other questions, it answers the same."""
        requests = list(self.requests(options))
        first = [policy.decide(request) for request in requests]
        again = [policy.decide(request) for request in reversed(requests)][::-1]
        for request, one, two in zip(requests, first, again, strict=True):
            assert one.restart == two.restart, f"{request}: {one} then {two}"
            if deterministic_delay:
                assert one.delay == two.delay, f"{request}: {one} then {two}"

    def test_random_delays_stay_in_bounds(
        self, policy: RestartPolicy, options: Mapping[str, Any], deterministic_delay: bool
    ) -> None:
        if deterministic_delay:
            pytest.skip("delays are deterministic: checked by test_same_request_same_answer")
        limit = options.get("max_delay")
        for request in self.requests(options):
            decision = policy.decide(request)
            if limit is not None:
                assert decision.delay <= limit, f"{request}: delay {decision.delay} > {limit}"

    def test_request_and_options_are_left_alone(
        self, policy: RestartPolicy, options: Mapping[str, Any]
    ) -> None:
        """Options are handed over read-only (a write raises); the request is frozen."""
        before = dict(options)
        for request in self.requests(options):
            policy.decide(request)
            assert dict(request.options) == before
