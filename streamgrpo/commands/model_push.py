"""``streamgrpo model push DIR --repo ORG/NAME``: upload an exported model directory to the Hugging Face Hub.

huggingface_hub does the work (``HfApi.create_repo`` with ``exist_ok``, then ``HfApi.upload_folder``: one
commit of every file of ``DIR``); the token is huggingface_hub's own: ``HF_TOKEN``, else the file ``hf auth
login`` wrote; ``HF_ENDPOINT`` names another Hub. What can go wrong is one line and exit status 1: offline
mode (``HF_HUB_OFFLINE``), no token, a token the Hub refuses, a Hub that cannot be reached or answers with an
error. A directory that is not an export (``streamgrpo model export``) is refused before any request.
No torch here: a push starts in a second.
"""

from __future__ import annotations

import logging
from pathlib import Path

from huggingface_hub import HfApi, constants, get_token
from huggingface_hub.errors import HfHubHTTPError, OfflineModeIsEnabled

log = logging.getLogger(__name__)


class PushError(RuntimeError):
    """The push could not be done (one line: what and where)."""


class NotAnExport(ValueError):
    """``DIR`` is not a model directory to push (one line)."""


def check_export(folder: Path) -> None:
    """An export has its card, a config and safetensors weights (full, merged or an adapter)."""
    if not folder.is_dir():
        raise NotAnExport(f"{folder}: no such directory")
    if (folder / "optimizer.safetensors").is_file() or (folder / "trainer_state.json").is_file():
        raise NotAnExport(f"{folder} holds training state (optimizer/trainer_state): push the output of "
                          "`streamgrpo model export`, not a checkpoint")
    missing = [what for what, ok in (
        ("README.md", (folder / "README.md").is_file()),
        ("config.json or adapter_config.json", (folder / "config.json").is_file()
         or (folder / "adapter_config.json").is_file()),
        ("*.safetensors", any(folder.glob("*.safetensors"))),
    ) if not ok]
    if missing:
        raise NotAnExport(f"{folder}: no {', no '.join(missing)} (write it with `streamgrpo model export CKPT --out "
                          f"{folder}`)")


def _transport_error(exc: BaseException) -> bool:
    """A connection that failed below HTTP (refused, DNS, TLS, timeout): httpx's / httpx2's TransportError
    (huggingface_hub's HTTP client, whichever it is) or an OSError."""
    return isinstance(exc, OSError) or any(c.__name__ == "TransportError" for c in type(exc).__mro__)


def push_folder(folder: str | Path, repo: str, *, private: bool = False, message: str | None = None) -> str:
    """Create ``repo`` if it does not exist and upload every file of ``folder`` in one commit; returns the
    commit's URL. Raises :class:`NotAnExport` or :class:`PushError` (one line)."""
    folder = Path(folder)
    check_export(folder)
    endpoint = constants.ENDPOINT
    if constants.is_offline_mode():
        raise PushError(f"offline mode is on (HF_HUB_OFFLINE): nothing uploaded to {endpoint}; unset it to push")
    token = get_token()
    if not token:
        raise PushError("no Hugging Face token: set HF_TOKEN or run `hf auth login` (a token with write access)")
    api = HfApi(token=token)
    try:
        api.create_repo(repo, private=private, exist_ok=True)
        info = api.upload_folder(folder_path=str(folder), repo_id=repo,
                                 commit_message=message or f"streamgrpo model export ({folder.name})")
    except OfflineModeIsEnabled:
        raise PushError(f"offline mode is on (HF_HUB_OFFLINE): nothing uploaded to {endpoint}") from None
    except HfHubHTTPError as exc:
        status = exc.response.status_code if exc.response is not None else None
        if status in (401, 403):
            raise PushError(f"{endpoint} refused the token (HTTP {status}) for {repo}: check HF_TOKEN or `hf auth "
                            "login`, and that the token may write to this namespace") from None
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise PushError(f"{endpoint}: pushing to {repo} failed: {first}") from None
    except ValueError as exc:  # the Hub's check of README.md's metadata block (/api/validate-yaml)
        raise PushError(f"{endpoint}: {' '.join(str(exc).split())}") from None
    except Exception as exc:
        if not _transport_error(exc):
            raise
        why = " ".join(str(exc).split()) or type(exc).__name__
        raise PushError(f"cannot reach {endpoint} ({why}); nothing uploaded") from None
    return str(info.commit_url)


def run_push(args) -> int:
    for name in ("httpx", "httpx2"):  # huggingface_hub's HTTP client logs each request at INFO
        logging.getLogger(name).setLevel(logging.WARNING)
    url = push_folder(args.folder, args.repo, private=args.private, message=args.message)
    print(f"pushed {args.folder} to {args.repo}: {url}")
    return 0
