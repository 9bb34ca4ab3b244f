"""`ciders._quiet`: torchao's import-time notices (kernels for other CUDA versions, torch.compile enum notices) are
dropped by their exact text; any other record from the same loggers still passes."""

import logging

import ciders  # noqa: F401  (installs the filters)


def test_the_known_notices_are_dropped_and_nothing_else(caplog):
    with caplog.at_level(logging.DEBUG):
        logging.getLogger("torchao").warning("Failed to load /x/_C_mxfp8.so: Could not load this library")
        logging.getLogger("torch.utils._pytree").warning(
            "<enum 'KernelPreference'> is an Enum subclass and is now natively supported by torch.compile as an opaque")
        logging.getLogger("torchao").warning("a real torchao warning")
        logging.getLogger("torch.utils._pytree").warning("another pytree warning")
    assert [r.getMessage() for r in caplog.records] == ["a real torchao warning", "another pytree warning"]
