"""How a receiver learns from peer responses (``method.peer_loss``): each registered entry is the behaviour.

An entry builds the receiver's batch from its own and the source's rollouts (``assemble``: which rows stay, their
advantages and weights, how they group for minibatches), names its loss and that loss's own settings
(``objective``, ``settings``: ``loss_spec``), its minibatch size and clip range, what it receives beside the
selected prompts (``receive``) and what it tracks across steps (``capability_ratios``). The exchange, the driver,
the objective and both backends call these and branch on no peer loss's name or flag.

    PeerLoss        GRAFT's (eq. 10): selected groups replaced by the source's, gated (eq. 9); LUFFY's update too
    NllPeerLoss     SGT (App. B): own groups untouched, plus the NLL of one drawn correct peer response
    HacpoPeerLoss   HACPO (App. B): own and peer groups pooled on every prompt, capability-aware advantages

Torch-free at import (config validation resolves methods): torch and the rules are imported where they run.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from graft_exp.methods.receiver import PEER, SELF, ReceiverBatch, Row

if TYPE_CHECKING:
    import torch

    from graft_exp.methods.objective import LossSpec
    from graft_exp.methods.receiver import Scorer
    from graft_exp.rollouts import Rollouts


@dataclass(frozen=True)
class PeerLoss:
    """GRAFT's receiver (eq. 10, Alg. 1 "Replace selected groups using the original source rollouts"): on a
    selected prompt the receiver's own group is replaced by the source's whole group, each response weighted
    by the method's admission (eq. 9; w = 0 removes it), with the method's advantages (the source's, or pooled
    with the receiver's group, App. G). With ``objective="luffy"`` and no gate it is LUFFY's update (App. B).
    The entry's factory (``methods.PEER_LOSSES``) reads the objective's own numbers from the method's config into
    ``settings`` (a config key such as ``method.luffy_gamma``, or a ``method.params`` value it declared)."""

    objective: str | None = None    # ``objective.OBJECTIVES`` key; None: method.ratio's (GRAFT's loss)
    settings: dict[str, float] = field(default_factory=dict)   # the objective's own numbers (``LossSpec.settings``)
    transfers: bool = True          # False: no peer responses are learned from (single-model GRPO)
    gated: bool = True              # the method's admission applies (False: every response, w = 1)
    two_models_only: str = ""       # why it cannot serve a group of K > 2 ("": it can)
    groups_per_prompt: int = 1      # groups a prompt's rows form in the receiver batch
    # ``assemble`` first scores the source's groups on the selected prompts (what a pair's receivers do at the same
    # time: ``exchange.scored_at_once``); False: it scores nothing while assembling (SGT scores its NLL rows later)
    scores_selected: bool = True

    # ---------------------------------------------------------------- settings the rest of the code asks for
    def loss_spec(self, method) -> LossSpec:
        """The receiver loss and its settings for a resolved method (``methods.Method.loss``)."""
        from graft_exp.methods.objective import LossSpec
        config = method.config
        return LossSpec(kind=method.objective, clip_low=float(config.clip_low), clip_high=float(config.clip_high),
                        clip_ratio_c=float(config.clip_ratio_c), kl_coef=self.kl_coef(config),
                        settings=dict(self.settings))

    def kl_coef(self, config) -> float:
        """The coefficient of a KL term to the initial policy (0: none, no reference model)."""
        return 0.0

    def minibatch_prompts(self, config, train) -> int:
        """Prompt groups per optimizer minibatch: Table 3's ``train.minibatch_prompts`` (32 of 128)."""
        return int(train.minibatch_prompts)

    def clip_range(self, config) -> tuple[float, float]:
        """The own rows' clip range (1 - low, 1 + high) as verl's actor config carries it."""
        return float(config.clip_low), float(config.clip_high)

    def receiver_groups(self, batch_prompts: int) -> int:
        """Groups a receiver batch of ``batch_prompts`` prompts holds (optimizer minibatches are cut from them)."""
        return batch_prompts * self.groups_per_prompt

    # ---------------------------------------------------------------- the step
    def capability_ratios(self, history: dict[str, list[float]], own: dict[str, Rollouts],
                          peer_of: dict[str, str]) -> dict[str, float]:
        """What the loss tracks across steps, as each receiver's ratio to its peer (1.0: nothing tracked).
        ``history[role]``: the tracker's per-step values so far (checkpointed by the driver)."""
        return dict.fromkeys(own, 1.0)

    def receive(self, method, receiver: str, peers: list[str], offers: dict, ratios: dict[str, float]):
        """Before the receiver's source is chosen: what ``assemble`` needs beyond the selected prompts (None), and
        the selection's ``offers[(source, receiver)]`` as this loss takes them (as offered)."""
        return

    def assemble(self, method, receiver: Rollouts, source: Rollouts, selected: torch.Tensor, scorer: Scorer,
                 generator: torch.Generator, received=None) -> ReceiverBatch:
        """The receiver's training batch. ``selected`` bool [P]: the prompts whose source group it takes."""
        import torch

        from graft_exp.algorithms import compatibility_score
        prompts, n = receiver.rewards.shape
        chosen = torch.nonzero(selected).flatten().tolist()
        metrics = {"peer_groups": float(len(chosen)), "peer_admitted": 0.0}
        score = torch.zeros(len(chosen), n)
        if chosen:
            recv_sum, recv_count = scorer(chosen, source)
            score = compatibility_score(recv_sum, recv_count, source.logp_sum[chosen], source.num_tokens[chosen])
            metrics["compat_mean"] = float(score.mean())
        weights = method.weights(score, source.rewards[chosen], generator)
        own_adv, src_adv, keep_own = self.advantages(method, receiver, source, selected, received)
        # A replaced (or pooled) group keeps its prompt's slot; with two groups per prompt (HACPO) own groups are
        # 0..P-1 and peer groups P..2P-1, minibatched apart.
        group_is_peer = torch.zeros(self.groups_per_prompt * prompts, dtype=torch.bool)
        rows = []
        peer_of = {q: j for j, q in enumerate(chosen)}
        for q in range(prompts):
            if keep_own[q]:
                rows += [Row(q, SELF, q, i, float(own_adv[q, i]), 1.0) for i in range(n)]
            if q in peer_of:
                group = (self.groups_per_prompt - 1) * prompts + q
                group_is_peer[group] = True
                j = peer_of[q]
                rows += [Row(group, PEER, q, i, float(src_adv[q, i]), float(weights[j, i]))
                         for i in range(source.n) if weights[j, i] > 0]
        metrics["peer_admitted"] = float((weights > 0).sum())
        return ReceiverBatch(rows, group_is_peer, [], metrics)

    def advantages(self, method, receiver: Rollouts, source: Rollouts, selected: torch.Tensor, received):
        """(own advantages [P, n], source advantages [P, n], bool [P] whose own group stays): the method's
        ``method.advantages`` rule."""
        return method.advantages.assign(receiver, source, selected, float(method.config.adv_eps))


@dataclass(frozen=True)
class NllPeerLoss(PeerLoss):
    """SGT (App. B): the receiver's own groups untouched, plus the NLL of one uniformly drawn correct peer
    response on each selected prompt. It is GRPO plus that term: its minibatches keep GRPO's order (no group
    counts as peer for the packing)."""

    scores_selected: bool = False

    def assemble(self, method, receiver, source, selected, scorer, generator, received=None) -> ReceiverBatch:
        import torch

        from graft_exp.algorithms import draw_one_correct_response
        prompts, n = receiver.rewards.shape
        chosen = torch.nonzero(selected).flatten().tolist()
        draw = draw_one_correct_response(source.rewards, selected, generator)
        nll = [(q, int(draw[q])) for q in chosen]
        rows = [Row(q, SELF, q, i, float(receiver.advantages[q, i]), 1.0) for q in range(prompts) for i in range(n)]
        metrics = {"peer_groups": float(len(chosen)), "peer_admitted": float(len(nll))}
        return ReceiverBatch(rows, torch.zeros_like(selected), nll, metrics)


@dataclass(frozen=True)
class HacpoPeerLoss(PeerLoss):
    """HACPO (App. B, its released code): own and peer groups both stay on every prompt, in separate groups
    (own 0..P-1, peer P..2P-1), with capability-aware advantages over the pooled 2n responses from a tracker of
    each model's positive rate; its own minibatch size and self-ratio clip, and a KL term to the initial policy
    (verl's reference model). With a selection that singles prompts out (``hacpo_which``) the peer advantages
    stay only on the prompts it selected."""

    groups_per_prompt: int = 2

    def kl_coef(self, config) -> float:
        return float(config.hacpo.kl_coef)

    def minibatch_prompts(self, config, train) -> int:
        """HACPO's released 64-prompt minibatches (``method.hacpo.minibatch_prompts``)."""
        return int(config.hacpo.minibatch_prompts)

    def clip_range(self, config) -> tuple[float, float]:
        return float(config.hacpo.self_clip_low), float(config.hacpo.self_clip_high)

    def capability_ratios(self, history, own, peer_of):
        """Each receiver's capability ratio of its peer to itself, from each model's positive rates so far (this
        step's appended to ``history``)."""
        from graft_exp.algorithms import hacpo_capability, hacpo_capability_ratio, hacpo_positive_rate
        for role, rates in history.items():
            rates.append(float(hacpo_positive_rate(own[role].rewards)))
        capability = {role: hacpo_capability(rates) for role, rates in history.items()}
        return {role: hacpo_capability_ratio(capability[peer_of[role]], capability[role]) for role in capability}

    def receive(self, method, receiver, peers, offers, ratios):
        """Every prompt transfers; the selection's own answer (unless it selects every prompt) says where the
        peer advantages stay (``hacpo_which``)."""
        import torch
        which = None if method.selection.every_prompt else offers[peers[0], receiver]
        offers.update({(s, receiver): torch.ones_like(offers[s, receiver]) for s in peers})
        return {"ratio": ratios[receiver], "which": which}

    def advantages(self, method, receiver, source, selected, received):
        import torch

        from graft_exp.algorithms import hacpo_advantages, hacpo_which_advantages
        own_adv, src_adv = hacpo_advantages(receiver.rewards, source.rewards, received["ratio"],
                                            float(method.config.adv_eps))
        if received["which"] is not None:
            src_adv = hacpo_which_advantages(src_adv, received["which"])
        return own_adv, src_adv, torch.ones(receiver.rewards.shape[0], dtype=torch.bool)
