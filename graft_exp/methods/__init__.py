"""The method registry: every training method, and the components a method is built from.

A method is a ``conf/method/<name>.yaml`` file (its components and settings over the typed schema,
``config.MethodConfig``) plus one ``declare`` line below (its display name and cost family). Each
config key that names a component (``method.selection``, ``method.admission``, ...) has one table here;
an entry is a factory that receives the method's config, so a rule reads its settings from YAML keys
(the schema's, or its own under ``method.params``, declared at registration). ``resolve`` builds a
method once per job (``Method``: config, components, loss spec); the exchange, the driver and the
backends ask that object instead of comparing names. An unknown name raises ``UnknownName`` with the
valid ones.

Adding a variant is a component here (if it needs a new rule; the rule's math goes to
``graft_exp.algorithms``), its YAML and its ``declare`` line; see README "Adding a method".
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING

from graft_exp.methods.peer_losses import HacpoPeerLoss, NllPeerLoss, PeerLoss
from graft_exp.methods.registry import Registry, RuleParam, UnknownName, fixed

if TYPE_CHECKING:   # the rules import torch when they run: config, tracking and launching stay torch-free
    import torch

    from graft_exp.methods.objective import LossSpec


# ------------------------------------------------------------------------------------ components
#: ``rule(k_a, k_b, n, generator) -> (a_to_b, b_to_a)`` bool [P]: the prompts on which each receiver
#: gets the source's group (k = successes per prompt).
SelectionRule = Callable[["torch.Tensor", "torch.Tensor", int, "torch.Generator"], tuple["torch.Tensor", "torch.Tensor"]]


@dataclass(frozen=True)
class Selection:
    """Which prompts transfer (paper eq. 3 and its variants)."""

    rule: SelectionRule
    transfers: bool = True          # False: nothing transfers (single-model methods)
    every_prompt: bool = False      # every prompt transfers (HACPO): no prompt is singled out
    one_direction_ok: bool = True   # False: the rule balances both directions, so stored replay cannot use it


SELECTIONS = Registry("method.selection")


def _nothing(k_a, k_b, n, generator):
    import torch
    nothing = torch.zeros_like(k_a, dtype=torch.bool)
    return nothing, nothing.clone()


def _every(k_a, k_b, n, generator):
    import torch
    every = torch.ones_like(k_a, dtype=torch.bool)
    return every, every.clone()


def _balanced(k_a, k_b, n, generator):
    from graft_exp.algorithms import balanced_exchange
    return balanced_exchange(k_a, k_b, n)


def _complementary(k_a, k_b, n, generator):
    from graft_exp.algorithms import complementary_candidates
    return complementary_candidates(k_a, k_b, n), complementary_candidates(k_b, k_a, n)


def _rescue(k_a, k_b, n, generator):
    from graft_exp.algorithms import sgt_rescue_prompts
    return sgt_rescue_prompts(k_a, k_b, n)


def _random_prompts(k_a, k_b, n, generator):
    from graft_exp.algorithms import count_matched_random_exchange
    return count_matched_random_exchange(*_balanced(k_a, k_b, n, generator), generator)


SELECTIONS.register("none", fixed(Selection(_nothing, transfers=False)))
#: eq. (3) + SelectWithTies to m = min(|C_AB|, |C_BA|) (GRAFT, sgt_which, hacpo_which)
SELECTIONS.register("balanced", fixed(Selection(_balanced, one_direction_ok=False)))
#: eq. (3) in each direction, unbalanced (stored replay: one direction anyway)
SELECTIONS.register("complementary", fixed(Selection(_complementary)))
#: receiver k = 0 and source k >= 1 (SGT; graft_no_balance)
SELECTIONS.register("rescue", fixed(Selection(_rescue)))
#: as many prompts as ``balanced`` takes, drawn uniformly (App. G)
SELECTIONS.register("random_prompts", fixed(Selection(_random_prompts, one_direction_ok=False)))
#: every prompt (HACPO)
SELECTIONS.register("all", fixed(Selection(_every, every_prompt=True)))


#: eq. (3) from the source's top fraction of prompts by successes, balanced (the worked example of
#: docs/adding-a-method.md)
@SELECTIONS.register("top_fraction", params={"top_fraction": RuleParam(float, 0.0, 1.0)})
def _top_fraction(method):
    """eq. (3) from the source's top ``method.params.top_fraction`` prompts, balanced (§3.1)."""
    fraction = float(method.params.top_fraction)

    def rule(k_a, k_b, n, generator):
        from graft_exp.algorithms.selection import top_fraction_exchange
        return top_fraction_exchange(k_a, k_b, n, fraction)
    return Selection(rule, one_direction_ok=False)   # balanced: stored replay cannot use it


#: ``admit(score [S, n], generator) -> w [S, n]``: weights of transferred responses (0 = removed).
ADMISSIONS = Registry("method.admission")


@ADMISSIONS.register("gate")
def _gated(method):
    """eq. (9): w = 1[s > delta] min(s, 1)."""
    delta = float(method.delta)

    def admit(score, generator):
        from graft_exp.algorithms import compatibility_weight
        return compatibility_weight(score, delta)
    return admit


@ADMISSIONS.register("random")
def _random_admission(method):
    """Count-matched random admission (App. G)."""
    delta = float(method.delta)

    def admit(score, generator):
        from graft_exp.algorithms import random_admission_weights
        return random_admission_weights(score, delta, generator)
    return admit


def ungated(score, generator):
    """Not a config value: what ``method.gate=false`` and peer losses without a gate (LUFFY, HACPO) use."""
    from graft_exp.algorithms import ungated_weight
    return ungated_weight(score)


#: ``keep(w [S, n], rewards [S, n]) -> w``: which transferred responses may carry weight.
PEER_RESPONSES = Registry("method.peer_responses")
PEER_RESPONSES.register("all", fixed(lambda weights, rewards: weights))


def _success_only(weights, rewards):
    from graft_exp.algorithms import success_only_weights
    return success_only_weights(weights, rewards)


PEER_RESPONSES.register("success", fixed(_success_only))


@dataclass(frozen=True)
class Advantages:
    """Whose advantages a transferred group carries: ``assign(receiver, source, selected, eps)`` -> (own
    advantages [P, n], source advantages [P, n], bool [P] whose own group stays)."""

    assign: Callable


def _source_advantages(receiver, source, selected, eps):
    """The source's (eq. 1 on its group); a selected prompt's own group is replaced."""
    return receiver.advantages.clone(), source.advantages.clone(), ~selected


def _pooled_advantages(receiver, source, selected, eps):
    """Recomputed over the receiver's and the source's group together; both stay (App. G)."""
    import torch

    from graft_exp.algorithms import pooled_group_advantages
    own_adv, src_adv, keep_own = _source_advantages(receiver, source, selected, eps)
    chosen = torch.nonzero(selected).flatten().tolist()
    if chosen:
        own_adv[chosen], src_adv[chosen] = pooled_group_advantages(receiver.rewards[chosen], source.rewards[chosen], eps)
        keep_own = torch.ones_like(selected)
    return own_adv, src_adv, keep_own


ADVANTAGES = Registry("method.advantages")
ADVANTAGES.register("source", fixed(Advantages(_source_advantages)))
ADVANTAGES.register("pooled", fixed(Advantages(_pooled_advantages)))

#: The receiver loss of own and peer rows with this importance ratio (an ``objective.OBJECTIVES`` key).
RATIOS = Registry("method.ratio")
RATIOS.register("token", fixed("graft"))             # eq. (7)
RATIOS.register("sequence", fixed("sequence_ratio"))  # App. G ablation


#: ``order(is_peer_group [P], groups_per_minibatch, generator) -> minibatches``: the group indices of each
#: minibatch, in processing order; where the minibatches holding peer groups go.
PEER_POSITIONS = Registry("method.peer_position")


def _peer_last(is_peer_group, groups_per_minibatch, generator):
    """Peer groups in the last minibatches (Alg. 1)."""
    from graft_exp.algorithms import peer_last_minibatches
    return peer_last_minibatches(is_peer_group, groups_per_minibatch, generator)


def _peer_first(is_peer_group, groups_per_minibatch, generator):
    """Peer groups in the first minibatches (App. G)."""
    from graft_exp.algorithms import peer_first_minibatches
    return peer_first_minibatches(is_peer_group, groups_per_minibatch, generator)


def _peer_uniform(is_peer_group, groups_per_minibatch, generator):
    """Peer-last minibatches in a seeded random order (App. G)."""
    from graft_exp.algorithms import uniform_minibatches
    return uniform_minibatches(is_peer_group, groups_per_minibatch, generator)


PEER_POSITIONS.register("last", fixed(_peer_last))
PEER_POSITIONS.register("first", fixed(_peer_first))
PEER_POSITIONS.register("uniform", fixed(_peer_uniform))


@dataclass(frozen=True)
class Source:
    """Where the peer's rollouts come from."""

    replays_log_of: str | None = None   # a single-model method whose logged rollouts are replayed
    two_models_only: str = ""           # why it cannot serve a group of K > 2 ("": it can)


SOURCES = Registry("method.source")
SOURCES.register("online", fixed(Source()))
SOURCES.register("stored", fixed(Source(replays_log_of="grpo_n8",   # App. B "Saved peer logs"
                                        two_models_only="stored replay trains each receiver on one peer's log")))


@dataclass(frozen=True)
class SourceRule:
    """A group of K > 2 (docs/exchange-k.md): which source a receiver takes a prompt from when several offer it.
    ``preference(candidates, offered, scorer)`` -> float64 [K, P], each offering source's preference for each
    prompt; ``algorithms.resolve_sources`` takes the offering source of highest preference, ties drawn uniformly
    (all tied: a uniform draw). Never consulted with two models: no prompt has two sources."""

    preference: Callable


def _by_successes(candidates, offered, scorer):
    """k_S(q), as SelectWithTies ranks candidates."""
    import torch
    return torch.stack([c.k for c in candidates]).double()


def _by_compatibility(candidates, offered, scorer):
    """The mean eq. (8) score of S's group under the receiver, on the prompts with a choice (the extra scoring
    runs only there)."""
    import torch

    from graft_exp.algorithms import compatibility_score
    preference = torch.zeros(offered.shape, dtype=torch.float64)
    contested = offered.sum(dim=0) > 1
    for j, candidate in enumerate(candidates):
        prompts = torch.nonzero(contested & offered[j]).flatten().tolist()
        if prompts:
            recv_sum, recv_count = scorer(prompts, candidate)
            preference[j, prompts] = compatibility_score(
                recv_sum, recv_count, candidate.logp_sum[prompts], candidate.num_tokens[prompts]).double().mean(dim=1)
    return preference


def _no_preference(candidates, offered, scorer):
    """Every offering source alike: a uniform draw."""
    import torch
    return torch.zeros(offered.shape, dtype=torch.float64)


SOURCE_RULES = Registry("method.source_rule")
SOURCE_RULES.register("most_successes", fixed(SourceRule(_by_successes)))
SOURCE_RULES.register("compatibility", fixed(SourceRule(_by_compatibility)))
SOURCE_RULES.register("random", fixed(SourceRule(_no_preference)))


#: How a receiver learns from peer responses: each entry is the behaviour (``graft_exp.methods.peer_losses``).
PEER_LOSSES = Registry("method.peer_loss")
PEER_LOSSES.register("none", fixed(PeerLoss(transfers=False)))
PEER_LOSSES.register("graft", fixed(PeerLoss()))                                       # eq. (10)


@PEER_LOSSES.register("luffy")
def _luffy(method):
    """LUFFY's update (App. B): peer tokens shaped by f(p) = p / (p + ``method.luffy_gamma``), ungated."""
    return PeerLoss(objective="luffy", gated=False, settings={"luffy_gamma": float(method.luffy_gamma)})


@PEER_LOSSES.register("nll")
def _nll(method):
    """SGT (App. B): GRPO plus ``method.sgt_lambda`` x the NLL of one drawn correct peer response."""
    return NllPeerLoss(objective="sgt", settings={"sgt_lambda": float(method.sgt_lambda)})


@PEER_LOSSES.register("hacpo")
def _hacpo(method):
    """HACPO (App. B) with its released clips (``method.hacpo``): the peer clamp's lower bound starts at
    ``peer_clip_init`` = 1 - delta and rises by ``peer_clip_step`` per minibatch."""
    hacpo = method.hacpo
    return HacpoPeerLoss(objective="hacpo", gated=False,
                         two_models_only="its capability-aware advantages pool exactly two models' groups",
                         settings={"self_clip_low": float(hacpo.self_clip_low),
                                   "self_clip_high": float(hacpo.self_clip_high),
                                   "cross_clip_delta": 1.0 - float(hacpo.peer_clip_init),
                                   "cross_clip_step": float(hacpo.peer_clip_step)})


#: GRAFT's receiver with the peer term scaled (the worked example of docs/adding-a-method.md)
@PEER_LOSSES.register("scaled", params={"peer_scale": RuleParam(float, 0.0, 1.0)})
def _scaled(method):
    """eq. (10) with each peer row's weight w(o) scaled by ``method.params.peer_scale``."""
    return PeerLoss(objective="peer_scaled", settings={"peer_scale": float(method.params.peer_scale)})


@dataclass(frozen=True)
class Sampling:
    """How each model's step batch is drawn. ``keep(rewards [P, n]) -> bool [P]``: the groups a batch keeps, the
    batch refilled from further draws until full (DAPO's dynamic sampling); None: the first draw is the batch."""

    keep: Callable | None = None

    @property
    def own_prompts(self) -> bool:
        """Each model draws its own prompts: a refilled batch holds prompts of later draws, which its peers never
        sampled, so no model's rollouts stand beside another's on the same prompts."""
        return self.keep is not None


def _informative_groups(rewards):
    from graft_exp.algorithms import dynamic_sampling_group_mask
    return dynamic_sampling_group_mask(rewards)


SAMPLINGS = Registry("method.sampling")
SAMPLINGS.register("plain", fixed(Sampling()))                          # every method but grpo_ds
SAMPLINGS.register("dynamic", fixed(Sampling(keep=_informative_groups)))  # DAPO: groups with 0 < k < n (App. B)

#: ``cut(batch, copies) -> batch``: what a peer copy longer than the receiver's response limit, in the receiver's
#: tokens, is worth (``copies``: the (prompt, sample) of such copies in ``batch``). Cut at the limit, a copy loses
#: its end of turn and, as a rule, its final answer, yet carries the source's reward and advantage: a correct
#: answer's copy would teach the receiver to run to the limit and not stop. Re-scoring what remains would give the
#: cut reasoning a reward the source's group never had, and change its group's advantages. docs/verl.md.
CUT_COPIES = Registry("method.cut_copies")
CUT_COPIES.register("drop", fixed(lambda batch, copies: batch.without_copies(copies)))   # not transferred
CUT_COPIES.register("train", fixed(lambda batch, copies: batch))   # trained as cut (every run before the setting)

#: Every table of components, in the order ``resolve`` builds them.
COMPONENTS = (SELECTIONS, ADMISSIONS, PEER_RESPONSES, ADVANTAGES, RATIOS, PEER_POSITIONS, SOURCES, SOURCE_RULES,
              PEER_LOSSES, CUT_COPIES, SAMPLINGS)


# ------------------------------------------------------------------------------------ methods
@dataclass(frozen=True)
class Declaration:
    """What the registry says about a method beyond its YAML: how tables name it and what it costs."""

    name: str               # the conf/method file name
    display: str            # the paper's name for it in tables and figures
    cost_family: str        # key of launching.jobs' measured GPU-hours tables


METHODS: dict[str, Declaration] = {}


def declare(name: str, display: str, cost_family: str) -> None:
    if name in METHODS:
        raise ValueError(f"method {name!r} is declared twice")
    METHODS[name] = Declaration(name, display, cost_family)


declare("grpo_n8", "GRPO (n=8)", "grpo_n8")
declare("grpo_n16", "GRPO (n=16)", "grpo_n16")
declare("grpo_n32", "GRPO (n=32)", "grpo_n32")
declare("grpo_ds", "GRPO (n=8) + Dynamic Sampling", "grpo_ds")
declare("hacpo", "HACPO", "hacpo")
declare("sgt", "SGT", "sgt")
declare("graft", "GRAFT", "graft")
declare("graft_stored", "GRAFT w/ stored traj.", "graft_stored")
declare("graft_no_gate", "w/o compatibility gate", "graft")
declare("graft_no_floor", "δ=0 (no floor)", "graft")
declare("graft_no_balance", "w/o balanced exchange", "graft")
declare("graft_seq_ratio", "w/o token-level ratio", "graft")
declare("graft_random_prompts", "random prompts", "graft")
declare("graft_random_admission", "random admission", "graft")
declare("graft_peer_first", "peer minibatches first", "graft")
declare("graft_peer_uniform", "peer minibatches uniform", "graft")
declare("graft_pooled", "pooled with receiver group", "graft")
declare("graft_success_only", "success-only", "graft")
declare("graft_success_only_no_floor", "+ w/o floor", "graft")
declare("hacpo_which", "HACPO + GRAFT which", "hacpo")
declare("sgt_which", "SGT + GRAFT which", "sgt")
declare("graft_luffy", "GRAFT + LUFFY update", "graft")
declare("graft_top_half", "GRAFT, peers' top half", "graft")
declare("graft_peer_half", "GRAFT, peer term halved", "graft")


def declaration(name: str) -> Declaration:
    """The declaration of method ``name`` (UnknownName lists the declared methods)."""
    if name not in METHODS:
        raise UnknownName(f"method={name!r} is not declared in graft_exp/methods/__init__.py; declared: {', '.join(METHODS)}")
    return METHODS[name]


@dataclass(frozen=True)
class Method:
    """A method, resolved once per job (``resolve``): its config, its components, and its loss spec. The
    driver, the exchange and both backends receive this object and ask it what to do."""

    config: object                  # cfg.method
    selection: Selection
    admit: Callable                 # ``admit(score, generator) -> w``: method.admission (used where ``gated``)
    keep: Callable                  # ``keep(w, rewards) -> w``: method.peer_responses
    advantages: Advantages
    objective: str                  # ``objective.OBJECTIVES`` key of the receiver loss
    order: Callable                 # ``order(is_peer_group, groups_per_minibatch, generator)``: method.peer_position
    source: Source
    peer_loss: PeerLoss
    source_rule: SourceRule
    cut_copies: Callable            # ``cut(batch, copies) -> batch``: method.cut_copies
    sampling: Sampling              # method.sampling

    @cached_property
    def loss(self) -> LossSpec:
        """The receiver loss and its settings (``objective.LossSpec``), built on first use: config checks
        resolve methods without importing torch."""
        return self.peer_loss.loss_spec(self)

    @property
    def two_models_only(self) -> str:
        """Why the method cannot co-train a group of K > 2 ("" if it can)."""
        return self.peer_loss.two_models_only or self.source.two_models_only

    @property
    def co_train(self) -> bool:
        """The members train together: the method's peer loss learns from peer responses (GRPO's baselines,
        ``peer_loss: none``, train each model alone); validation holds the selection to the same answer."""
        return self.peer_loss.transfers

    @property
    def gated(self) -> bool:
        """Whether the method's admission (and its floor ``method.delta``) decides the peer weights: a
        co-trained method with ``method.gate`` on whose peer loss takes the gate (LUFFY and HACPO do not)."""
        return self.co_train and self.peer_loss.gated and bool(self.config.gate)

    @property
    def replays_stored_log(self) -> bool:
        return self.source.replays_log_of is not None

    def minibatch_prompts(self, train) -> int:
        """Prompt groups per optimizer minibatch: Table 3's ``train.minibatch_prompts`` (32 of 128), or the
        peer loss's own (HACPO's released 64)."""
        return self.peer_loss.minibatch_prompts(self.config, train)

    def weights(self, score: torch.Tensor, rewards: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        """w(o|q) of the transferred responses ([S, n]): eq. (9), or the variant's rule. 0 = removed."""
        return self.keep((self.admit if self.gated else ungated)(score, generator), rewards)


def check_params(method) -> None:
    """``method.params`` holds exactly the keys the method's components declared, each of the type and in the
    range its rule declared (otherwise UnknownName, naming the keys they read or the range)."""
    declared = {param: table for table in COMPONENTS for param in table.params.get(table.chosen(method), {})}
    given = set(method.get("params") or {})
    unread = sorted(given - set(declared))
    if unread:
        raise UnknownName(f"method.params.{unread[0]} is read by none of {method.name}'s rules; they read: "
                          f"{', '.join(declared) or 'nothing'}")
    missing = [param for param in declared if param not in given]
    if missing:
        table = declared[missing[0]]
        raise UnknownName(f"{table.key}={table.chosen(method)} reads method.params.{missing[0]}; set it in "
                          f"conf/method/{method.name}.yaml (params: {{{missing[0]}: ...}})")
    for param, table in declared.items():
        spec, value = table.params[table.chosen(method)][param], method.params[param]
        if not spec.accepts(value):
            raise UnknownName(f"method.params.{param}={'null' if value is None else value}: "
                              f"{table.key}={table.chosen(method)} needs {spec.describe()}")


def resolve(method) -> Method:
    """The method of a config (``cfg.method``), each component built from it; UnknownName names the bad key
    and the valid values."""
    check_params(method)
    peer_loss, admission, ratio_objective = PEER_LOSSES.build(method), ADMISSIONS.build(method), RATIOS.build(method)
    return Method(config=method, selection=SELECTIONS.build(method), admit=admission,
                  keep=PEER_RESPONSES.build(method), advantages=ADVANTAGES.build(method),
                  objective=peer_loss.objective or ratio_objective,
                  order=PEER_POSITIONS.build(method), source=SOURCES.build(method), peer_loss=peer_loss,
                  source_rule=SOURCE_RULES.build(method), cut_copies=CUT_COPIES.build(method),
                  sampling=SAMPLINGS.build(method))


def co_trains(method) -> bool:
    """``Method.co_train`` of a method's config (``cfg.method``), without building its other components: a run
    key may be asked of a config before its selection rule's ``method.params`` are checked."""
    return PEER_LOSSES.build(method).transfers
