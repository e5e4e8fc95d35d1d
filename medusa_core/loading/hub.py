"""Where a model or heads source lives: a local directory, or a Hugging Face hub repo.

Hub files go through huggingface_hub (its cache, progress bars, HF_HUB_OFFLINE and
token handling); every failure becomes one LoadError line that says how to get
the files, never a stack trace.
"""

from __future__ import annotations

import os
import re
import socket
import time
from collections.abc import Sequence
from pathlib import Path
from urllib.parse import urlsplit

from ..errors import LoadError, first_line

# owner/name as the hub spells repo ids; anything else that does not exist locally is a bad path
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.\-]*/[\w.\-]+$")


def looks_like_hub_id(source: str) -> bool:
    return bool(_REPO_ID.match(source))         # owner/name: never a path from ".", "/" or "~"


def local_dir(source: str, holds: str = "config.json and weights") -> Path | None:
    """The directory ``source`` names, None when it is a hub repo id; LoadError when it is neither. ``holds``: what
    such a directory holds, said where ``source`` is a file."""
    path = Path(source).expanduser()
    if path.is_dir():
        return path
    if path.exists():
        raise LoadError(f"{source} is a file: give the directory that holds it ({holds})")
    if not looks_like_hub_id(source):
        raise LoadError(f"{source} does not exist: give an existing local directory or a hub id like owner/name")
    return None


PROBE_SECONDS = 3          # a reachable hub answers a TCP connect well within this
_probed: tuple[float, bool] | None = None     # (when, reachable): one probe serves a whole load


def backbone_name(model: str) -> str:
    """A backbone as files name it: a local one by its absolute path (as typed, relative to where the command
    ran, it named nothing elsewhere), a hub id as it is."""
    local = Path(model)
    return str(local.resolve()) if local.is_dir() else model


def hub_reachable() -> bool:
    """Whether a connection to the hub's endpoint opens (checked at most once a minute). Offline,
    huggingface_hub retries each request for about 23 s before it reads its cache, and the loader
    asks for files a repo may not have (safetensors before .pt, the optional proposal file), so an
    offline start waited that long for each. Unreachable, the loader reads the cache only; a file not
    there is the one-line "not in the local cache" error. With a proxy set, the hub is reached
    through it, which a direct probe cannot see: no probe then."""
    global _probed
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        return False
    if any(os.environ.get(name) for name in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return True
    now = time.monotonic()
    if _probed is None or now - _probed[0] > 60:
        url = urlsplit(constants.ENDPOINT)
        try:
            socket.create_connection((url.hostname, url.port or (443 if url.scheme == "https" else 80)),
                                     timeout=PROBE_SECONDS).close()
            _probed = (now, True)
        except OSError:           # no route, no DNS, refused, timed out: offline for this load
            _probed = (now, False)
    return _probed[1]


def _hub_error(repo_id: str, err: Exception) -> LoadError:
    from huggingface_hub.errors import GatedRepoError, LocalEntryNotFoundError, RepositoryNotFoundError

    # an id whose first part is a folder here is most likely a local path typed wrong (out/heds): said first
    parent = Path(repo_id).expanduser().parent
    typo = f"there is no folder {repo_id} (though {parent} is one: check the path); " \
        if parent != Path(".") and parent.is_dir() else ""
    if isinstance(err, GatedRepoError):
        return LoadError(f"{repo_id} is gated: accept its license on huggingface.co and run `hf auth login`")
    if isinstance(err, RepositoryNotFoundError):
        return LoadError(f"{typo}{repo_id} is not a hub repo (or is private): check the id, or `hf auth login` for "
                         "private repos")
    if isinstance(err, LocalEntryNotFoundError):
        from huggingface_hub import constants

        return LoadError(
            f"{typo}{repo_id} is not in the local cache and the hub cannot be reached (no connection to "
            f"{constants.ENDPOINT}, or HF_HUB_OFFLINE=1): run `hf download {repo_id}` on a machine with network, "
            "or pass a local directory"
        )
    return LoadError(f"{repo_id}: download failed ({type(err).__name__}: {first_line(err, width=None)}): retry, or pass "
                     "a local directory")


def fetch_first(repo_id: str, filenames: Sequence[str]) -> Path | None:
    """Download the first of ``filenames`` the repo has (order = preference); None if it has none.

    A file that is absent from the repo, or (offline) absent from the cache, moves on to
    the next name; a missing repo or an empty offline cache is a LoadError.
    """
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError, HfHubHTTPError, LocalEntryNotFoundError

    offline_misses, cache_only = 0, not hub_reachable()
    for name in filenames:
        try:
            return Path(hf_hub_download(repo_id, name, local_files_only=cache_only))
        except LocalEntryNotFoundError:   # subclass of EntryNotFoundError: check it first
            offline_misses += 1
        except EntryNotFoundError:
            continue
        except (HfHubHTTPError, OSError, ValueError) as err:  # HFValidationError is a ValueError
            raise _hub_error(repo_id, err) from err
    if offline_misses == len(filenames) and not _cached(repo_id):
        raise _hub_error(repo_id, LocalEntryNotFoundError(repo_id))
    return None


def fetch_snapshot(repo_id: str, patterns: Sequence[str]) -> Path:
    """The repo's files matching ``patterns`` in the hub cache (downloaded when missing)."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError

    try:
        return Path(snapshot_download(repo_id, allow_patterns=list(patterns),
                                      local_files_only=not hub_reachable()))
    except (HfHubHTTPError, OSError, ValueError) as err:
        raise _hub_error(repo_id, err) from err


def _cached(repo_id: str) -> bool:
    from huggingface_hub import constants

    folder = Path(constants.HF_HUB_CACHE) / f"models--{repo_id.replace('/', '--')}" / "snapshots"
    return folder.is_dir() and any(folder.iterdir())
