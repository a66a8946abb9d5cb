"""Fixtures shared by the data-plane tests."""

from __future__ import annotations

import os

import pytest

import torchdata_overlord as ol
from torchdata_overlord.plane.balancing import problem as problem_mod
from _support import zigzag_bins


@pytest.fixture(scope="session", autouse=True)
def cache_in_tmp(tmp_path_factory):
    """Every cache the suite writes (sources' file-metadata journals, corpora built without a root),
    in this process and the ones it starts, goes to a session folder, never the user's home."""
    before = os.environ.get("TORCHDATA_OVERLORD_CACHE")
    os.environ["TORCHDATA_OVERLORD_CACHE"] = str(tmp_path_factory.mktemp("overlord-cache"))
    yield os.environ["TORCHDATA_OVERLORD_CACHE"]
    if before is None:
        os.environ.pop("TORCHDATA_OVERLORD_CACHE", None)
    else:
        os.environ["TORCHDATA_OVERLORD_CACHE"] = before


@pytest.fixture
def zigzag():
    """Registers ``"zigzag_test"`` (counting its calls and recording its problems) for one test."""
    calls = []

    def balancer(p: ol.BinProblem):
        calls.append(p)
        return zigzag_bins(p.costs, p.n_bins)

    ol.register_balancer("zigzag_test", balancer)
    try:
        yield calls
    finally:
        problem_mod._REGISTRY.pop("zigzag_test", None)


@pytest.fixture
def register_temp():
    """Register throwaway balancers by name; all are removed after the test."""
    names = []

    def register(name, fn):
        ol.register_balancer(name, fn)
        names.append(name)

    try:
        yield register
    finally:
        for n in names:
            problem_mod._REGISTRY.pop(n, None)
