import os
from pathlib import Path

import mlflow
import pytest
from hydra import compose, initialize_config_dir, initialize_config_module  # noqa: F401  (re-exported for tests)
from hydra.core.global_hydra import GlobalHydra
from mlflow.tracking import MlflowClient

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


@pytest.fixture(scope="session")
def store_template(request) -> Path:
    """An empty, fully migrated SQLite store, built once (MLflow's migrations take seconds) and
    copied by every test that needs one."""
    cache = Path(request.config.cache.mkdir("graft-mlflow-store"))
    db = cache / f"mlflow-{mlflow.__version__}.db"
    if not db.exists():
        tmp = cache / f"building-{os.getpid()}.db"
        MlflowClient(f"sqlite:///{tmp}").search_experiments()
        tmp.replace(db)
    return db
