"""Fixtures of the embeddings collection's tests: the queued path, and the queued path on the worker."""

from __future__ import annotations

import pytest

import probes.stats
from probes.embeddings import Embeddings


@pytest.fixture
def torch_fold(monkeypatch: pytest.MonkeyPatch) -> None:
    """The queue-and-fold path: tables the native kernel cannot track (CUDA, not float32, or no kernel
    built), which the worker thread folds on the CPU."""
    monkeypatch.setattr(probes.stats, "_fastats", None)


@pytest.fixture
def background(monkeypatch: pytest.MonkeyPatch, torch_fold: None) -> None:
    monkeypatch.setattr(Embeddings, "background", True)
