"""Where a server's model comes from: its config, read from a local folder or the hub, with a clear
error when neither answers.
"""

from __future__ import annotations

import os
from typing import Optional

from transformers import AutoConfig, PretrainedConfig


def load_model_config(source: str, revision: Optional[str] = None) -> PretrainedConfig:
    """The model's config, or a ValueError naming the repo (or folder) that could not be read.

    Without network the hub client retries for half a minute before giving up; when the hub's host
    does not even resolve (or HF_HUB_OFFLINE is set) only the local cache is tried, so the server
    fails at once with a clear message instead of a stack trace.
    """
    local_only = not os.path.isdir(source) and not hub_reachable()
    try:
        return AutoConfig.from_pretrained(source, local_files_only=local_only, revision=revision)
    except Exception as e:  # OSError, huggingface_hub and httpx errors, unknown model types
        if local_only:
            reason = (
                "the Hugging Face hub is unreachable (no network, or HF_HUB_OFFLINE is set) "
                "and it is not in the local cache"
            )
        else:
            reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(f"cannot load the config of {source!r}: {reason}") from None


def hub_reachable(timeout: float = 5.0) -> bool:
    """Whether the hub's host name resolves (a DNS lookup only: no connection is made)."""
    import socket
    from concurrent.futures import ThreadPoolExecutor
    from urllib.parse import urlparse

    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        return False
    host = urlparse(constants.ENDPOINT).hostname or "huggingface.co"
    pool = ThreadPoolExecutor(1)
    try:
        pool.submit(socket.getaddrinfo, host, 443).result(timeout=timeout)
        return True
    except Exception:
        return False
    finally:
        pool.shutdown(wait=False)
