"""The hypothesis profiles of the tests: the README's command draws the same examples on every
run, with no example database (a fresh clone never replays or keeps a random find); exploring
is asked for by name (`.ci/run`'s fuzz leg)."""

from __future__ import annotations

import pytest
from hypothesis import settings
from testkit.fuzzing import ACTIVE_PROFILE, FUZZ, PROFILE_ENV, profile_name


def test_without_the_variable_the_examples_are_fixed_and_no_database_is_kept() -> None:
    assert profile_name({}) == "fixed"
    assert profile_name({PROFILE_ENV: " "}) == "fixed"
    fixed = settings.get_profile("fixed")
    assert fixed.derandomize is True
    assert fixed.database is None


def test_explore_draws_fresh_examples_and_keeps_no_database() -> None:
    assert profile_name({PROFILE_ENV: "explore"}) == "explore"
    explore = settings.get_profile("explore")
    assert explore.derandomize is False
    assert explore.database is None
    assert explore.print_blob is True


def test_an_unknown_profile_is_refused_with_the_names_it_may_take() -> None:
    with pytest.raises(ValueError) as info:
        profile_name({PROFILE_ENV: "ci"})
    assert str(info.value) == (
        "DFLASH_HYPOTHESIS_PROFILE='ci' is not a hypothesis profile of these tests; set it to "
        "one of fixed, explore (or unset it: fixed)"
    )


def test_the_fuzz_settings_draw_as_the_active_profile_says() -> None:
    # settings objects copy the loaded profile when they are made: FUZZ is made after the load
    active = settings.get_profile(ACTIVE_PROFILE)
    assert FUZZ.derandomize is active.derandomize
    assert FUZZ.database is None
    assert settings.default.derandomize is active.derandomize
    assert settings.default.database is None
