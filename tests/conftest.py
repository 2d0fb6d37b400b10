"""Shared fixtures. Model folders: `tokenizer_dir`, `tiny_pair`, `real_pair`."""

from __future__ import annotations

import os

import pytest

pytest_plugins = ["serve_fixtures"]  # Ray / Serve fixtures live in tests/serve_fixtures.py


# ---- model folders ----------------------------------------------------------------------------


@pytest.fixture(scope="session")
def tokenizer_dir():
    """A folder with the default pair's real tokenizer (downloads the draft on first use)."""
    from specdec.model_pair import ensure_tokenizer

    return ensure_tokenizer()


@pytest.fixture(scope="session")
def tiny_pair(tmp_path_factory, tokenizer_dir):
    """(draft_dir, target_dir): tiny random Qwen2 models (fp32 weights) with the real
    tokenizer; the draft is the target with perturbed weights (argmax agreement ~0.7)."""
    from specdec.tiny import make_tiny_pair

    return make_tiny_pair(tmp_path_factory.mktemp("tiny"), tokenizer_dir)


@pytest.fixture(scope="session")
def real_pair():
    """(draft_dir, target_dir) of the default Qwen2.5-Coder pair, set up on first use."""
    if os.environ.get("SPECDEC_SKIP_REAL") == "1":
        pytest.skip("SPECDEC_SKIP_REAL=1: tests on the real Qwen2.5-Coder pair are skipped")
    from specdec.model_pair import ensure_default_pair

    return ensure_default_pair()
