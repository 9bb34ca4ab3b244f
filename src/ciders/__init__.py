"""ciders: cloud-edge collaborative LLM fine-tuning by personalized bilevel optimization (CIDERS),
and resource-adaptive distributed bilevel optimization (RABO / RAFBO).

Layers (arrows point down only): cli -> engines -> algorithms -> core / models / tasks / eval.
See ARCHITECTURE in the docs and SPEC section numbers cited in each module.
"""

__version__ = "0.1.0"

from ciders.errors import CidersError, ConfigError  # noqa: E402

__all__ = ["CidersError", "ConfigError", "__version__"]
