"""The old name of `journeyman.integrations` (the seam integration packages import from core).

"Adapter" now means LoRA weights only; the framework packages are integrations. Kept so that code
written against `journeyman.adapters` runs unchanged: every name is looked up in the new module.
"""

from __future__ import annotations

from typing import Any

import journeyman.integrations as _integrations
from journeyman.integrations import __all__ as __all__


def __getattr__(name: str) -> Any:
    return getattr(_integrations, name)
