"""Hypothesis settings and strategies shared by the readers' property tests.

Which examples a run draws is a profile, named by ``DFLASH_HYPOTHESIS_PROFILE``:

- ``fixed`` (the default, what the README's test command runs): derandomized, no example
  database. Every run of a given checkout draws the same examples, so a newcomer's run never
  goes red on a draw CI never saw, and a clone never replays a find kept from an earlier run.
- ``explore``: fresh random draws, no database (a find is printed, with the blob that repeats it,
  and kept in the test as an ``@example``). `.ci/run` runs the fuzz tests once more this way.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

#: The environment variable that names the profile, and the profiles it may name.
PROFILE_ENV = "DFLASH_HYPOTHESIS_PROFILE"
DEFAULT_PROFILE = "fixed"
PROFILES: Mapping[str, settings] = {
    "fixed": settings(derandomize=True, database=None),
    "explore": settings(derandomize=False, database=None, print_blob=True),
}
for _name, _profile in PROFILES.items():
    settings.register_profile(_name, _profile)


def profile_name(environ: Mapping[str, str]) -> str:
    """The profile `environ` names (``fixed`` when it names none); ValueError (with the names
    it may take) for an unknown one."""
    name = environ.get(PROFILE_ENV, "").strip() or DEFAULT_PROFILE
    if name not in PROFILES:
        msg = (
            f"{PROFILE_ENV}={name!r} is not a hypothesis profile of these tests; set it to one "
            f"of {', '.join(PROFILES)} (or unset it: {DEFAULT_PROFILE})"
        )
        raise ValueError(msg)
    return name


#: The profile of this run, loaded on import (conftest imports this module before any test
#: module): settings objects copy the profile when they are made, FUZZ below included.
ACTIVE_PROFILE = profile_name(os.environ)
settings.load_profile(ACTIVE_PROFILE)

#: 100 examples per reader, no deadline (a reader that loads torch is slow on its first call).
FUZZ = settings(
    max_examples=100,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)

#: Any JSON value Python's json module writes, NaN/Infinity and very large integers included.
json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.integers(min_value=10**25, max_value=10**60)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=20),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=12), children, max_size=4)
    ),
    max_leaves=12,
)
