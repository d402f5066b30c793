import pytest
from hydra import compose, initialize_config_module  # noqa: F401  (re-exported for tests)
from hydra.core.global_hydra import GlobalHydra
from hydra import initialize_config_dir
from pathlib import Path

from graft_exp.config import register_schemas

CONF_DIR = str(Path(__file__).resolve().parents[1] / "conf")
register_schemas()


@pytest.fixture
def compose_cfg():
    """Compose the project's config with overrides, exactly as `python -m graft_exp` does."""
    def _compose(*overrides: str):
        GlobalHydra.instance().clear()
        with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
            return compose(config_name="config", overrides=list(overrides))
    yield _compose
    GlobalHydra.instance().clear()
