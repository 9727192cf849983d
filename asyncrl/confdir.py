"""Where the Hydra configs are: ``asyncrl/conf/`` inside an installed wheel (setup.py
copies them there), the repository's ``conf/`` in a checkout or an editable install, and
in a worker of a job whose code was shipped from a checkout (``ray.ship_code``:
``ASYNCRL_SHIPPED`` set), the shipped working directory's ``conf/``."""

from __future__ import annotations

import os
from pathlib import Path

_PACKAGED = Path(__file__).resolve().with_name("conf")
_CHECKOUT = Path(__file__).resolve().parents[1] / "conf"


def conf_dir() -> Path:
    """The directory holding ``config.yaml`` and the config groups."""
    if (_PACKAGED / "config.yaml").is_file():
        return _PACKAGED
    if (_CHECKOUT / "config.yaml").is_file():
        return _CHECKOUT
    shipped = Path.cwd() / "conf"
    if os.environ.get("ASYNCRL_SHIPPED") and (shipped / "config.yaml").is_file():
        return shipped
    raise FileNotFoundError(
        f"asyncrl's configs are in neither {_PACKAGED} (an installed wheel) nor {_CHECKOUT} "
        "(a checkout): reinstall asyncrl"
    )
