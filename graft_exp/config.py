"""Typed schemas of the config root and the method group, and the validation every job runs before it starts.

The root schema (``config_schema``, first in ``conf/config.yaml``'s defaults) types the top-level
keys, so ``seed=abc`` or ``rerun=maybe`` fails at composition, before any run exists. The method
schema is registered as ``method_schema``; every ``conf/method/*.yaml`` extends it (directly or
through ``graft``), so a misspelt key in a method file or on the command line fails at
composition. ``validate`` then checks the values and the combination (pair x method x backend)
and raises ``ConfigError`` naming the fix.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import tempfile
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf
from omegaconf.errors import InterpolationResolutionError, OmegaConfBaseException

from graft_exp import methods, scheduler
from graft_exp.extras import MissingExtra, require
from graft_exp.hyperparameters import (
    CLIP_HIGH,
    CLIP_LOW,
    CLIP_RATIO_C,
    HACPO_KL_COEF,
    HACPO_MINIBATCH_PROMPTS,
    HACPO_PEER_CLIP_INIT,
    HACPO_PEER_CLIP_STEP,
    HACPO_SELF_CLIP_HIGH,
    HACPO_SELF_CLIP_LOW,
    LUFFY_GAMMA,
    SGT_LAMBDA,
)
from graft_exp.tiny.recipes import RECIPES

BACKENDS = ("local", "verl")
PRECISIONS = ("bf16", "fp16", "fp32")
OPTIMIZERS = ("adamw",)
LOCAL_DEVICES = ("auto", "cpu", "cuda")
LOCAL_SAMPLERS = ("static_cache", "loop")   # graft_exp/backends/local_policy.py
#: The columns of ``python -m graft_exp.prepare``'s Parquet files that verl's dataset and reward read.
PREPARED_COLUMNS = {"data_source", "prompt", "reward_model", "extra_info"}
#: The model catalog: every model a pair may name, with its weights (``hf_id``), display name and positions.
MODELS_FILE = Path(__file__).resolve().parents[1] / "conf" / "catalog" / "models.yaml"
#: The member keys of a pair (A, B) or group (A, B, C, ...): each names a model of conf/catalog/models.yaml.
MEMBER_KEYS = ("A", "B", "C", "D", "E", "F")


class ConfigError(ValueError):
    """A composed configuration that cannot run; the message says what to change."""


#: Field metadata of a setting added after runs were keyed: the value that reproduces the behaviour from before it.
KEY_NEUTRAL = "graft.key_neutral"
_REPRODUCES = object()


def added_setting(reproduces: Any, *, same_as: tuple = (), default: Any = _REPRODUCES,
                  default_factory: Any = None) -> Any:
    """Declare a setting added after runs were recorded (docs/design.md, "Run keys"): it enters
    ``graft.run_key`` only when its value differs from ``reproduces``, the value under which a job computes
    what it computed before the setting existed, and from the values in ``same_as``, which compute the same
    bit for bit another way (a faster kernel of the same arithmetic). Runs already in a store keep their keys;
    a job that uses the new setting gets a key of its own. ``default`` (or ``default_factory``) is the schema
    default, as for ``dataclasses.field``; it is ``reproduces`` unless the YAML sets it."""
    metadata = {KEY_NEUTRAL: (reproduces, *same_as)}
    if default_factory is not None:
        return field(default_factory=default_factory, metadata=metadata)
    return field(default=reproduces if default is _REPRODUCES else default, metadata=metadata)


@dataclass
class HacpoConfig:
    """HACPO's released configuration (paper App. B; official code recipe/hacpo)."""

    self_clip_low: float = HACPO_SELF_CLIP_LOW
    self_clip_high: float = HACPO_SELF_CLIP_HIGH
    peer_clip_init: float = HACPO_PEER_CLIP_INIT      # L_m = min(1, init + step * m)
    peer_clip_step: float = HACPO_PEER_CLIP_STEP
    kl_coef: float = HACPO_KL_COEF
    minibatch_prompts: int = HACPO_MINIBATCH_PROMPTS


@dataclass
class MethodConfig:
    """One training method: GRPO baselines, GRAFT, its Appendix-G variants, HACPO, SGT, LUFFY.

    Defaults are full GRAFT with the paper's settings; each conf/method file changes only the
    components its variant changes.
    """

    name: str = MISSING               # the conf/method file name, e.g. graft_no_gate
    n: int = 8                        # rollouts per prompt per model
    source: str = "online"            # online peer | stored: replay the peer's GRPO n=8 log
    selection: str = "balanced"       # which prompts transfer (eq. 3 + balanced exchange)
    peer_loss: str = "graft"          # how the receiver learns from peer responses
    gate: bool = True                 # compatibility weighting w = 1[s>delta] min(s,1) (eq. 9)
    delta: float = 0.8                # compatibility floor; 0 = no floor
    admission: str = "gate"           # gate | random (count-matched random admission)
    ratio: str = "token"              # token-level ratio (eq. 7) | sequence-level (ablation)
    peer_position: str = "last"       # minibatches containing peer groups: last | first | uniform
    advantages: str = "source"        # source-computed | pooled over receiver + peer group
    peer_responses: str = "all"       # all | success (success-only transfer)
    sampling: str = "plain"           # plain | dynamic (DAPO: drop zero-variance groups, refill the batch)
    clip_low: float = CLIP_LOW
    clip_high: float = CLIP_HIGH
    clip_ratio_c: float = CLIP_RATIO_C
    adv_eps: float = 1e-6
    sgt_lambda: float = SGT_LAMBDA
    luffy_gamma: float = LUFFY_GAMMA
    source_rule: str = "most_successes"   # a group of K > 2: which of several qualifying sources a receiver takes
    # A peer copy longer than the receiver's response limit in its tokens: drop | train (graft_exp.methods.CUT_COPIES).
    # Runs before the setting trained it as cut; transferring methods drop it (conf/method/graft.yaml).
    cut_copies: str = added_setting("train")
    hacpo: HacpoConfig = field(default_factory=HacpoConfig)
    # Settings of rules registered with params=(...); a method without them keys as before params existed.
    params: dict[str, Any] = added_setting({}, default_factory=dict)


@dataclass
class PairConfig:
    """The co-trained models (roles A, B, and C.. for a group, conf/group/), their training data and benchmarks."""

    name: str = MISSING
    A: str = MISSING
    B: str = MISSING
    C: str | None = None              # further members of a group of K > 2 (docs/exchange-k.md)
    D: str | None = None
    E: str | None = None
    F: str | None = None
    data: str = MISSING               # math (prepare.py's Parquet) | tiny_arith (generated)
    benchmarks: list[str] = MISSING   # bench keys of val/<bench> and test/<bench>
    gpus: int = MISSING               # GPUs of one job (the paper: one 4-GPU node); 0 on CPU
    train_size: int | None = None  # tiny_arith: generated training prompts


@dataclass
class TrainConfig:
    """Paper Table 3 (conf/config.yaml); every backend reads the same names."""

    batch_prompts: int = MISSING
    minibatch_prompts: int = MISSING
    ppo_epochs: int = MISSING
    total_epochs: int = MISSING
    max_steps: int | None = None   # null: total_epochs over the training split
    max_gpu_hours: float | None = added_setting(None)   # stop once the job's cost/gpu_hours reaches it
    gpu_hours_of: str | None = added_setting(None)      # a run key: max_gpu_hours = that job's cost/gpu_hours
    max_flops: float | None = added_setting(None)       # stop once the job's counted cost/flops reaches it
    flops_of: str | None = added_setting(None)          # a run key: max_flops = that job's cost/flops
    probe_transfers: bool = added_setting(False)        # sample each receiver again after its update (transfer log)
    optimizer: str = MISSING
    lr: float = MISSING
    lr_warmup_steps: int = MISSING
    betas: list[float] = MISSING
    weight_decay: float = MISSING
    grad_clip: float = MISSING
    max_prompt_length: int = MISSING
    max_response_length: int = MISSING
    temperature: float = MISSING
    top_p: float = MISSING
    kl_coef: float = MISSING
    entropy_coef: float = MISSING
    precision: str = MISSING
    save_every: int = MISSING         # steps between resumable checkpoints (and at the last step)


@dataclass
class EvalConfig:
    """Validation (every val_every steps, best checkpoint by the average) and the final evaluation."""

    val_every: int = MISSING
    val_samples: int = MISSING
    max_problems: int | None = None   # problems per benchmark (null: all)
    runs: int = MISSING
    samples: int = MISSING
    temperature: float = MISSING
    top_p: float = MISSING


@dataclass
class LocalBackendConfig:
    """backend=local (graft_exp/backends/local.py)."""

    name: str = "local"
    device: str = "auto"              # auto | cpu | cuda
    progress: bool = True
    threads: int | None = 1        # torch CPU threads (null: torch's default)
    sampler: str = "static_cache"     # static_cache | loop (one model call per token, the old sampler)
    concurrent: bool = True           # on CPU, each model's phases in a thread of its own (a core each)


@dataclass
class VerlBackendConfig:
    """backend=verl (graft_exp/backends/verl/config.py maps these and train/eval/method to verl's)."""

    name: str = "verl"
    gpus_per_model: int = 2
    rollout_tp: int = 1
    gpu_memory_utilization: float = 0.6
    max_token_len_per_gpu: int = 16384
    gradient_checkpointing: bool = True
    param_offload: bool = False
    optimizer_offload: bool = False
    agent_workers: int = 8
    data_dir: str = MISSING
    model_dir: str = MISSING
    ray_address: str | None = None
    nnodes: int = 1
    verl_overrides: list[str] = field(default_factory=list)
    progress: bool = True
    seeded_requests: bool = added_setting(True)   # a vLLM seed per rollout request (backends/verl/seeded_agent.py)
    # The log-prob pass verl's workers take (backends/verl/logprobs.py; resources.LOGITS_BYTES): chunked |
    # rowwise | flash_attn_ce. The job sets it on its workers, so the plan's activation term is the node's, not
    # the submitting machine's. chunked computes rowwise's values bit for bit: both keep the keys of before.
    logprob_path: str = added_setting("rowwise", same_as=("chunked",), default="chunked")


@dataclass
class RootConfig:
    """The top-level keys of ``conf/config.yaml``: scalars typed here, groups by their schemas (pair,
    train, eval here; method and backend by ``method_schema`` / ``backend_<name>_schema``)."""

    seed: int = MISSING
    study: str = MISSING
    rerun: bool = MISSING
    checkpoint_root: str = MISSING
    compare_to: str | None = None   # the method a multirun's comparison measures the others against
    preflight: bool = False         # a run of python -m graft_exp.preflight: recorded under graft-preflight/<study>
    pair: PairConfig = MISSING
    method: Any = MISSING
    backend: Any = MISSING
    cluster: Any = MISSING
    tracking: Any = MISSING
    models: Any = MISSING
    train: TrainConfig = MISSING
    eval: EvalConfig = MISSING


#: The schema of each group whose type the root leaves open (``Any``), by the name its config selects.
GROUP_SCHEMAS = {"method": lambda name: MethodConfig,
                 "backend": lambda name: {"local": LocalBackendConfig, "verl": VerlBackendConfig}.get(name)}


def key_neutral_settings(resolved: dict) -> dict[tuple[str, ...], tuple]:
    """Every setting declared with ``added_setting`` that ``resolved`` (a resolved config) holds, by its path,
    with the values that reproduce the behaviour from before it existed (``tracking.identity`` drops it
    from the run key at those values)."""
    found: dict[tuple[str, ...], tuple] = {}

    def walk(schema, node: dict, path: tuple[str, ...]) -> None:
        types = typing.get_type_hints(schema)
        for f in dataclasses.fields(schema):
            if KEY_NEUTRAL in f.metadata:
                found[path + (f.name,)] = f.metadata[KEY_NEUTRAL]
            child = node.get(f.name)
            if not isinstance(child, dict):
                continue
            nested = GROUP_SCHEMAS[f.name](child.get("name")) if f.name in GROUP_SCHEMAS else types[f.name]
            if dataclasses.is_dataclass(nested):
                walk(nested, child, path + (f.name,))

    walk(RootConfig, resolved, ())
    return found


def register_schemas() -> None:
    store = ConfigStore.instance()
    store.store(name="config_schema", node=RootConfig)
    # Outside the groups they type (conf files extend them as `/method_schema`, ...), so that neither
    # --help nor tab completion offers them as a method or a backend.
    store.store(name="method_schema", node=MethodConfig)
    store.store(name="backend_local_schema", node=LocalBackendConfig)
    store.store(name="backend_verl_schema", node=VerlBackendConfig)


def roles(pair: DictConfig) -> list[str]:
    """The member roles of a pair or group, in letter order: ``["A", "B"]`` for a pair."""
    return [key for key in MEMBER_KEYS if pair.get(key) is not None]


def peers(pair: DictConfig, role: str) -> list[str]:
    """The other members of ``role``'s pair or group, in letter order."""
    return [other for other in roles(pair) if other != role]


def trained(pair: DictConfig, co_train: bool, unfinished: set[str]) -> list[str]:
    """The members a job trains, given the roles whose model runs are not FINISHED: a single-model job trains those
    (a shared GRPO baseline another job finished is skipped); co-trained models need each other, so all train
    while any is unfinished (a job stopped between their final evaluations). None once every run has finished."""
    return [role for role in roles(pair) if role in unfinished or (co_train and bool(unfinished))]


def total_steps(cfg: DictConfig, num_problems: int) -> int:
    """Training steps of a job: ``train.max_steps``, or ``total_epochs`` passes over the training split of
    whole batches (the last partial batch of an epoch is dropped, as verl's dataloader does: 7,500 MATH
    problems at 128 prompts per step are 58 steps an epoch, 174 in three)."""
    batches_per_epoch = num_problems // int(cfg.train.batch_prompts)
    return int(cfg.train.max_steps or cfg.train.total_epochs * batches_per_epoch)


def minibatch_prompts(cfg: DictConfig) -> int:
    """Prompt groups per optimizer minibatch: Table 3's 32 (of 128), HACPO's released 64."""
    return methods.resolve(cfg.method).minibatch_prompts(cfg.train)


def _choice(value: str, allowed: tuple[str, ...], key: str) -> None:
    if value not in allowed:
        raise ConfigError(f"{key}={value!r} is not one of {', '.join(allowed)}")


def _at_least(node: DictConfig, prefix: str, minimum: int, *keys: str, optional: bool = False) -> None:
    """Counts: ``prefix.key >= minimum`` (``optional``: null is allowed too)."""
    for key in keys:
        value = node[key]
        if value is None and optional:
            continue
        if value is None or value < minimum:
            raise ConfigError(f"{prefix}.{key}={value} must be an integer >= {minimum}"
                              + (" (or null)" if optional else ""))


def _positive(node: DictConfig, prefix: str, *keys: str) -> None:
    for key in keys:
        if not node[key] > 0:
            raise ConfigError(f"{prefix}.{key}={node[key]} must be > 0")


def _non_negative(node: DictConfig, prefix: str, *keys: str) -> None:
    for key in keys:
        if node[key] < 0:
            raise ConfigError(f"{prefix}.{key}={node[key]} must be >= 0")


def _sampling(node: DictConfig, prefix: str) -> None:
    if not node.temperature > 0:
        raise ConfigError(f"{prefix}.temperature={node.temperature} must be > 0 (greedy decoding is not "
                          "supported; the paper samples at 1.0 in training, 0.6 in evaluation)")
    if not 0 < node.top_p <= 1:
        raise ConfigError(f"{prefix}.top_p={node.top_p} must be in (0, 1] (1.0: no nucleus filtering)")


def validate_finite(cfg: DictConfig) -> None:
    """Every number of the settings is finite: ``nan`` and ``inf`` pass Hydra's float type and some range
    checks (``nan < 0`` is false), then poison a loss or a sampler mid-run."""
    def walk(node, prefix: str):
        items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
        for key, value in items:
            where = f"{prefix}.{key}" if isinstance(node, dict) else f"{prefix}[{key}]"
            if isinstance(value, float) and not math.isfinite(value):
                raise ConfigError(f"{where}={value} must be a finite number")
            walk(value, where)

    for group in ("train", "eval", "method", "backend", "pair"):
        walk(OmegaConf.to_container(cfg[group], resolve=True), group)


def validate_tracking(tracking: DictConfig) -> None:
    """The outage settings (docs/tracking.md, "Tracking outages") are seconds: the probe's interval > 0, the wait at
    the job's end >= 0."""
    for key, least, bound in (("outage_probe_s", "> 0", lambda v: v > 0), ("outage_wait_s", ">= 0", lambda v: v >= 0)):
        value = tracking.get(key)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                or not bound(value):
            raise ConfigError(f"tracking.{key}={value} must be a finite number of seconds {least} "
                              f"(conf/tracking/{tracking._name}.yaml sets it)")


def validate_lengths(cfg: DictConfig) -> None:
    """A prompt and its response fit in every member model: ``train.max_prompt_length +
    train.max_response_length`` positions at most (``max_positions`` of conf/catalog/models.yaml). Beyond
    them a learned position table (GPT-2) fails mid-run and rotary models run outside what they saw."""
    train = cfg.train
    longest = int(train.max_prompt_length) + int(train.max_response_length)
    for role in roles(cfg.pair):
        key = cfg.pair[role]
        positions = cfg.models[key].get("max_positions")
        if positions is not None and longest > positions:
            raise ConfigError(
                f"train.max_prompt_length={train.max_prompt_length} + train.max_response_length="
                f"{train.max_response_length} = {longest} tokens, but {key} holds {positions} positions "
                f"(models.{key}.max_positions): lower train.max_response_length to at most "
                f"{max(positions - int(train.max_prompt_length), 0)} (or train.max_prompt_length)")


def validate_train_eval(cfg: DictConfig) -> None:
    """The domains of ``train.*`` and ``eval.*``: counts >= 1, rates > 0, probabilities in their range,
    batch sizes that divide into minibatches."""
    train, ev = cfg.train, cfg.eval
    _at_least(train, "train", 1, "batch_prompts", "minibatch_prompts", "ppo_epochs", "total_epochs",
              "max_prompt_length", "max_response_length", "save_every")
    _at_least(train, "train", 1, "max_steps", optional=True)
    _at_least(train, "train", 0, "lr_warmup_steps")
    validate_budget(train)
    _positive(train, "train", "lr", "grad_clip")
    _non_negative(train, "train", "weight_decay", "kl_coef", "entropy_coef")
    if len(train.betas) != 2 or not all(0 <= b < 1 for b in train.betas):
        raise ConfigError(f"train.betas={list(train.betas)} must be two values in [0, 1), e.g. [0.9,0.999]")
    _sampling(train, "train")
    _choice(train.precision, PRECISIONS, "train.precision")
    _choice(train.optimizer, OPTIMIZERS, "train.optimizer")
    if train.batch_prompts % train.minibatch_prompts:
        raise ConfigError(
            f"train.batch_prompts={train.batch_prompts} is not a multiple of "
            f"train.minibatch_prompts={train.minibatch_prompts}"
        )
    _at_least(ev, "eval", 1, "val_every", "val_samples", "runs", "samples")
    _at_least(ev, "eval", 1, "max_problems", optional=True)
    _sampling(ev, "eval")
    if cfg.pair.train_size is not None and cfg.pair.train_size < train.batch_prompts:
        raise ConfigError(f"pair.train_size={cfg.pair.train_size} is smaller than train.batch_prompts="
                          f"{train.batch_prompts}: an epoch would have no full batch")


#: An equal-compute budget's unit -> (its amount's setting, its reference run's setting) under ``train``; the
#: units are ``schema.CHARGES``' (GPU-hours as App. D measures them, FLOPs as ``costs.ModelFlops`` counts them).
BUDGET_SETTINGS = {"gpu_hours": ("max_gpu_hours", "gpu_hours_of"), "flops": ("max_flops", "flops_of")}
#: The same settings as flattened config keys (a job run's params).
BUDGET_KEYS = tuple(f"train.{name}" for names in BUDGET_SETTINGS.values() for name in names)


def budget_setting(train: DictConfig) -> tuple[str, str, Any] | None:
    """The one budget setting a job sets: (unit, setting name, value), or None without a budget."""
    for unit, names in BUDGET_SETTINGS.items():
        for name in names:
            if train.get(name) is not None:
                return unit, name, train[name]
    return None


def validate_budget(train: DictConfig) -> None:
    """An equal-compute budget: one positive amount or one reference run's key, in one unit."""
    given = [f"train.{name}={train[name]}" for names in BUDGET_SETTINGS.values() for name in names
             if train.get(name) is not None]
    if len(given) > 1:
        raise ConfigError(f"{' and '.join(given)} all set the budget; keep one of them (a budget is spent in "
                          "one charge: GPU-hours or counted FLOPs)")
    found = budget_setting(train)
    if found is None:
        return
    unit, name, value = found
    if name.startswith("max_") and not (isinstance(value, (int, float)) and value > 0):
        raise ConfigError(f"train.{name}={value} must be > 0 {'GPU-hours' if unit == 'gpu_hours' else 'FLOPs'} "
                          "(or null: no budget, train.max_steps alone ends the run)")
    if name.endswith("_of") and not str(value).strip():
        raise ConfigError(f"train.{name} is empty; give the run key (graft.run_key) of the reference job")


def validate_method(cfg: DictConfig) -> None:
    """The method's own settings and how its components combine (pair and backend aside)."""
    method = cfg.method
    if method.n < 2:
        raise ConfigError(f"method.n={method.n}: GRPO needs at least 2 rollouts per prompt (n >= 2)")
    if not 0.0 <= method.delta <= 1.0:
        raise ConfigError(f"method.delta={method.delta} is outside [0, 1]; the paper uses {MethodConfig.delta}")
    if method.clip_low < 0 or method.clip_high < 0 or method.clip_low >= 1:
        raise ConfigError(
            f"clip range (1-{method.clip_low}, 1+{method.clip_high}) is invalid; "
            "need 0 <= method.clip_low < 1 and method.clip_high >= 0"
        )
    if not method.clip_ratio_c > 1:
        raise ConfigError(f"method.clip_ratio_c={method.clip_ratio_c} must be > 1 (verl's dual clip; 3.0)")
    if method.adv_eps <= 0:
        raise ConfigError(f"method.adv_eps={method.adv_eps} must be > 0 (paper: 1e-6)")
    _non_negative(method, "method", "sgt_lambda")
    _positive(method, "method", "luffy_gamma")
    hacpo = method.hacpo
    _positive(hacpo, "method.hacpo", "self_clip_low", "self_clip_high")
    _non_negative(hacpo, "method.hacpo", "peer_clip_step", "kl_coef")
    if not 0 <= hacpo.peer_clip_init <= 1:
        raise ConfigError(f"method.hacpo.peer_clip_init={hacpo.peer_clip_init} is outside [0, 1] (released: 0.8)")
    try:
        methods.declaration(method.name)
        spec = methods.resolve(method)
    except methods.UnknownName as err:
        raise ConfigError(str(err)) from err
    if spec.selection.transfers != spec.peer_loss.transfers:
        raise ConfigError(
            f"method {method.name!r}: selection={method.selection!r} but peer_loss={method.peer_loss!r}; a "
            "single-model method needs selection=none and peer_loss=none, a co-trained method needs both set"
        )
    if spec.co_train and spec.sampling.own_prompts:
        raise ConfigError(f"method.sampling={method.sampling} is a single-model GRPO baseline (grpo_ds); "
                          "it cannot be combined with trajectory exchange")
    if spec.replays_stored_log and not spec.selection.one_direction_ok:
        raise ConfigError(
            f"stored-trajectory replay transfers in one direction only, so method.selection={method.selection} "
            "is inactive: set method.selection=complementary (as conf/method/graft_stored.yaml does)"
        )
    # HACPO's released 64-prompt minibatches: a smaller batch (the tiny pair's 16) is one minibatch.
    _at_least(hacpo, "method.hacpo", 1, "minibatch_prompts")
    members = len(roles(cfg.pair))
    if members > 2 and spec.two_models_only:
        raise ConfigError(f"method={method.name} trains exactly two models ({spec.two_models_only}); "
                          f"{cfg.pair.name} has {members}: use a pair (pair=...), or method=graft or sgt")


def backend_installed(cfg: DictConfig) -> None:
    """The backend's optional packages (graft_exp.extras): ``backend=verl`` needs the ``verl`` extra where the job
    trains. A login node that submits to Slurm needs only the base install (and ``prepare``'s, to prepare): the job
    checks again in its own process on the node, before anything starts there."""
    if cfg.backend.name == "verl" and trains_here(cfg):
        try:
            require("backend=verl")
        except MissingExtra as err:
            raise ConfigError(f"{err}; or use backend=local with pair=tiny") from None


def validate_backend(cfg: DictConfig) -> None:
    """Pair x backend combinations that can run, and the backend's own keys."""
    backend, pair, train = cfg.backend, cfg.pair, cfg.train
    _choice(backend.name, BACKENDS, "backend")
    members = roles(pair)
    tiny_models = [pair[role] for role in members if cfg.models[pair[role]].hf_id is None]
    if backend.name == "local":
        if pair.data != "tiny_arith" or len(tiny_models) < len(members):
            raise ConfigError(f"backend=local trains the tiny models on the generated task (pair=tiny); "
                              f"pair={pair.name} needs GPUs: use backend=verl")
        chat = [key for key in tiny_models if key not in RECIPES]
        if chat:
            raise ConfigError(f"backend=local trains the tiny models in their own prompt format; {chat[0]} is "
                              f"prompted through a chat template, which verl renders: use backend=verl")
        _choice(backend.device, LOCAL_DEVICES, "backend.device")
        _choice(backend.sampler, LOCAL_SAMPLERS, "backend.sampler")
        _at_least(backend, "backend", 1, "threads", optional=True)
        # Settings this backend cannot honour are refused rather than ignored.
        if train.precision != "fp32":
            raise ConfigError(f"train.precision={train.precision} is not supported by backend=local, which "
                              "trains in fp32: set train.precision=fp32 (or use backend=verl)")
        if train.optimizer != "adamw":
            raise ConfigError(f"train.optimizer={train.optimizer} is not supported by backend=local: "
                              "set train.optimizer=adamw")
        for key in ("kl_coef", "entropy_coef"):   # the paper's 0; HACPO's own KL is method.hacpo.kl_coef
            if train[key] != 0:
                raise ConfigError(f"train.{key}={train[key]} is not supported by backend=local (no {key[:-5]} "
                                  f"term in its loss): set train.{key}=0, or use backend=verl")
    else:
        if pair.gpus < 1:
            raise ConfigError(
                f"backend=verl runs on GPU nodes; pair={pair.name} is the CPU test bed. "
                "Use backend=local, or pair=pair1|pair2|pair3"
            )
        if tiny_models:
            raise ConfigError(f"backend=verl trains Hugging Face models; {', '.join(tiny_models)} is built by "
                              "graft_exp.tiny for backend=local: use backend=local with pair=tiny")
        _at_least(backend, "backend", 1, "gpus_per_model", "rollout_tp", "max_token_len_per_gpu",
                  "agent_workers", "nnodes")
        needed = len(members) * backend.gpus_per_model   # one resource pool per member
        if needed > pair.gpus:
            raise ConfigError(f"backend.gpus_per_model={backend.gpus_per_model} for {len(members)} models needs "
                              f"{needed} GPUs but pair.gpus={pair.gpus}: lower "
                              "backend.gpus_per_model or raise pair.gpus")
        if backend.gpus_per_model % backend.rollout_tp:
            raise ConfigError(f"backend.gpus_per_model={backend.gpus_per_model} is not a multiple of "
                              f"backend.rollout_tp={backend.rollout_tp}")
        if not 0 < backend.gpu_memory_utilization <= 1:
            raise ConfigError(f"backend.gpu_memory_utilization={backend.gpu_memory_utilization} must be in (0, 1]")
        for key in ("kl_coef", "entropy_coef"):   # every verl update goes through graft_exp's loss
            if train[key] != 0:
                raise ConfigError(f"train.{key}={train[key]} is not supported by backend=verl: graft_exp's loss, "
                                  f"which every method trains with, has no {key[:-5]} term (HACPO's KL is "
                                  f"method.hacpo.kl_coef): set train.{key}=0")
        if pair.data != "math":
            raise ConfigError(f"backend=verl trains on MATH; pair.data={pair.data!r} has no prepared Parquet")


def prepared_data(cfg: DictConfig) -> None:
    """backend=verl reads what ``python -m graft_exp.prepare`` wrote under ``backend.data_dir``."""
    if cfg.backend.name != "verl":
        return
    data = Path(cfg.backend.data_dir)
    missing = [str(data / f) for f in ("math/train.parquet", *(f"{b}/test.parquet" for b in cfg.pair.benchmarks))
               if not (data / f).is_file()]
    if missing:
        raise ConfigError(f"backend.data_dir={cfg.backend.data_dir} lacks {', '.join(missing)}: run "
                          "`python -m graft_exp.prepare` first, or point backend.data_dir "
                          "(GRAFT_DATA_DIR) at its output")
    import pyarrow.parquet as pq

    for name in ("math/train.parquet", *(f"{b}/test.parquet" for b in cfg.pair.benchmarks)):
        try:   # the footer only: a truncated or foreign file fails here, not in verl's dataloader mid-job
            columns = set(pq.read_schema(data / name).names)
        except (OSError, ValueError) as err:
            raise ConfigError(f"backend.data_dir: {data / name} is not a readable Parquet file ({err}); run "
                              "`python -m graft_exp.prepare` again") from None
        if not PREPARED_COLUMNS <= columns:
            raise ConfigError(f"backend.data_dir: {data / name} lacks the columns "
                              f"{', '.join(sorted(PREPARED_COLUMNS - columns))} that verl reads; it was not "
                              "written by `python -m graft_exp.prepare`: run it again")


def folder_problem(folder: str | Path) -> str | None:
    """Why ``folder`` cannot be (or become) a directory this process writes in, or None; creates nothing.
    Every folder a user names (checkpoint root, prepare's data and model folders, the server's folder)."""
    existing = Path(folder).expanduser().absolute()
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        return f"{existing} is a file, not a directory"
    try:   # os.access says yes to root everywhere, also on read-only mounts: try it
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as err:
        return f"cannot write in {existing} ({err.strerror})"
    return None


def validate_checkpoint_root(root: str) -> None:
    """The checkpoint root is (or can become) a writable directory; nothing is created here."""
    problem = folder_problem(root)
    if problem:
        raise ConfigError(f"checkpoint_root={root}: {problem}; set checkpoint_root (or GRAFT_CHECKPOINT_ROOT) "
                          "to a directory you can write")


def validate(cfg: DictConfig) -> None:
    """Check one composed job config; raise ConfigError with the override that fixes it.
    Nothing here touches the tracking store or the file system beyond reading it."""
    try:
        uri = cfg.tracking.uri
    except InterpolationResolutionError as err:
        raise ConfigError(f"tracking={cfg.tracking._name} needs MLFLOW_TRACKING_URI, e.g. "
                          "export MLFLOW_TRACKING_URI=http://host:5000 (or use tracking=sqlite)") from err
    if not uri:
        raise ConfigError("tracking.uri is empty; set MLFLOW_TRACKING_URI or tracking.uri")
    validate_tracking(cfg.tracking)
    pair, models = cfg.pair, cfg.models
    members = roles(pair)
    if members != list(MEMBER_KEYS[:len(members)]):
        raise ConfigError(f"{pair.name} sets members {', '.join(members)}: members are consecutive letters "
                          f"from A (set pair.{MEMBER_KEYS[len(members) - 1]} or remove the later ones)")
    for role in members:
        key = pair[role]
        if key not in models:
            raise ConfigError(
                f"pair.{role}={key!r} is not a known model; choose one of {', '.join(models)} "
                "(conf/catalog/models.yaml)"
            )
    keys = [pair[role] for role in members]
    twice = sorted({key for key in keys if keys.count(key) > 1})
    if twice:
        raise ConfigError(f"{pair.name} names {twice[0]!r} twice; co-trained models must be different models")
    if cfg.seed < 0:
        raise ConfigError(f"seed={cfg.seed} must be >= 0")
    if cfg.get("compare_to") is not None and cfg.compare_to not in methods.METHODS:
        raise ConfigError(f"compare_to={cfg.compare_to} is not a method; choose one of "
                          f"{', '.join(sorted(methods.METHODS))} (or null: grpo_n8 where it ran, else the first)")
    if not str(cfg.study).strip():
        raise ConfigError("study is empty; name the study (MLflow experiment graft/<study>), e.g. study=default")
    validate_finite(cfg)
    validate_train_eval(cfg)
    validate_lengths(cfg)
    validate_method(cfg)
    validate_backend(cfg)
    validate_prompt_formats(cfg)


#: verl settings that are one model's, which ``backend.verl_overrides`` (merged into every member's config) must not
#: set for all of them -> the setting that chooses them per model.
PER_MODEL_VERL_KEYS = {"actor_rollout_ref.model.custom_chat_template": "models.<key>.prompt_format=<name> "
                                                                        "(docs/verl.md, Prompt formats)",
                       "actor_rollout_ref.model.path": "backend.model_dir or the catalog's hf_id"}


def verl_overrides(backend: DictConfig) -> DictConfig:
    """``backend.verl_overrides`` as a config (dotted keys), or ConfigError in one line: a value that does not
    parse, or a key that is one model's (``PER_MODEL_VERL_KEYS``)."""
    import yaml

    overrides = [str(o) for o in backend.get("verl_overrides") or []]
    for override in overrides:
        key = override.split("=", 1)[0].strip()
        for per_model, instead in PER_MODEL_VERL_KEYS.items():
            if key == per_model or key.startswith(per_model + "."):
                raise ConfigError(f"backend.verl_overrides sets {per_model} for every model of the job; it is each "
                                  f"model's own: use {instead}")
    try:
        return OmegaConf.from_dotlist(overrides)
    except (ValueError, yaml.YAMLError, OmegaConfBaseException) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ConfigError(f"backend.verl_overrides={overrides} does not parse as dotted key=value settings "
                          f"({first}); quote values with spaces or braces, one setting per item") from None


def validate_prompt_formats(cfg: DictConfig) -> None:
    """Each member's ``prompt_format`` names a format of the catalog; on ``backend=verl`` a hub model must name one
    (the job never prompts in whatever template a snapshot happens to carry); ``backend.verl_overrides`` parse."""
    from graft_exp.prompts import UnknownFormat, model_override, prompt_format

    for role in roles(cfg.pair):
        key = str(cfg.pair[role])
        name = cfg.models[key].get("prompt_format")
        if name is not None:
            try:
                prompt_format(name, key)
            except UnknownFormat as err:
                raise ConfigError(str(err)) from None
        elif cfg.backend.name == "verl" and cfg.models[key].hf_id:
            raise ConfigError(f"models.{key}.prompt_format is null, and backend=verl prompts a hub model in a pinned "
                              f"format only: set {model_override(key, 'prompt_format', '<name>')} "
                              "(conf/catalog/prompt_formats.yaml)")
    if cfg.backend.name == "verl":
        verl_overrides(cfg.backend)


def available_devices(cfg: DictConfig) -> None:
    """The devices a job that trains in this process asks for exist here: ``backend.device=cuda``, and
    ``backend=verl`` under ``cluster=local`` (its Ray starts on this machine unless ``backend.ray_address``
    names a cluster) needs ``pair.gpus`` GPUs. Jobs submitted elsewhere (Slurm) are checked where they run."""
    backend = cfg.backend
    wants_cuda = backend.name == "local" and backend.device == "cuda"
    local_verl = backend.name == "verl" and cfg.cluster.name == "local" and not backend.ray_address
    if not (wants_cuda or local_verl):
        return
    import torch  # only here: most launches never ask, and torch takes seconds to import

    found = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if wants_cuda and not found:
        raise ConfigError("backend.device=cuda but this machine has no CUDA GPU (torch.cuda.is_available() "
                          "is False): set backend.device=auto (or cpu), or run on a GPU machine")
    if local_verl and found < cfg.pair.gpus:
        raise ConfigError(f"backend=verl with cluster=local trains here, and pair.gpus={cfg.pair.gpus} but this "
                          f"machine has {found} CUDA GPU(s): submit with cluster=slurm (python -m graft_exp -m "
                          "cluster=slurm ...), or set backend.ray_address to a Ray cluster with the GPUs")


@functools.lru_cache(maxsize=64)
def prepared_problem(folder: str, key: str, revision: str | None, format_name: str | None) -> str | None:
    """Why the prepared snapshot ``folder`` of model ``key`` is not the catalog's (``snapshots.check_prepared``:
    its revision, its prompt format against its real tokenizer), or None; once per model in a process (every job
    of a sweep asks)."""
    from graft_exp import snapshots

    try:
        snapshots.check_prepared(Path(folder), key, {"revision": revision, "prompt_format": format_name})
    except ValueError as err:
        return str(err)
    return None


def trains_here(cfg: DictConfig) -> bool:
    """Whether this process trains the job (in-process launch, or the job's own process inside a Slurm
    allocation), as opposed to submitting it."""
    return cfg.cluster.name == "local" or scheduler.slurm_job_id() is not None


def prepared_models(cfg: DictConfig) -> None:
    """backend=verl trains each model from its prepared snapshot (``backend.model_dir/<key>``) at the catalog's
    revision, prompted in its format (``snapshots.check_prepared``). A model not prepared is fetched from the hub
    by verl at its newest commit: refused where the catalog pins a revision; where the job trains (``trains_here``),
    its format is checked against the hub's tokenizer."""
    if cfg.backend.name != "verl":
        return
    for role in roles(cfg.pair):
        key = str(cfg.pair[role])
        entry = cfg.models[key]
        folder = Path(cfg.backend.model_dir) / key
        if folder.is_dir():
            problem = prepared_problem(str(folder.resolve()), key, entry.get("revision"), entry.get("prompt_format"))
            if problem:
                raise ConfigError(problem)
        elif entry.get("revision"):
            from graft_exp.prompts import model_override

            raise ConfigError(f"models.{key}.revision={entry.revision} is pinned, but {folder} holds no prepared "
                              f"snapshot (verl would fetch {entry.hf_id} at the hub's newest commit): run `python -m "
                              f"graft_exp.prepare --models {key}` and point backend.model_dir (GRAFT_MODEL_DIR) at "
                              f"its output, or set {model_override(key, 'revision', 'null')}")
        elif entry.hf_id and trains_here(cfg):
            from transformers import AutoTokenizer

            from graft_exp import snapshots

            try:
                snapshots.check_tokenizer(AutoTokenizer.from_pretrained(entry.hf_id), key, entry.prompt_format,
                                          entry.hf_id)
            except (OSError, ValueError) as err:
                raise ConfigError(str(err).splitlines()[0]) from None


#: The flash-attention verl's FSDP engine loads on GPUs (not in the ``verl`` extra: it builds against the node's CUDA).
FLASH_ATTN = "flash-attn==2.8.3"


def node_packages(cfg: DictConfig) -> None:
    """Where a ``backend=verl`` job trains on GPUs, the packages its engines load beyond the ``verl`` extra:
    flash-attention 2, which verl's FSDP engine loads every model with (``HFModelConfig``'s default
    ``attn_implementation``) and whose cross-entropy ``backend.logprob_path=flash_attn_ce`` takes."""
    if cfg.backend.name != "verl" or not trains_here(cfg):
        return
    import importlib.util

    import torch

    if importlib.util.find_spec("flash_attn") is not None:
        return
    if torch.cuda.is_available():
        raise ConfigError("flash-attn is not installed where this job trains, and verl's FSDP engine loads every "
                          f"model with flash_attention_2 on GPUs: pip install {FLASH_ATTN} --no-build-isolation "
                          "in the job's environment (docs/verl.md, Install)")
    if cfg.backend.logprob_path == "flash_attn_ce":
        raise ConfigError("backend.logprob_path=flash_attn_ce needs flash-attn where the job trains, and it is not "
                          "installed here: use backend.logprob_path=chunked (the default)")


def validate_environment(cfg: DictConfig) -> None:
    """What a valid config needs of the machine it runs on: the backend's packages, its devices, its
    prepared data and models, a writable checkpoint root. Reads only; nothing is created."""
    backend_installed(cfg)
    available_devices(cfg)
    prepared_data(cfg)
    prepared_models(cfg)
    node_packages(cfg)
    validate_checkpoint_root(str(cfg.checkpoint_root))
    try:
        scheduler.job_cores()   # the local backend's concurrent models read it
    except ValueError as err:
        raise ConfigError(str(err)) from None


def validate_job(cfg: DictConfig) -> None:
    """Everything checked before a job's run exists: the config (``validate``), then this machine."""
    validate(cfg)
    validate_environment(cfg)
