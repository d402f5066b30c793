"""Every pair x method composes and validates; bad input fails at composition or validation
with a message that names the fix."""

from pathlib import Path

import pandas as pd
import pytest
from hydra.errors import ConfigCompositionException, MissingConfigException
from omegaconf.errors import ConfigKeyError

from graft_exp.config import ConfigError, prepared_data, validate
from graft_exp.methods import METHODS as declared_methods

CONF = Path(__file__).resolve().parents[1] / "conf"
METHODS = sorted(p.stem for p in (CONF / "method").glob("*.yaml"))
PAIRS = sorted(p.stem for p in (CONF / "pair").glob("*.yaml"))
#: The methods of the paper (§4, App. B, G), as the registry declares them.
DESIGN_METHODS = set(declared_methods)


def test_every_design_method_has_a_config():
    """One YAML per declared method and one declaration per YAML (graft_exp/methods/__init__.py)."""
    assert set(METHODS) == DESIGN_METHODS
    assert set(PAIRS) == {"tiny", "tiny_ac", "tiny_bc", "tiny_verl", "tiny_paper_vocab", "pair1", "pair2", "pair3"}


@pytest.fixture(scope="module")
def prepared_data_dir(tmp_path_factory) -> str:
    """Where ``python -m graft_exp.prepare`` would have written MATH and the benchmarks: one row each, in
    prepare's own row format (validation reads the files' schema)."""
    from support.paper_standins import prepare_data

    return str(prepare_data(tmp_path_factory.mktemp("data")))


def test_prepared_files_that_are_not_prepare_output_are_refused(compose_cfg, prepared_data_dir, tmp_path):
    """A truncated Parquet file, or one without the columns verl reads, fails before the job starts."""
    import shutil

    data = tmp_path / "data"
    shutil.copytree(prepared_data_dir, data)
    train = data / "math" / "train.parquet"
    cfg = compose_cfg("pair=pair1", "backend=verl", f"backend.data_dir={data}")
    train.write_bytes(train.read_bytes()[:40])
    with pytest.raises(ConfigError, match="math/train.parquet is not a readable Parquet file.*prepare` again"):
        prepared_data(cfg)
    pd.DataFrame({"question": ["1+1"], "answer": ["2"]}).to_parquet(train)
    with pytest.raises(ConfigError, match="lacks the columns data_source, extra_info, prompt, reward_model"):
        prepared_data(cfg)


#: The quick tier composes every method on the default pair and every pair with GRAFT; the slow tier the rest
#: of the grid (a composition and validation each: about 140 in all).
GRID = [pytest.param(method, pair, marks=() if pair == "tiny" or method == "graft" else pytest.mark.slow)
        for method in METHODS for pair in PAIRS]


@pytest.mark.parametrize(("method", "pair"), GRID)
def test_every_pair_and_method_composes_and_validates(compose_cfg, pair, method):
    backend = ["backend=local"] if pair.startswith("tiny") else ["backend=verl"]
    cfg = compose_cfg(f"pair={pair}", f"method={method}", *backend)
    if pair == "tiny_paper_vocab":   # chat-template models, for verl's CPU tiers (which compose it unvalidated)
        with pytest.raises(ConfigError, match="tiny-qwen3-vocab is prompted through a chat template.*backend=verl"):
            validate(cfg)
        return
    validate(cfg)
    assert cfg.method.name == method
    assert cfg.pair.name == pair


@pytest.mark.parametrize("pair", ["pair1", "pair2", "pair3"])
def test_paper_pairs_run_on_verl_only(compose_cfg, pair, prepared_data_dir):
    validate(compose_cfg(f"pair={pair}", "backend=verl"))
    with pytest.raises(ConfigError, match=f"pair={pair} needs GPUs: use backend=verl"):
        validate(compose_cfg(f"pair={pair}"))
    with pytest.raises(ConfigError, match="lacks .*math/train.parquet.*python -m graft_exp.prepare"):
        prepared_data(compose_cfg(f"pair={pair}", "backend=verl", "backend.data_dir=/nonexistent"))
    prepared_data(compose_cfg(f"pair={pair}", "backend=verl", f"backend.data_dir={prepared_data_dir}"))


def test_paper_defaults(compose_cfg):
    m = compose_cfg("pair=pair1").method
    assert (m.n, m.delta, m.clip_low, m.clip_high, m.adv_eps) == (8, 0.8, 0.2, 0.28, 1e-6)
    assert (m.selection, m.peer_loss, m.gate, m.ratio, m.peer_position) == (
        "balanced", "graft", True, "token", "last")
    assert compose_cfg("method=sgt").method.sgt_lambda == 0.1
    assert compose_cfg("method=graft_luffy").method.luffy_gamma == 0.1
    h = compose_cfg("method=hacpo").method.hacpo
    assert (h.self_clip_low, h.self_clip_high, h.peer_clip_init, h.peer_clip_step, h.kl_coef,
            h.minibatch_prompts) == (3e-4, 4e-4, 0.8, 0.025, 1e-3, 64)
    train = compose_cfg("pair=pair1").train
    assert (train.batch_prompts, train.minibatch_prompts, train.lr, train.weight_decay) == (128, 32, 1e-6, 0.01)


@pytest.mark.parametrize(
    ("method", "changed"),
    [
        ("graft_no_gate", {"gate": False}),
        ("graft_no_floor", {"delta": 0.0}),
        ("graft_no_balance", {"selection": "rescue"}),
        ("graft_seq_ratio", {"ratio": "sequence"}),
        ("graft_random_prompts", {"selection": "random_prompts"}),
        ("graft_random_admission", {"admission": "random"}),
        ("graft_peer_first", {"peer_position": "first"}),
        ("graft_peer_uniform", {"peer_position": "uniform"}),
        ("graft_pooled", {"advantages": "pooled"}),
        ("graft_success_only", {"peer_responses": "success"}),
        ("graft_success_only_no_floor", {"peer_responses": "success", "delta": 0.0}),
        ("graft_stored", {"source": "stored", "selection": "complementary"}),
        ("graft_luffy", {"peer_loss": "luffy", "gate": False}),
    ],
)
def test_variants_change_exactly_their_components(compose_cfg, method, changed):
    """Appendix G: each variant differs from full GRAFT only in what it names."""
    base = compose_cfg("method=graft").method
    variant = compose_cfg(f"method={method}").method
    diff = {k: variant[k] for k in base if k != "name" and variant[k] != base[k]}
    assert diff == changed


def test_unknown_method_lists_the_options(compose_cfg):
    with pytest.raises(MissingConfigException, match="Available options"):
        compose_cfg("method=grafft")


def test_unknown_pair_fails(compose_cfg):
    with pytest.raises(MissingConfigException, match="pair"):
        compose_cfg("pair=pair9")


def test_typo_in_method_key_fails_at_composition(compose_cfg):
    with pytest.raises((ConfigCompositionException, ConfigKeyError), match="dleta"):
        compose_cfg("method.dleta=0.7")


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["method.delta=1.5"], r"method.delta=1.5 is outside \[0, 1\]"),
        (["method.delta=-0.1"], r"outside \[0, 1\]"),
        (["method.n=1"], r"n >= 2"),
        (["pair.A=gpt-5"], r"pair.A='gpt-5' is not a known model"),
        (["pair.B=tiny-char-llama"], r"names 'tiny-char-llama' twice"),
        (["method=grpo_n8", "method.selection=balanced"], r"single-model method needs selection=none"),
        (["method=graft", "method.peer_loss=none"], r"selection='balanced' but peer_loss='none'"),
        (["method=graft", "method.sampling=dynamic"], r"method.sampling=dynamic is a single-model GRPO baseline"),
        (["method=graft_stored", "method.selection=balanced"], r"selection=complementary"),
        (["backend=verl"], r"backend=verl runs on GPU nodes"),
        (["method.peer_position=middle"], r"method.peer_position='middle' is not one of last, first"),
        (["train.batch_prompts=10", "train.minibatch_prompts=4"], r"not a multiple"),
    ],
)
def test_bad_values_fail_validation_with_the_fix(compose_cfg, overrides, message):
    with pytest.raises(ConfigError, match=message):
        validate(compose_cfg(*overrides))


def test_server_tracking_without_uri_says_what_to_set(compose_cfg, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    with pytest.raises(ConfigError, match="MLFLOW_TRACKING_URI"):
        validate(compose_cfg("tracking=server"))


def test_a_prepared_verl_model_that_cannot_be_prompted_is_refused_before_the_job(compose_cfg, tmp_path):
    """verl's agent loop renders every prompt with a chat template: a model the project built without one, in its
    tokenizer's own template (``prompt_format: null``), is refused at validation naming the fix; named a prompt format
    from the command line, it passes."""
    import shutil

    from graft_exp.config import prepared_models, prepared_problem
    from graft_exp.tiny.models import ASSETS

    for key in ("tiny-char-llama", "tiny-bpe-qwen3"):
        shutil.copytree(ASSETS / key, tmp_path / key)
    cfg = compose_cfg("backend=verl", "pair=tiny_verl", f"backend.model_dir={tmp_path}")
    with pytest.raises(ConfigError, match=r"models.tiny-char-llama \(.*\) has no chat template, and verl's agent loop"
                                          r".*models.<key>.prompt_format="):
        prepared_models(cfg)
    prepared_models(compose_cfg("backend=verl", "pair=tiny_verl", f"backend.model_dir={tmp_path}",
                                "models.tiny-char-llama.prompt_format=question_answer",
                                "models.tiny-bpe-qwen3.prompt_format=question_answer"))
    prepared_problem.cache_clear()