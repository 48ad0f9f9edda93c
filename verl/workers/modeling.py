"""Building the trained models: a causal LM or a value model in fp32 master weights, with dropout
off, optional gradient checkpointing (of every decoder layer, or of an evenly spread fraction of
them), the attention implementation used for packed rows (`pick_attn_implementation`,
`varlen_attention`; see `verl.workers.packing`), and optional torch.compile of each decoder layer.
"""

from __future__ import annotations

import functools
import inspect

import torch
from torch import nn

VARLEN_ATTN = "varlen"  # the name under which `varlen_attention` is registered with transformers
_VARLEN_KERNEL = None  # set by register_varlen_attention


def pick_attn_implementation(mixed_precision: bool) -> str:
    """On CUDA in bf16: flash-attention-2 where the package is installed, else torch's own
    FlashAttention varlen kernel (`varlen`). Otherwise SDPA with an explicit packing mask (neither
    flash kernel has fp32 or CPU code)."""
    from transformers.utils import is_flash_attn_2_available

    if torch.cuda.is_available() and mixed_precision:
        if is_flash_attn_2_available():
            return "flash_attention_2"
        if _torch_varlen() is not None:
            register_varlen_attention()
            return VARLEN_ATTN
    return "sdpa"


@functools.cache
def _torch_varlen():
    """(varlen_attn, its keyword arguments for causal attention, whether it takes enable_gqa), or
    None for a torch without it (< 2.10). torch 2.10 took `is_causal`; later versions `window_size`."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    params = inspect.signature(varlen_attn).parameters
    causal = {"window_size": (-1, 0)} if "window_size" in params else {"is_causal": True}
    return varlen_attn, causal, "enable_gqa" in params


def register_varlen_attention() -> None:
    """Make `attn_implementation="varlen"` known to transformers (idempotent). Models using it take
    no mask: transformers skips mask creation for implementations it has no mask function for."""
    from transformers import AttentionInterface

    global _VARLEN_KERNEL
    _VARLEN_KERNEL = _torch_varlen()  # looked up once, outside code that torch.compile traces
    AttentionInterface.register(VARLEN_ATTN, varlen_attention)



def varlen_attention(module, query_BHTD, key_BHTD, value_BHTD, attention_mask, scaling=None, dropout=0.0,
                     cu_seq_lens_q=None, max_length_q=None, **_):
    """A transformers attention function for ONE packed sequence (batch 1) made of rows whose
    boundaries are `cu_seq_lens_q` ([0, len0, len0+len1, ...], int32): causal inside each row, nothing
    across rows. Returns ([1, T, H, D], None) as transformers expects. Dropout is off in our models."""
    if cu_seq_lens_q is None or query_BHTD.shape[0] != 1:
        raise ValueError("varlen attention needs one packed row (batch 1) and cu_seq_lens_q: call the model "
                         "through verl.workers.packing.forward_packed, or use attn_implementation='sdpa'")
    # [1, H, T, D] -> [T, H, D], the layout of the varlen kernels
    q_THD, k_TKD, v_TKD = (x[0].transpose(0, 1) for x in (query_BHTD, key_BHTD, value_BHTD))
    if q_THD.is_cuda:
        varlen_attn, causal, takes_gqa = _VARLEN_KERNEL
        kwargs = dict(causal)
        # Under autocast the rotary embedding (fp32 cos/sin) hands us fp32 queries and keys while
        # the value projection is bf16; the flash kernel takes 16-bit inputs only.
        dtype = value_BHTD.dtype
        if dtype not in (torch.float16, torch.bfloat16):
            raise ValueError("varlen attention computes in bf16/fp16: use mixed precision (FSDP's policy or "
                             "autocast), or attn_implementation='sdpa' for fp32")
        q_THD, k_TKD = q_THD.to(dtype), k_TKD.to(dtype)
        if k_TKD.shape[1] != q_THD.shape[1]:
            if takes_gqa:
                kwargs["enable_gqa"] = True
            else:  # query head h reads key/value head h // group
                group = q_THD.shape[1] // k_TKD.shape[1]
                k_TKD, v_TKD = k_TKD.repeat_interleave(group, 1), v_TKD.repeat_interleave(group, 1)
        out_THD = varlen_attn(q_THD.contiguous(), k_TKD.contiguous(), v_TKD.contiguous(), cu_seq_lens_q,
                              cu_seq_lens_q, max_length_q, max_length_q, scale=scaling, **kwargs)
    else:  # no flash kernels on the CPU: SDPA per row gives the same result
        bounds = cu_seq_lens_q.tolist()
        out_THD = torch.cat([
            torch.nn.functional.scaled_dot_product_attention(
                q_THD[s:e].transpose(0, 1), k_TKD[s:e].transpose(0, 1), v_TKD[s:e].transpose(0, 1),
                is_causal=True, scale=scaling, enable_gqa=True).transpose(0, 1)
            for s, e in zip(bounds[:-1], bounds[1:])])
    return out_THD[None], None


def _disable_dropout(model: nn.Module) -> None:
    # PPO's ratio must be exactly 1 where nothing changed: old log-probs (no grad, eval-like) and the
    # update's log-probs (train mode, needed for gradient checkpointing) must come from the same
    # deterministic function. Most LLM configs have dropout 0 already; some do not.
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0
        if isinstance(getattr(module, "attention_dropout", None), float):
            module.attention_dropout = 0.0


def _no_router_aux_loss(model: nn.Module) -> None:
    # Mixture-of-experts models (Qwen3-MoE) can return every layer's router logits and a load-balancing
    # loss over them (config.output_router_logits, router_aux_loss_coef). We do not add that loss: it is
    # a pretraining device that keeps the experts evenly loaded while a router is learned from scratch.
    # The policy starts from a trained, balanced router; the balance term would be a second objective
    # pulling the router away from what the policy gradient asks of it, and nothing downstream needs it
    # (the rollout engine routes with whatever router it is pushed). Off, the router logits of every
    # layer are not collected either.
    if getattr(model.config, "output_router_logits", None):
        model.config.output_router_logits = False


def _enable_gradient_checkpointing(model, ratio: float = 1.0) -> None:
    """Checkpoint round(ratio × layers) decoder layers, spread evenly over the depth (0.5: every other
    layer). The others keep their activations for backward: less recompute, more memory."""
    if not 0.0 <= ratio <= 1.0:
        raise ValueError(f"gradient checkpointing ratio {ratio}: use the fraction of decoder layers to "
                         f"checkpoint, in [0, 1]")
    if ratio == 0:
        return
    layers, n_checkpointed = [], 0  # ratio 1: all layers, as transformers does it, no layer lookup
    if ratio < 1:
        layers = decoder_layers(model)
        n_checkpointed = round(ratio * len(layers))
        if n_checkpointed == 0:
            return
        if n_checkpointed < len(layers) and not all(hasattr(layer, "gradient_checkpointing") for layer in layers):
            raise ValueError(
                f"gradient checkpointing ratio {ratio}: the decoder layers of {type(model).__name__} have no "
                f"per-layer `gradient_checkpointing` flag (transformers' GradientCheckpointingLayer), so only "
                f"all of them can be checkpointed: use a ratio of 1 or 0")
    # Non-reentrant checkpointing: the reentrant variant does not work with FSDP2's hooks and needs
    # inputs that require grad.
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    # Keep layers i·n/k for i < k (evenly spaced, distinct because n/k ≥ 1); switch the others off.
    checkpointed = {i * len(layers) // n_checkpointed for i in range(n_checkpointed)}
    for i, layer in enumerate(layers):
        if i not in checkpointed:
            layer.gradient_checkpointing = False


def build_causal_lm(path: str, dtype: torch.dtype = torch.float32, gradient_checkpointing: float = 0.0,
                    attn_implementation: str = "sdpa") -> nn.Module:
    """A Hugging Face causal LM on the CPU in `dtype` (keep fp32 for trained models: these are the
    master weights; FSDP's mixed precision casts to bf16 for compute). `gradient_checkpointing`: the
    fraction of decoder layers checkpointed, in [0, 1] (True is 1.0, False 0.0)."""
    from transformers import AutoModelForCausalLM

    if attn_implementation == VARLEN_ATTN:
        register_varlen_attention()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation=attn_implementation)
    _no_router_aux_loss(model)
    _disable_dropout(model)
    _enable_gradient_checkpointing(model, float(gradient_checkpointing))
    return model


class ValueModel(nn.Module):
    """A decoder-only backbone (`AutoModel`: the causal LM without its lm_head) and a linear value
    head, initialised to zero so that the first values are 0 instead of noise of the size of the
    hidden states.

    Why not `AutoModelForTokenClassification(num_labels=1)`: it exists only for some architectures,
    while `AutoModel` loads the base model of every decoder-only checkpoint (the lm_head weights are
    simply not used). The backbone sits at `.model`, like in HF causal LMs, so `shard` finds the
    decoder layers the same way. `forward` mirrors the causal LM's `logits_to_keep` argument.
    """

    def __init__(self, backbone: nn.Module):
        super().__init__()
        self.model = backbone
        self.config = backbone.config
        hidden = self.config.get_text_config().hidden_size
        self.value_head = nn.Linear(hidden, 1, dtype=next(backbone.parameters()).dtype)
        nn.init.zeros_(self.value_head.weight)
        nn.init.zeros_(self.value_head.bias)

    def forward(self, input_ids, attention_mask=None, position_ids=None, logits_to_keep=0, use_cache=False,
                **attention_kwargs):
        hidden_BTH = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                                use_cache=use_cache, **attention_kwargs).last_hidden_state
        keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        # [B, kept]; a copy, not a view: FSDP2 warns on (and an in-place op would break) a view output
        return self.value_head(hidden_BTH[:, keep]).squeeze(-1).clone()

    def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs=None):
        self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=gradient_checkpointing_kwargs)


def build_value_model(path: str, dtype: torch.dtype = torch.float32, gradient_checkpointing: float = 0.0,
                      attn_implementation: str = "sdpa") -> ValueModel:
    """`ValueModel` with the backbone of the checkpoint at `path` (a causal LM checkpoint is fine).
    `gradient_checkpointing` as in `build_causal_lm`."""
    from transformers import AutoModel

    if attn_implementation == VARLEN_ATTN:
        register_varlen_attention()
    backbone = AutoModel.from_pretrained(path, dtype=dtype, attn_implementation=attn_implementation)
    _no_router_aux_loss(backbone)
    model = ValueModel(backbone)
    _disable_dropout(model)
    _enable_gradient_checkpointing(model, float(gradient_checkpointing))
    return model


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    layers = getattr(getattr(model, "model", None), "layers", None)
    if isinstance(layers, nn.ModuleList) and len(layers):
        return list(layers)
    layers = [m for m in model.modules() if type(m).__name__.endswith("DecoderLayer")]
    if not layers:
        raise ValueError(
            f"no decoder layers found in {type(model).__name__} (looked for `model.model.layers` and modules "
            f"whose class name ends with 'DecoderLayer'): extend verl.workers.modeling.decoder_layers for it")
    return layers


def compile_layers(model: nn.Module) -> nn.Module:
    """torch.compile each decoder layer's forward (not the module call: FSDP2's hooks and
    activation checkpointing stay outside the compiled code). Fuses the elementwise work between
    the matmuls (norms, rotary embedding, SiLU·gate, residual adds), which in eager mode costs about
    as much memory traffic as the matmuls cost compute. Dynamic shapes: every pack has its own length."""
    for layer in decoder_layers(model):
        layer.forward = torch.compile(layer.forward, dynamic=True)
    return model


def recompute_layers(model: nn.Module, n: int) -> None:
    """Recompute `n` decoder layers in backward, spread evenly over the depth, the others keeping
    their activations. The model must have been built with every layer checkpointed (ratio 1)."""
    layers = decoder_layers(model)
    if not all(hasattr(layer, "gradient_checkpointing") for layer in layers):
        raise ValueError(f"the decoder layers of {type(model).__name__} have no per-layer `gradient_checkpointing` "
                         "flag: set gradient_checkpointing_ratio to 1 or 0")
    chosen = {i * len(layers) // n for i in range(n)} if n else set()
    for i, layer in enumerate(layers):
        layer.gradient_checkpointing = i in chosen
