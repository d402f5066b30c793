"""The paper's fixed hyper-parameters of the losses (App. B), each written once: the method config's defaults
(``config.MethodConfig``, ``HacpoConfig``), the loss spec's (``objective.LossSpec``) and the pure functions' of
``algorithms/`` all read them here. No torch: the config layer imports this on a login node."""

CLIP_LOW = 0.2                # DAPO's clip-higher: 1 - eps_low <= ratio <= 1 + eps_high (App. B)
CLIP_HIGH = 0.28
CLIP_RATIO_C = 3.0            # verl's dual clip for A < 0, the same for every method (GRPO's loss)
SGT_LAMBDA = 0.1              # SGT's NLL coefficient
LUFFY_GAMMA = 0.1             # LUFFY's shaping f(p) = p / (p + gamma)

# HACPO's released configuration (App. B; the official recipe/hacpo)
HACPO_SELF_CLIP_LOW = 3e-4
HACPO_SELF_CLIP_HIGH = 4e-4
HACPO_PEER_CLIP_INIT = 0.8    # the peer clamp's lower bound L_m = min(1, init + m * step), m the minibatch index
HACPO_PEER_CLIP_STEP = 0.025
HACPO_KL_COEF = 1e-3
HACPO_MINIBATCH_PROMPTS = 64
