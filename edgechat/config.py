"""Where edgechat keeps its files, and the user's settings (TOML under the XDG config home)."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path

import platformdirs

from edgechat.errors import UsageError

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

#: one variable moves every edgechat directory under one root (tests, scripts, portable installs)
DATA_DIR_ENV = "EDGECHAT_DATA_DIR"


@dataclass(frozen=True)
class Paths:
    data: Path  # conversations, KV snapshots
    cache: Path  # assembled and downloaded models, fixtures
    config: Path  # config.toml

    @property
    def config_file(self) -> Path:
        return self.config / "config.toml"

    @property
    def models_cache(self) -> Path:
        return self.cache / "models"

    @property
    def database(self) -> Path:
        return self.data / "edgechat.sqlite3"

    @property
    def snapshots(self) -> Path:
        return self.data / "snapshots"


def make_data_dir(paths: Paths) -> None:
    """Create the data directory and its snapshots directory for this user alone (0700): they hold
    the conversations. Missing parents get the usual modes; a directory that exists is left as it is."""
    for path in (paths.data, paths.snapshots):
        # mkdir's mode goes through the umask, which only ever removes bits: 0700 stays 0700 or less
        path.mkdir(mode=0o700, parents=True, exist_ok=True)


def get_paths(data_dir: str | os.PathLike | None = None) -> Paths:
    """Resolve the directories: explicit argument, then $EDGECHAT_DATA_DIR, then XDG homes."""
    root = data_dir or os.environ.get(DATA_DIR_ENV)
    if root:
        base = Path(root).expanduser().resolve()
        paths = Paths(data=base, cache=base / "cache", config=base / "config")
    else:
        paths = Paths(
            data=Path(platformdirs.user_data_dir("edgechat", appauthor=False)),
            cache=Path(platformdirs.user_cache_dir("edgechat", appauthor=False)),
            config=Path(platformdirs.user_config_dir("edgechat", appauthor=False)),
        )
    for path in (paths.data, paths.cache, paths.config):
        _check_creatable(path)
    return paths


def _check_creatable(path: Path) -> None:
    """Every command resolves its paths here, so this is the one place a directory that can never
    exist (a file on the way to it) becomes a one-line error instead of a traceback later."""
    for parent in (path, *path.parents):
        if parent.exists():
            if not parent.is_dir():
                raise UsageError(f"cannot create {path}: {parent} is a file, not a directory; "
                                 "pass another --data-dir (or EDGECHAT_DATA_DIR)")
            if not os.access(parent, os.W_OK | os.X_OK) and parent != path:
                raise UsageError(f"cannot create {path}: no permission to write in {parent}; "
                                 "pass another --data-dir (or EDGECHAT_DATA_DIR)")
            return


def load_settings(paths: Paths) -> dict:
    """The user's config.toml as a dict ({} when absent); a broken file is a one-line error."""
    try:
        with open(paths.config_file, "rb") as fh:
            return tomllib.load(fh)
    except FileNotFoundError:
        return {}
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise UsageError(f"{paths.config_file} is not valid TOML ({exc}); fix or delete it") from None


def model_settings(paths: Paths, *names: str | None) -> dict:
    """A model's own settings, `[models."NAME"]` in config.toml (e.g. gpu_layers = 20), under the
    first of `names` (as typed, as displayed) that has a table; {} when none has."""
    models = load_settings(paths).get("models") or {}
    for name in names:
        if name and isinstance(models.get(name), dict):
            return models[name]
    return {}


def read_chat_template(path: str | None) -> str | None:
    """The Jinja text of a --chat-template FILE (or a model's chat_template in config.toml)."""
    if path is None:
        return None
    try:
        return Path(path).expanduser().read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise UsageError(f"cannot read the chat template {path}: {getattr(exc, 'strerror', None) or exc}") from None
