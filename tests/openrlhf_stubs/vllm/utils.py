"""TEST-ONLY stand-in (see tests/openrlhf_stubs/README.md)."""

import uuid


def random_uuid() -> str:
    return uuid.uuid4().hex
