from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def chat_format():
    from journeyman.chat.formats import ChatFormat
    from journeyman.policy.weights import DEFAULT_BASE_MODEL, resolve_base_model
    from transformers import AutoTokenizer

    return ChatFormat(AutoTokenizer.from_pretrained(resolve_base_model(DEFAULT_BASE_MODEL)))
