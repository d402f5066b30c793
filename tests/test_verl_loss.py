"""The verl-side loss (graft_exp.backends.verl.loss.actor_loss) through verl's own loss path: real verl
DataProto -> TensorDict -> no-padding conversion -> micro-batches, as verl's FSDP engine feeds them."""

from functools import partial
from pathlib import Path

import pytest
from support.optional import VERL_BACKEND

pytest.importorskip("verl", reason=VERL_BACKEND)   # above the imports below, which import verl
import torch
from hydra import compose, initialize_config_dir
from verl import DataProto
from verl.utils import tensordict_utils as tu
from verl.utils.config import omega_conf_to_dataclass
from verl.workers.engine.utils import prepare_micro_batches
from verl.workers.utils.losses import ppo_loss
from verl.workers.utils.padding import left_right_2_no_padding, no_padding_2_padding

from graft_exp.algorithms import (
    HACPO_CROSS_CLIP_DELTA,
    HACPO_CROSS_CLIP_STEP,
    HACPO_SELF_CLIP_HIGH,
    HACPO_SELF_CLIP_LOW,
    graft_policy_loss,
    hacpo_policy_loss,
    sgt_nll_loss,
)
from graft_exp.backends.verl import batch as vb
from graft_exp.backends.verl import loss as vl
from graft_exp.backends.verl.config import verl_config
from graft_exp.backends.verl.loss import actor_loss
from graft_exp.methods.objective import LossSpec

ROWS, PROMPT_LEN, RESPONSE_LEN = 8, 6, 7


@pytest.fixture(scope="module")
def actor_config(tmp_path_factory):
    with initialize_config_dir(config_dir=str(Path(__file__).resolve().parents[1] / "conf"), version_base="1.3"):
        cfg = compose(config_name="config", overrides=["pair=pair1", "backend=verl", "method=graft"])
    return omega_conf_to_dataclass(verl_config(cfg, "A", str(tmp_path_factory.mktemp("ck"))).actor_rollout_ref.actor)


def _batch(seed: int, peers: int = 0, nll_count: int = 0) -> DataProto:
    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, 50, (int(torch.randint(1, PROMPT_LEN + 1, (1,), generator=gen)),), generator=gen).tolist()
               for _ in range(ROWS)]
    responses = [torch.randint(3, 50, (int(torch.randint(1, RESPONSE_LEN + 1, (1,), generator=gen)),),
                               generator=gen).tolist() for _ in range(ROWS)]
    tensors = vb.pack_rows(prompts, responses, prompt_length=PROMPT_LEN, response_length=RESPONSE_LEN, pad_token_id=0)
    data = DataProto.from_dict(tensors=tensors)
    data.batch["old_log_probs"] = _base_log_prob(data.batch["responses"])
    row_adv = torch.randn(ROWS, generator=gen)
    data.batch["advantages"] = row_adv.unsqueeze(1) * data.batch["response_mask"]
    weights = torch.ones(ROWS)
    is_peer = torch.zeros(ROWS)
    is_peer[ROWS - peers:] = 1
    weights[ROWS - peers:] = torch.rand(peers, generator=gen) * 0.2 + 0.8
    if peers:
        weights[ROWS - 1] = 0.0   # a response removed by the gate
    nll_rows = torch.zeros(ROWS)
    if nll_count:
        nll_rows[:nll_count] = 1
        weights[:nll_count] = 0
    mask = data.batch["response_mask"].bool()
    data.batch[vl.WEIGHT] = weights
    data.batch[vl.IS_PEER] = is_peer
    data.batch[vl.NLL] = nll_rows
    data.batch[vl.DENOMINATOR] = torch.full((ROWS,), float((mask & (weights > 0).unsqueeze(1)).sum()))
    data.batch[vl.NLL_DENOMINATOR] = torch.full((ROWS,), float(max(int((mask & nll_rows.bool().unsqueeze(1)).sum()), 1)))
    data.batch[vl.MINIBATCH_INDEX] = torch.full((ROWS,), 2.0)
    return data


def _base_log_prob(token_ids: torch.Tensor) -> torch.Tensor:
    return -0.3 - 0.05 * ((token_ids * 7) % 13).float()


def _feature(token_ids: torch.Tensor) -> torch.Tensor:
    return ((token_ids * 5) % 11).float() / 10 - 0.5


def _model_log_probs(micro: dict, theta: torch.Tensor) -> torch.Tensor:
    """A stand-in for the model forward: log-prob of the *next* token at every position of the nested
    input ids (verl's convention), a fixed function of the ids plus theta times a feature."""
    ids = micro["input_ids"]
    nxt = torch.nested.nested_tensor_from_jagged(torch.roll(ids.values(), -1), offsets=ids.offsets())
    values = _base_log_prob(nxt.values()) + theta * _feature(nxt.values())
    return torch.nested.nested_tensor_from_jagged(values, offsets=ids.offsets())


def _run_verl_path(data: DataProto, loss_fn, theta: torch.Tensor, micro_batch_size: int):
    """verl's engine path on CPU: to_tensordict -> left_right_2_no_padding -> global batch info ->
    static micro-batches -> loss per micro-batch; returns the summed loss and its gradient on theta."""
    td = left_right_2_no_padding(data.to_tensordict())
    tu.assign_non_tensor(td, batch_num_tokens=int(td["loss_mask"].sum()), dp_size=1, global_batch_size=ROWS,
                         use_dynamic_bsz=False, micro_batch_size_per_gpu=micro_batch_size)
    micro_batches, _ = prepare_micro_batches(td, dp_group=None, same_micro_num_in_dp=False)
    total, metrics = 0.0, []
    for micro in micro_batches:
        loss, m = loss_fn(model_output={"log_probs": _model_log_probs(micro, theta)}, data=micro, dp_group=None)
        total = total + loss
        metrics.append(m)
    (grad,) = torch.autograd.grad(total, theta)
    return total.detach(), grad, metrics


def _padded(data: DataProto, theta: torch.Tensor) -> torch.Tensor:
    responses = data.batch["responses"]
    return _base_log_prob(responses) + theta * _feature(responses)


def test_no_peers_unit_weights_equals_verl_vanilla_grpo(actor_config):
    data = _batch(0)
    theta = torch.tensor(0.6, requires_grad=True)   # ratios within (0.7, 1.35): clipping active, dual-clip not
    spec = LossSpec(kind="graft", clip_low=actor_config.clip_ratio_low, clip_high=actor_config.clip_ratio_high)
    ours, our_grad, metrics = _run_verl_path(data, partial(actor_loss, actor_config, spec), theta, ROWS)
    theirs, their_grad, _ = _run_verl_path(data, partial(ppo_loss, config=actor_config), theta, ROWS)
    assert ours == pytest.approx(float(theirs), rel=1e-5)
    assert our_grad == pytest.approx(float(their_grad), rel=1e-5)
    assert sum(m["graft/clipped_tokens_self"].aggregate() for m in metrics) > 0


def test_micro_batched_peer_loss_equals_graft_policy_loss(actor_config):
    data = _batch(1, peers=3)
    theta = torch.tensor(0.8, requires_grad=True)
    spec = LossSpec(kind="graft")
    ours, our_grad, metrics = _run_verl_path(data, partial(actor_loss, actor_config, spec), theta, 2)
    log_prob = _padded(data, theta)
    reference, raw = graft_policy_loss(log_prob, data.batch["old_log_probs"], data.batch["advantages"],
                                       data.batch[vl.WEIGHT], data.batch["response_mask"], 0.2, 0.28,
                                       is_peer=data.batch[vl.IS_PEER].bool())
    (reference_grad,) = torch.autograd.grad(reference, theta)
    assert float(ours) == pytest.approx(float(reference), rel=1e-5)
    assert float(our_grad) == pytest.approx(float(reference_grad), rel=1e-5)
    for key in ("tokens_self", "tokens_peer", "clipped_tokens_peer"):
        assert sum(m[f"graft/{key}"].aggregate() for m in metrics) == pytest.approx(float(raw[key]))


def test_sgt_adds_nll_of_nll_rows(actor_config):
    data = _batch(2, nll_count=2)
    theta = torch.tensor(0.3, requires_grad=True)
    spec = LossSpec(kind="sgt", settings={"sgt_lambda": 0.1})
    ours, _, _ = _run_verl_path(data, partial(actor_loss, actor_config, spec), theta, 4)
    log_prob = _padded(data, theta).detach()
    pg, _ = graft_policy_loss(log_prob, data.batch["old_log_probs"], data.batch["advantages"], data.batch[vl.WEIGHT],
                              data.batch["response_mask"])
    nll_rows = data.batch[vl.NLL].bool()
    nll, _ = sgt_nll_loss(log_prob[nll_rows], data.batch["response_mask"][nll_rows], 0.1)
    assert float(ours) == pytest.approx(float(pg + nll), rel=1e-5)


def test_hacpo_sequence_loss_through_verl_path(actor_config):
    data = _batch(3, peers=4)
    mask = data.batch["response_mask"].bool()
    source_mean = (data.batch["old_log_probs"] * mask).sum(1) / mask.sum(1) - 0.05 * data.batch[vl.IS_PEER]
    data.batch[vl.row_column("source_mean_log_prob")] = source_mean
    data.batch[vl.row_column("capability_ratio")] = torch.full((ROWS,), 1.5)
    present = data.batch[vl.WEIGHT] > 0
    data.batch[vl.DENOMINATOR] = torch.full((ROWS,), float(present.sum()))
    spec = LossSpec(kind="hacpo", settings={"self_clip_low": HACPO_SELF_CLIP_LOW,
                                            "self_clip_high": HACPO_SELF_CLIP_HIGH,
                                            "cross_clip_delta": HACPO_CROSS_CLIP_DELTA,
                                            "cross_clip_step": HACPO_CROSS_CLIP_STEP})
    theta = torch.tensor(0.01, requires_grad=True)
    ours, _, _ = _run_verl_path(data, partial(actor_loss, actor_config, spec), theta, 4)
    row_adv = data.batch["advantages"].sum(1) / mask.sum(1)
    reference, _ = hacpo_policy_loss(_padded(data, theta)[present], mask[present], source_mean[present],
                                     row_adv[present], data.batch[vl.IS_PEER].bool()[present], 1.5, 2)
    assert float(ours) == pytest.approx(float(reference), rel=1e-5)


def test_padded_conversion_roundtrip_matches_response_slots():
    data = _batch(4)
    td = left_right_2_no_padding(data.to_tensordict())
    theta = torch.tensor(0.0)
    recovered = no_padding_2_padding(_model_log_probs(td, theta), td)
    mask = data.batch["response_mask"].bool()
    assert torch.allclose(recovered[mask], data.batch["old_log_probs"][mask])
