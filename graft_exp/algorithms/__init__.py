"""Pure tensor math of GRAFT and its baselines: advantages, exchange selection, peer weights, policy
losses and minibatch ordering. No I/O and no model code; every function validates its inputs cheaply
and raises ``ValueError`` on bad ones.

Every rule is named once, where a method's config picks it: the components in ``graft_exp.methods``,
the receiver losses in ``graft_exp.methods.objective.OBJECTIVES``.
"""

from .advantages import grpo_advantages, pooled_group_advantages
from .hacpo import (
    HACPO_CROSS_CLIP_DELTA,
    HACPO_CROSS_CLIP_STEP,
    HACPO_KL_COEF,
    HACPO_SELF_CLIP_HIGH,
    HACPO_SELF_CLIP_LOW,
    hacpo_advantages,
    hacpo_capability,
    hacpo_capability_ratio,
    hacpo_cross_clip_lower,
    hacpo_kl_loss,
    hacpo_policy_loss,
    hacpo_positive_rate,
    hacpo_which_advantages,
    kl_estimate,
)
from .losses import (
    graft_policy_loss,
    luffy_policy_loss,
    luffy_shaping,
    sequence_ratio_policy_loss,
    sgt_nll_loss,
)
from .ordering import (
    pack_minibatches,
    peer_first_minibatches,
    peer_last_minibatches,
    uniform_minibatches,
)
from .selection import (
    balanced,
    balanced_exchange,
    complementary_candidates,
    count_matched_random_exchange,
    draw_one_correct_response,
    dynamic_sampling_batch_full,
    dynamic_sampling_group_mask,
    random_prompts_like,
    resolve_sources,
    select_with_ties,
    sgt_rescue_prompts,
    top_fraction_exchange,
)
from .weights import (
    compatibility_score,
    compatibility_weight,
    random_admission_weights,
    sequence_log_prob_sums,
    success_only_weights,
    ungated_weight,
)

__all__ = [
    "HACPO_CROSS_CLIP_DELTA",
    "HACPO_CROSS_CLIP_STEP",
    "HACPO_KL_COEF",
    "HACPO_MINIBATCH_PROMPTS",
    "HACPO_SELF_CLIP_HIGH",
    "HACPO_SELF_CLIP_LOW",
    "balanced",
    "balanced_exchange",
    "compatibility_score",
    "compatibility_weight",
    "complementary_candidates",
    "count_matched_random_exchange",
    "draw_one_correct_response",
    "dynamic_sampling_batch_full",
    "dynamic_sampling_group_mask",
    "graft_policy_loss",
    "grpo_advantages",
    "hacpo_advantages",
    "hacpo_capability",
    "hacpo_capability_ratio",
    "hacpo_cross_clip_lower",
    "hacpo_kl_loss",
    "hacpo_policy_loss",
    "hacpo_positive_rate",
    "hacpo_which_advantages",
    "kl_estimate",
    "luffy_policy_loss",
    "luffy_shaping",
    "pack_minibatches",
    "peer_first_minibatches",
    "peer_last_minibatches",
    "pooled_group_advantages",
    "random_admission_weights",
    "random_prompts_like",
    "resolve_sources",
    "select_with_ties",
    "sequence_log_prob_sums",
    "sequence_ratio_policy_loss",
    "sgt_nll_loss",
    "sgt_rescue_prompts",
    "success_only_weights",
    "top_fraction_exchange",
    "ungated_weight",
    "uniform_minibatches",
]
