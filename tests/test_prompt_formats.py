"""Each paper model's prompt format is a pinned, recorded, per-model choice (docs/verl.md, "Prompt formats"): the
formats against the paper models' real tokenizers (built offline, graft_exp/tiny/paper_vocab.py), the paper's four
configurations validated and planned with prepared stand-ins of the snapshots, a format chosen per model from the
command line (its own verl config, its hash in the run key and on the run), the revision a snapshot was prepared at,
and prepare downloading, recording and checking the pinned revision."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf
from support.optional import VERL_BACKEND
from support.paper_standins import PAPER_MODELS, prepare_data, prepare_models

from graft_exp import prompts, resources, schema, snapshots, tracking
from graft_exp.cache import cache_dir
from graft_exp.config import MODELS_FILE, ConfigError, prepared_problem, validate_job
from graft_exp.tiny.paper_vocab import build, why_unavailable

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(why_unavailable() is not None, reason=str(why_unavailable()))]

#: Which formats of the catalog each paper model's real tokenizer takes, with the end of turn each closes on.
FITS = {
    "qwen3-1.7b-base": {"chatml": 151645, "qwen3": 151645, "question_answer": 151643},
    "smollm3-3b-base": {"chatml": 128012, "qwen3": 128012, "llama3": 128009, "llama3_2_instruct": 128009,
                        "question_answer": 128001},
    "octothinker-3b-hybrid-base": {"llama3": 128009, "llama3_2_instruct": 128009, "question_answer": 128001},
}
CONFIGURATIONS = ["pair=pair1", "pair=pair2", "pair=pair3", "group=trio"]


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    root = tmp_path_factory.mktemp("paper_prepared")
    prepare_data(root / "data")
    prepare_models(root / "models")
    return root


def paper_cfg(compose_cfg, prepared, *overrides: str):
    return compose_cfg("backend=verl", "cluster=slurm", f"backend.data_dir={prepared / 'data'}",
                       f"backend.model_dir={prepared / 'models'}", *overrides)


def test_each_format_fits_exactly_the_tokenizers_it_was_written_for():
    """A format whose markers are not special tokens of a vocabulary is refused for it, naming the model, the
    marker and the override that picks another; the paper's single user message renders once, unaltered."""
    catalog = OmegaConf.load(MODELS_FILE)
    for key in PAPER_MODELS:
        tokenizer = build(key, cache_dir("paper_tokenizers"))
        assert catalog[key].prompt_format in FITS[key]   # every default fits its model
        for name, fmt in prompts.formats().items():
            if name in FITS[key]:
                assert prompts.check_format(tokenizer, fmt, key) == FITS[key][name], (key, name)
                message = prompts.format_prompt("What is $2+2$?")
                rendered = tokenizer.apply_chat_template([{"role": "user", "content": message}], tokenize=False,
                                                         add_generation_prompt=True, chat_template=fmt.text)
                assert rendered.count(message) == 1 and prompts.SUFFIX in rendered
            else:
                with pytest.raises(ValueError, match=rf"prompt format {name}: '<\|.*\|>' is not one special token of "
                                                     rf"{key}'s tokenizer.*choose another format"):
                    prompts.check_format(tokenizer, fmt, key)


@pytest.mark.parametrize("configuration", CONFIGURATIONS)
def test_the_paper_configurations_validate_and_plan_with_prepared_snapshots(compose_cfg, prepared, configuration):
    """pair1-3 and the trio, as shipped, pass validation (their prepared snapshots' tokenizers against their
    formats) and planning, and each member's verl config carries its own model's format."""
    pytest.importorskip("verl", reason=VERL_BACKEND)
    from graft_exp.backends.verl.config import verl_config
    from graft_exp.config import roles

    cfg = paper_cfg(compose_cfg, prepared, configuration)
    validate_job(cfg)
    resources.check(resources.job_plan(cfg), cfg)
    for role in roles(cfg.pair):
        template = verl_config(cfg, role, "/tmp/unused").actor_rollout_ref.model.custom_chat_template
        assert template == prompts.prompt_format(cfg.models[cfg.pair[role]].prompt_format).text


def test_a_format_chosen_on_the_command_line_is_that_models_own_and_keyed(compose_cfg, prepared, tmp_path):
    """Qwen3 prompted in plain Question/Answer text (the key has a dot, so the dict form of the override): its own
    verl config changes, its peer's does not, the run key changes, and the model run records name and hash."""
    pytest.importorskip("verl", reason=VERL_BACKEND)
    from graft_exp.backends.verl.config import verl_config

    chosen = prompts.model_override("qwen3-1.7b-base", "prompt_format", "question_answer").strip("'")
    default = paper_cfg(compose_cfg, prepared, "pair=pair1", f"tracking.uri=sqlite:///{tmp_path}/mlflow.db")
    cfg = paper_cfg(compose_cfg, prepared, "pair=pair1", chosen, f"tracking.uri=sqlite:///{tmp_path}/mlflow.db")
    validate_job(cfg)
    template = {role: verl_config(cfg, role, "/tmp/unused").actor_rollout_ref.model.custom_chat_template
                for role in ("A", "B")}
    assert template["B"] == prompts.prompt_format("question_answer").text
    assert template["A"] == verl_config(default, "A", "/tmp/unused").actor_rollout_ref.model.custom_chat_template
    assert tracking.run_key(cfg) != tracking.run_key(default)
    digest = prompts.prompt_format("question_answer").digest
    assert tracking.identity(cfg)["models"]["qwen3-1.7b-base"]["prompt_format"] == digest
    job = tracking.open_job(cfg)
    run = tracking.open_model_run(cfg, job, "B")
    tags = job.client.get_run(run.run_id).data.tags
    assert tags[schema.PROMPT_FORMAT] == f"question_answer@{digest}"


def test_a_snapshot_prepared_at_another_revision_is_refused_unless_chosen(compose_cfg, prepared, tmp_path):
    import shutil

    models = tmp_path / "models"
    shutil.copytree(prepared / "models", models)
    pin = "0123456789abcdef0123456789abcdef01234567"
    snapshots.record(models / "smollm3-3b-base", "HuggingFaceTB/SmolLM3-3B-Base", "f" * 40)

    def cfg(*overrides):
        prepared_problem.cache_clear()
        return paper_cfg(compose_cfg, prepared, "pair=pair1", f"backend.model_dir={models}", *overrides)

    with pytest.raises(ConfigError, match=rf"smollm3-3b-base in .* is at revision f{{40}}, and the catalog pins {pin}: "
                                          r"run `python -m graft_exp.prepare --models smollm3-3b-base` again, or set "
                                          r"models.smollm3-3b-base.revision=f{40}"):
        validate_job(cfg(f"models.smollm3-3b-base.revision={pin}"))
    validate_job(cfg(f"models.smollm3-3b-base.revision={'f' * 40}"))   # told otherwise: that snapshot, its own key
    (models / "smollm3-3b-base" / snapshots.RECORD).unlink()
    with pytest.raises(ConfigError, match="has no record of its revision.*models.smollm3-3b-base.revision=null"):
        validate_job(cfg(f"models.smollm3-3b-base.revision={pin}"))
    validate_job(cfg("models.smollm3-3b-base.revision=null"))
    shutil.rmtree(models / "smollm3-3b-base")   # not prepared: verl would fetch the hub's newest commit
    with pytest.raises(ConfigError, match="revision=0123.* is pinned, but .* holds no prepared snapshot"):
        validate_job(cfg(f"models.smollm3-3b-base.revision={pin}"))
    prepared_problem.cache_clear()


def test_prepare_downloads_the_pinned_revision_records_it_and_checks_the_format(prepared, tmp_path, monkeypatch,
                                                                             capsys):
    """The hub is the one thing replaced: a stand-in ``snapshot_download`` writes the real tokenizer files of the
    model (the prepared stand-ins') into ``local_dir`` and records what it was asked for; prepare passes the catalog's revision, records it beside
    the snapshot, and refuses a snapshot whose tokenizer does not fit the model's format."""
    import shutil

    import huggingface_hub

    from graft_exp import prepare

    asked = []

    def hub(repo_id, revision=None, local_dir=None, **_):
        asked.append((repo_id, revision))
        key = next(k for k, e in prepare.hub_models().items() if e.hf_id == repo_id)
        shutil.copytree(prepared / "models" / key, local_dir, ignore=shutil.ignore_patterns(snapshots.RECORD))
        return local_dir

    monkeypatch.setattr(huggingface_hub, "snapshot_download", hub)
    catalog = OmegaConf.load(MODELS_FILE)
    assert prepare.main(["--sets", "", "--models", ",".join(PAPER_MODELS), "--model-dir", str(tmp_path)]) == 0
    assert asked == [(catalog[k].hf_id, catalog[k].revision) for k in PAPER_MODELS]
    for key in PAPER_MODELS:
        assert snapshots.recorded_revision(tmp_path / key) == catalog[key].revision
    # a snapshot whose tokenizer lacks the format's markers (Qwen's vocabulary where Llama 3's is expected)
    monkeypatch.setattr(prepare, "hub_models", lambda: {"octothinker-3b-hybrid-base": OmegaConf.create(
        {"hf_id": "Qwen/Qwen3-1.7B-Base", "revision": None, "prompt_format": "llama3"})})
    monkeypatch.setattr(huggingface_hub, "snapshot_download", lambda repo_id, local_dir=None, **_: shutil.copytree(
        prepared / "models" / "qwen3-1.7b-base", local_dir, ignore=shutil.ignore_patterns(snapshots.RECORD)))
    assert prepare.main(["--sets", "", "--models", "octothinker-3b-hybrid-base", "--model-dir", str(tmp_path / "x")]) == 2
    assert "prompt format llama3: '<|begin_of_text|>' is not one special token" in capsys.readouterr().err
