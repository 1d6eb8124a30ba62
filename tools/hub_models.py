"""``--model org/name``: a Hugging Face Hub model, resolved through ``huggingface_hub`` to a local snapshot.

A name of the Hub's form (``owner/name``, one slash) that is not a local path is looked up in the
``huggingface_hub`` cache (``HF_HOME``, ``HF_HUB_CACHE``), at ``--revision`` (a branch, tag or commit;
default ``main``), and downloaded there when the Hub is reachable: only the files megatrain reads
(``SNAPSHOT_FILES``: config, safetensors weights, tokenizer and chat template, generation config).
``HF_HUB_OFFLINE=1`` reads the cache only. The snapshot directory is then a Hugging Face model
directory like any other, with its tokenizer and chat template. A local directory of the same name wins.
"""
from __future__ import annotations

import functools
import os
import re
from typing import Any

from megatrain.errors import MegatrainError

# What a snapshot download fetches: the files megatrain reads and megatrain-export copies, never pickles.
SNAPSHOT_FILES = ("config.json", "generation_config.json", "*.safetensors", "model.safetensors.index.json",
                  "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                  "chat_template.jinja", "chat_template.json")
_HUB_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*")


class HubModelError(MegatrainError):
    """A Hub model that cannot be had. One line: why, and the fix."""


def is_hub_name(model: str, base: str = "") -> bool:
    """``owner/name`` that is not a path (relative to ``base``, the current directory by default)."""
    return (bool(_HUB_NAME.fullmatch(model)) and not model.endswith(".json")
            and not os.path.exists(os.path.join(base, model) if base else model))


@functools.lru_cache(maxsize=None)
def snapshot(name: str, revision: str = "") -> str:
    """The local snapshot directory of Hub model ``name`` at ``revision`` (downloaded when online and missing).

    One line saying how to fix it when it cannot be had (offline and not cached, unknown repository or
    revision, a gated model, no network)."""
    try:
        import huggingface_hub
        from huggingface_hub import errors
    except ImportError:
        raise HubModelError(f"model: {name} is a Hugging Face Hub name, which needs huggingface_hub; pip install "
                               f"huggingface_hub (in megatrain's train extra), or pass a local model "
                               f"directory") from None
    at = f" at revision {revision}" if revision else ""
    offline = _offline(huggingface_hub)
    try:
        return huggingface_hub.snapshot_download(name, revision=revision or None,
                                                 allow_patterns=list(SNAPSHOT_FILES))
    except errors.GatedRepoError:
        raise HubModelError(f"model: {name} is gated on the Hugging Face Hub; accept its terms on its page and log "
                               f"in (hf auth login, or set HF_TOKEN), or pass a local model directory") from None
    except errors.RepositoryNotFoundError:
        raise HubModelError(f"model: {name} is neither a local path nor a model on the Hugging Face Hub; check the "
                               f"name (a private model needs hf auth login or HF_TOKEN)") from None
    except errors.RevisionNotFoundError:
        raise HubModelError(f"model: {name} has no revision {revision!r}; pass a branch, tag or commit it has "
                               f"with --revision") from None
    except (errors.LocalEntryNotFoundError, errors.OfflineModeIsEnabled, FileNotFoundError):
        if offline:
            raise HubModelError(f"model: {name}{at} is not in the Hugging Face cache ({_cache_dir()}) and "
                                   f"HF_HUB_OFFLINE is set; download it once online (hf download {name}), "
                                   f"set HF_HOME or HF_HUB_CACHE to the cache that holds it, or pass a local "
                                   f"directory") from None
        raise HubModelError(f"model: {name}{at} is not in the Hugging Face cache ({_cache_dir()}) and the Hub "
                               f"cannot be reached; connect, or pass a local model directory") from None
    except (OSError, errors.HfHubHTTPError) as e:
        raise HubModelError(f"model: downloading {name}{at} failed ({_one_line(e)}); retry, or pass a local "
                               f"model directory") from None


def cached(name: str, revision: str = "") -> str | None:
    """The snapshot directory of ``name`` already in the cache (never downloads); None when it is not."""
    try:
        import huggingface_hub
    except ImportError:
        return None
    try:
        return huggingface_hub.snapshot_download(name, revision=revision or None, local_files_only=True,
                                                 allow_patterns=list(SNAPSHOT_FILES))
    except Exception:  # not cached (any of huggingface_hub's lookup errors): nothing to copy from
        return None


def _offline(huggingface_hub: Any) -> bool:
    constants = getattr(huggingface_hub, "constants", None)
    return bool(getattr(constants, "HF_HUB_OFFLINE", False)) or \
        os.environ.get("HF_HUB_OFFLINE", "").upper() in ("1", "ON", "YES", "TRUE")


def _cache_dir() -> str:
    from huggingface_hub import constants

    return str(constants.HF_HUB_CACHE)


def _one_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__
