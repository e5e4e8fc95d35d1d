"""Where a model or heads source lives: a local directory, or a Hugging Face hub repo.

Hub files go through huggingface_hub (its cache, progress bars, HF_HUB_OFFLINE and
token handling); every failure becomes one LoadError line that says how to get
the files, never a stack trace.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path

from ..errors import LoadError

# owner/name as the hub spells repo ids; anything else that does not exist locally is a bad path
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.\-]*/[\w.\-]+$")


def local_dir(source: str) -> Path | None:
    """The directory ``source`` names, None when it is a hub repo id; LoadError when it is neither."""
    path = Path(source).expanduser()
    if path.is_dir():
        return path
    if path.exists():
        raise LoadError(f"{source} is a file: give the directory that holds it (config.json and weights)")
    if not _REPO_ID.match(source) or source.startswith((".", "/", "~")):
        raise LoadError(f"{source} does not exist: give an existing local directory or a hub id like owner/name")
    return None


def _hub_error(repo_id: str, err: Exception) -> LoadError:
    from huggingface_hub.errors import GatedRepoError, LocalEntryNotFoundError, RepositoryNotFoundError

    if isinstance(err, GatedRepoError):
        return LoadError(f"{repo_id} is gated: accept its license on huggingface.co and run `hf auth login`")
    if isinstance(err, RepositoryNotFoundError):
        return LoadError(f"{repo_id} is not a hub repo (or is private): check the id, or `hf auth login` for private repos")
    if isinstance(err, LocalEntryNotFoundError):
        return LoadError(
            f"{repo_id} is not in the local cache and the hub cannot be reached (offline or HF_HUB_OFFLINE=1): "
            f"run `hf download {repo_id}` on a machine with network, or pass a local directory"
        )
    return LoadError(f"{repo_id}: download failed ({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}): retry, or pass a local directory")


def fetch_first(repo_id: str, filenames: Sequence[str], revision: str | None = None) -> Path | None:
    """Download the first of ``filenames`` the repo has (order = preference); None if it has none.

    A file that is absent from the repo, or (offline) absent from the cache, moves on to
    the next name; a missing repo or an empty offline cache is a LoadError.
    """
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError, HfHubHTTPError, LocalEntryNotFoundError

    offline_misses = 0
    for name in filenames:
        try:
            return Path(hf_hub_download(repo_id, name, revision=revision))
        except LocalEntryNotFoundError:   # subclass of EntryNotFoundError: check it first
            offline_misses += 1
        except EntryNotFoundError:
            continue
        except (HfHubHTTPError, OSError, ValueError) as err:  # HFValidationError is a ValueError
            raise _hub_error(repo_id, err) from err
    if offline_misses == len(filenames) and not _cached(repo_id):
        raise _hub_error(repo_id, LocalEntryNotFoundError(repo_id))
    return None


def fetch_snapshot(repo_id: str, patterns: Sequence[str], revision: str | None = None) -> Path:
    """The repo's files matching ``patterns`` in the hub cache (downloaded when missing)."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError

    try:
        return Path(snapshot_download(repo_id, revision=revision, allow_patterns=list(patterns)))
    except (HfHubHTTPError, OSError, ValueError) as err:
        raise _hub_error(repo_id, err) from err


def _cached(repo_id: str) -> bool:
    from huggingface_hub import constants

    folder = Path(constants.HF_HUB_CACHE) / f"models--{repo_id.replace('/', '--')}" / "snapshots"
    return folder.is_dir() and any(folder.iterdir())
