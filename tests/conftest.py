"""Hypothesis profiles: `ci` (derandomized, bounded, no deadline) is the default so a red run reproduces;
`fuzz` (many random examples) is for long runs by hand: HYPOTHESIS_PROFILE=fuzz python -m pytest tests."""

import os
import sys

from hypothesis import HealthCheck, settings

sys.path.insert(0, os.path.dirname(__file__))  # tests import reference and strategies by name

settings.register_profile(
    "ci", derandomize=True, max_examples=60, deadline=None, print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile(
    "fuzz", max_examples=2000, deadline=None, print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
