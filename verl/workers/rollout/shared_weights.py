"""Weight pushes into a vLLM engine core that runs in another process.

In-process, `VLLMEngine.load_weights` hands the tensors to the model directly. When the engine core
has a process of its own (VLLM_ENABLE_V1_MULTIPROCESSING=1), its RPC channel serialises arguments,
and a list of tensors does not survive it. Instead the sender pickles the tensors the way
`torch.multiprocessing` does — CUDA tensors as CUDA IPC handles, CPU tensors as shared-memory
files — so only handles cross the process boundary, and the engine's worker (extended by
`SharedWeightsReceiver`) maps the same memory and loads from it. The sender keeps its tensors alive
until the call returns; the receiver copies them into the model before it does.
"""

import pickle
import random
from multiprocessing.reduction import ForkingPickler

import numpy as np
import torch
import torch.multiprocessing


def pack(named_tensors: list) -> bytes:
    """(name, tensor) pairs as bytes that another process on this machine can unpickle into views
    of the same memory (CUDA: IPC handles; CPU: shared-memory files, copied there on first use).
    Keep the tensors referenced until the receiver is done with them."""
    # By file name rather than by file descriptor: descriptors would need a socket of their own.
    torch.multiprocessing.set_sharing_strategy("file_system")
    return bytes(ForkingPickler.dumps(named_tensors))


class SharedWeightsReceiver:
    """Mixed into vLLM's worker class (`LLM(worker_extension_cls=...)`); reached through
    `LLM.collective_rpc("load_shared_weights", args=(pack(...),))` and
    `LLM.collective_rpc("refresh_tied_output_layer")` and `("repack_cpu_experts", …)`, the last two
    for vLLM's CPU kernels; it also carries `reseed`, the one call into
    the worker that is not about weights."""

    def reseed(self, seed: int) -> None:
        """Seed the worker's random streams as vLLM seeds them at start-up. A request without a seed of
        its own draws from them: from torch's generators (CPU and every GPU) in vLLM's first model
        runner, which on CPU is the only one; from NumPy's, which picks the request's seed when it
        arrives, in its second (recent vLLM's GPU default for dense models)."""
        random.seed(seed)
        np.random.seed(seed)
        torch.manual_seed(seed)

    def load_shared_weights(self, payload: bytes) -> None:
        self.reload_weights(weights_iterator=pickle.loads(payload))

    def refresh_tied_output_layer(self) -> bool:
        """Rebuild the output layer's derived state after a weight push, when it is tied to the input
        embedding (SmolLM2; Qwen2.5 up to 3B). Such a model has no lm_head weights of its own, so a push
        carries none, and vLLM's in-place reload skips the layer's post-load processing: the weight
        it shares with the embedding is new, but on CPU the matrix-multiply kernel prepared from it
        at load time (a packed copy) is not, and the engine samples from the initial output layer.
        Redoing the processing rebuilds it; on a GPU there is nothing to rebuild (the kernel reads the
        shared weight), and the engine calls this on CPU only. Returns whether the model ties them."""
        model = self.model_runner.get_model()
        if not getattr(getattr(model, "config", None), "tie_word_embeddings", False):
            return False
        head = getattr(model, "lm_head", None)
        method = getattr(head, "quant_method", None)
        if method is None:
            raise RuntimeError(f"{type(model).__name__} ties its output layer to its input embedding, but has no "
                               "lm_head with a quant_method to refresh after a weight push")
        method.process_weights_after_loading(head)
        return True

    def repack_cpu_experts(self, blocks: list[str]) -> None:
        """Redo the CPU kernel's packing of the routed experts in `blocks` (module names, e.g.
        "model.layers.0.mlp") after a weight push that carried their weights. vLLM's CPU MoE kernel
        computes from a copy of the expert weights packed into its own layout at load time; an in-place
        reload writes the new weights in the checkpoint's layout and, for an engine already set up,
        skips the packing (vLLM 0.32), so the experts would compute garbage. Packing only what the push
        reached matters: a block it skipped keeps its packed weights, and packing those again would
        scramble them. On a GPU the kernel reads the weights as loaded; the engine calls this on CPU only."""
        model = self.model_runner.get_model()
        packed = set()
        for name, module in model.named_modules():
            kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
            block = next((b for b in blocks if name.startswith(b + ".")), None)
            if kernel is None or block is None:
                continue
            kernel.fused_experts.process_weights_after_loading(module)
            packed.add(block)
        if missed := sorted(set(blocks) - packed):
            raise RuntimeError(f"a weight push carried the experts of {missed}, but {type(model).__name__} has no "
                               "mixture-of-experts layer under those names to repack: the CPU engine would compute "
                               "them from stale packed weights")
