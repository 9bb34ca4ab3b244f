"""Import-time notices that concern no ciders path, dropped by exact text (everything else from these loggers
passes). PEFT imports torchao whenever it is installed (requirements.txt pins it for
`federation.emulator_quantize`), and torchao then reports its CUDA kernels built for other CUDA versions and
registers enums that newer torch versions flag: four lines on every command, none about what ciders runs
(the CPU and CUDA weight-only int8 path uses none of those kernels)."""

from __future__ import annotations

import logging

_NOTICES = {"torchao": ("Failed to load ",),
            "torch.utils._pytree": ("is an Enum subclass and is now natively supported by torch.compile",)}


class _Drop(logging.Filter):
    def __init__(self, texts: tuple[str, ...]):
        super().__init__()
        self.texts = texts

    def filter(self, record: logging.LogRecord) -> bool:
        msg = str(record.msg)
        return not any(t in msg for t in self.texts)


def install() -> None:
    for name, texts in _NOTICES.items():
        log = logging.getLogger(name)
        if not any(isinstance(f, _Drop) for f in log.filters):
            log.addFilter(_Drop(texts))
