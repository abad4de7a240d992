"""Reading and writing calibration profile files (YAML or JSON), and resolving built-in names.

Wherever a profile file is accepted, a built-in profile name (`disaggpool profile list`) works
too. A malformed file raises `InputError` naming the file and the field. The schema is the one
`core.profile.profile_to_dict` writes; PROFILES.md documents it.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import yaml

from disaggpool.core.hardware import BUILTIN_PROFILES
from disaggpool.core.profile import CalibrationProfile, profile_from_dict, profile_to_dict
from disaggpool.errors import InputError

__all__ = ["dump_profile", "load_profile", "load_yaml", "resolve_profile", "save_profile"]


class _Loader(yaml.SafeLoader):
    """SafeLoader that also reads ``20e9`` and ``2.5e+3`` as floats.

    PyYAML follows YAML 1.1, where a float needs a dot and a signed exponent, so the natural way
    to write a bandwidth (``bandwidth_bytes_per_s: 20e9``) would load as a string; YAML 1.2
    (and JSON) read it as a number, and so does this loader.
    """


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9][0-9_]*)[eE][-+]?[0-9]+$"),
    list("-+0123456789."),
)


def load_yaml(text: str) -> Any:
    """Parse YAML safely, with YAML 1.2 exponent floats (used for profile and scenario files)."""
    return yaml.load(text, Loader=_Loader)  # _Loader derives from SafeLoader


def load_profile(path: str | Path) -> CalibrationProfile:
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise InputError(str(path), "<file>", f"cannot read: {exc.strerror or exc}") from None
    try:
        data = json.loads(text) if path.suffix == ".json" else load_yaml(text)
    except (json.JSONDecodeError, yaml.YAMLError) as exc:
        raise InputError(
            str(path), "<file>", f"not valid {'JSON' if path.suffix == '.json' else 'YAML'}: {exc}"
        ) from None
    return profile_from_dict(data, source=str(path))


def resolve_profile(ref: str, base: Path | None = None) -> CalibrationProfile:
    """A built-in name, or a path (relative to `base` when given)."""
    if ref in BUILTIN_PROFILES:
        return BUILTIN_PROFILES[ref]
    path = Path(ref)
    if base is not None and not path.is_absolute():
        path = base / path
    if not path.exists():
        raise InputError(
            ref,
            "<profile>",
            f"neither a built-in profile ({', '.join(BUILTIN_PROFILES)}) nor a file",
        )
    return load_profile(path)


def dump_profile(profile: CalibrationProfile, fmt: str = "yaml") -> str:
    data = profile_to_dict(profile)
    if fmt == "json":
        return json.dumps(data, indent=2) + "\n"
    return yaml.safe_dump(data, sort_keys=False)


def save_profile(profile: CalibrationProfile, path: str | Path) -> None:
    path = Path(path)
    path.write_text(
        dump_profile(profile, "json" if path.suffix == ".json" else "yaml"), encoding="utf-8"
    )
