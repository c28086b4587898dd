"""Parametrise each topology class's ``run`` argument with the (case, strategy) pairs of its
matrix (``integration_cases``)."""

from integration_checks import generate


def pytest_generate_tests(metafunc):
    generate(metafunc)
