"""Helpers shared by the test modules and bench/: the test fleet, the registry, the fake Hub, projects."""
