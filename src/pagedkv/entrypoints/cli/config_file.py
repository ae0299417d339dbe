"""``--config FILE``: command-line flags read from a YAML file, as vLLM's (SRV-120).

The file is a mapping of flag names (``max_model_len`` or ``max-model-len``) to values; it is
expanded into flags placed right after the command's name, so flags given on the command line,
which come after, win (argparse keeps a flag's last value).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from pagedkv.errors import InvalidRequest

#: The flag naming the file.
CONFIG_FLAG = "--config"


def expand_config(argv: Sequence[str], commands: Sequence[str] = ("serve",)) -> list[str]:
    """``argv`` with a ``--config FILE`` of one of ``commands`` replaced by the file's flags.

    Raises:
        InvalidRequest: the file cannot be read, is not YAML, or is not a mapping; a value
            that is a mapping.
    """
    args = list(argv)
    where = next((i for i, a in enumerate(args) if a in commands), None)
    if where is None:
        return args
    for i in range(where + 1, len(args)):
        arg = args[i]
        if arg == CONFIG_FLAG and i + 1 < len(args):
            path, end = args[i + 1], i + 2
        elif arg.startswith(CONFIG_FLAG + "="):
            path, end = arg.split("=", 1)[1], i + 1
        else:
            continue
        flags = config_flags(Path(path))
        return args[: where + 1] + flags + args[where + 1 : i] + args[end:]
    return args


def config_flags(path: Path) -> list[str]:
    """The flags a YAML config file holds, in its order.

    Raises:
        InvalidRequest: the file cannot be read or parsed, or is not a mapping of flags.
    """
    import yaml

    try:
        loaded = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError) as exc:
        raise InvalidRequest(f"--config {path}: {exc}") from exc
    if loaded is None:
        return []
    if not isinstance(loaded, dict):
        raise InvalidRequest(f"--config {path}: expected a mapping of flags to values")
    flags: list[str] = []
    for key, value in loaded.items():
        flag = "--" + str(key).replace("_", "-")
        if isinstance(value, bool):
            flags.append(flag if value else "--no-" + flag[2:])
        elif isinstance(value, list):
            for item in value:
                flags += [flag, str(item)]
        elif isinstance(value, dict):
            raise InvalidRequest(f"--config {path}: {key} is a mapping; flags take text values")
        elif value is not None:
            flags += [flag, str(value)]
    return flags
