"""Where the Hydra configs are: ``asyncrl/conf/`` inside an installed wheel (setup.py
copies them there), the repository's ``conf/`` in a checkout or an editable install."""

from __future__ import annotations

from pathlib import Path

_PACKAGED = Path(__file__).resolve().with_name("conf")
_CHECKOUT = Path(__file__).resolve().parents[1] / "conf"


def conf_dir() -> Path:
    """The directory holding ``config.yaml`` and the config groups."""
    if (_PACKAGED / "config.yaml").is_file():
        return _PACKAGED
    if (_CHECKOUT / "config.yaml").is_file():
        return _CHECKOUT
    raise FileNotFoundError(
        f"asyncrl's configs are in neither {_PACKAGED} (an installed wheel) nor {_CHECKOUT} "
        "(a checkout): reinstall asyncrl"
    )
