"""verl's single-turn agent loop with a per-sample vLLM sampling seed.

verl 0.9.1 seeds each vLLM engine once, at launch, with ``rollout.seed + replica rank``
(``vLLMHttpServer.launch_server``), and sends no per-request seed unless ``full_determinism`` is on (then
one seed for every request, so the n samples of a prompt would be identical). Every job would then draw
from the same random stream, and a resumed job would draw differently from an uninterrupted one (the
engine's stream restarts). The backend puts a ``sample_seed`` column into each generation batch, derived
from the run seed, the step and the row (``VerlBackend._generate``); this loop hands it to vLLM as the
request's ``SamplingParams.seed``. With ``backend.seeded_requests=false`` the column holds None and the request
carries no seed (vLLM's batched sampler; on GPUs nothing is bit-reproducible either way).

The model's stop tokens travel the same way (``STOP_COLUMN``, SamplingParams.stop_token_ids).

verl's agent-loop workers are Ray actors that never import this module: they find the loop through
``agent_loops.yaml`` (``rollout.agent.agent_loop_config_path``, set by ``config.verl_config``).
"""

from __future__ import annotations

from typing import Any

from verl.experimental.agent_loop.agent_loop import AgentLoopOutput
from verl.experimental.agent_loop.single_turn_agent_loop import SingleTurnAgentLoop

#: The generation batch's column of per-sample seeds.
SEED_COLUMN = "sample_seed"
#: The generation batch's column of the model's stop token ids (``batch.stop_token_ids``): vLLM stops only at
#: the generation config's EOS by itself, and a base model's generation config names its end-of-text token,
#: not the end-of-turn token its chat template closes an assistant turn with.
STOP_COLUMN = "stop_token_ids"


class SeededSingleTurnAgentLoop(SingleTurnAgentLoop):
    async def run(self, sampling_params: dict[str, Any], **kwargs) -> AgentLoopOutput:
        if SEED_COLUMN not in kwargs or kwargs.get(STOP_COLUMN) is None:
            raise ValueError(f"generation batch without its {SEED_COLUMN!r} or {STOP_COLUMN!r} column: vLLM would "
                             "sample from the engine's launch seed unasked, or run past the end of the turn")
        seed, stops = kwargs.pop(SEED_COLUMN), kwargs.pop(STOP_COLUMN)
        # A row's seed is None where the job samples from the engine's stream (backend.seeded_requests=false).
        seeding = {} if seed is None else {"seed": int(seed)}
        return await super().run({**sampling_params, **seeding, "stop_token_ids": [int(t) for t in stops]}, **kwargs)
