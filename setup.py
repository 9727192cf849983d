"""The build step pyproject.toml cannot say: the Hydra configs live at the repository's
``conf/`` (where ``python -m asyncrl.train`` in a checkout reads them), and a wheel
carries them as ``asyncrl/conf/`` (where :func:`asyncrl.confdir.conf_dir` finds them
once installed). Everything else is in pyproject.toml."""

from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent


class BuildPyWithConf(build_py):
    def run(self) -> None:
        super().run()
        if getattr(self, "editable_mode", False):
            return  # an editable install reads the checkout's conf/ itself
        out = Path(self.build_lib) / "asyncrl" / "conf"
        for src in sorted((ROOT / "conf").rglob("*.yaml")):
            dst = out / src.relative_to(ROOT / "conf")
            dst.parent.mkdir(parents=True, exist_ok=True)
            self.copy_file(str(src), str(dst))


setup(cmdclass={"build_py": BuildPyWithConf})
