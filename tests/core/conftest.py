"""Hypothesis profiles for the core tests.

``--hypothesis-profile=no-shrink`` reports the first failing example without
minimising it (useful when checking that the property tests catch a planted bug).
"""

from hypothesis import Phase, settings

settings.register_profile("no-shrink", phases=[Phase.explicit, Phase.reuse, Phase.generate])
