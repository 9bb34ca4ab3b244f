"""ciders: cloud-edge collaborative LLM fine-tuning by personalized bilevel optimization (CIDERS),
and resource-adaptive distributed bilevel optimization (RABO / RAFBO).

Layers (imports point down only): docs/architecture.md#layers. The equations, each with the function that
implements it: docs/method.md (CIDERS) and docs/rabo.md#the-equations (RABO family); module docstrings cite them.
"""

__version__ = "0.1.0"

from ciders import _quiet  # noqa: E402
from ciders.errors import CidersError, ConfigError  # noqa: E402

_quiet.install()

__all__ = ["CidersError", "ConfigError", "__version__"]
