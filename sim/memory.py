"""What one GPU has left for the KV cache once the model is loaded: vLLM's budget, estimated.

vLLM (0.33, `gpu_worker.determine_available_memory`) loads the weights, runs one dummy forward
pass of `max_num_batched_tokens` tokens (and the sampler over `max_num_seqs` sequences), and
gives the KV cache what is left of `gpu_memory_utilization` x the GPU's memory:

    kv_budget = utilization x memory - weights - activation peak - non-torch memory

vLLM measures the last two; without the GPU we estimate them (per GPU of `tp`):

- weights: every parameter (sim/architecture.py), split `tp` ways;
- activation peak: the largest set of tensors alive at once in the dummy pass: the hidden
  states and the residual (2 x tokens x hidden), plus the widest intermediate of one layer:
  the MLP's up (and gate) output with its activation (tokens x (up matrices + 1) x
  intermediate / tp) or the attention's QKV and output (tokens x (q + 2 kv + q) / tp),
  whichever is larger; plus the sampler's logits and probabilities over the full vocabulary
  in fp32 (2 x max_num_seqs x vocab x 4 bytes);
- non-torch memory and CUDA graphs: a fixed 1 GiB (cuBLAS and NCCL workspaces, the captured
  graphs' pools). An ASSUMPTION; vLLM logs the measured figure at start-up.

`memory` is the data sheet's capacity, a little more than the driver reports (an 80 GB card
shows about 79.2 GiB), so a derived budget errs high by up to ~1 GiB. Give kv_budget
explicitly (a size, or the gpu_memory/weights/activations form) to use a measured figure.
"""

from __future__ import annotations

from kvfrag.sim.architecture import Architecture
from kvfrag.sim.hardware import GPU
from kvfrag.sim.units import format_size

#: Non-torch memory and CUDA graphs per GPU (see the module docstring). An assumption.
NON_TORCH_BYTES = 2**30


def activation_peak_bytes(arch: Architecture, tp: int, max_tokens: int, max_seqs: int,
                          dtype_bytes: int = 2) -> int:
    """Peak bytes of activations in vLLM's profiling pass, per GPU (module docstring)."""
    q, kv = arch.q_width / tp, max(arch.kv_heads / tp, 1) * arch.head_dim
    mlp = (arch.mlp_up_matrices + 1) * arch.intermediate / tp
    attention = 2 * q + 2 * kv
    layer = max_tokens * (2 * arch.hidden + max(mlp, attention)) * dtype_bytes
    sampler = 2 * max_seqs * arch.vocab * 4
    return int(layer + sampler)


def kv_budget(gpu: GPU, arch: Architecture, tp: int, utilization: float, max_tokens: int,
              max_seqs: int, dtype_bytes: int = 2,
              draft: Architecture | None = None) -> dict[str, int]:
    """The derived KV budget of one GPU and its terms, in bytes (weights and activations of
    `dtype_bytes`: 16-bit unless the weights are quantized; the KV cache's own dtype does not
    enter). `draft`: a speculative draft model, whose weights are loaded too (split `tp`
    ways, as vLLM runs the draft with the target's tensor parallelism by default)."""
    parts = {
        "usable": int(gpu.memory_bytes * utilization),
        "weights": -(-arch.weight_bytes(dtype_bytes) // tp),
        "draft_weights": 0 if draft is None else -(-draft.weight_bytes(dtype_bytes) // tp),
        "activations": activation_peak_bytes(arch, tp, max_tokens, max_seqs, dtype_bytes),
        "non_torch": NON_TORCH_BYTES,
    }
    budget = (parts["usable"] - parts["weights"] - parts["draft_weights"]
              - parts["activations"] - parts["non_torch"])
    if budget <= 0:
        raise ValueError(
            f"kv_budget: {arch.name} on {tp} x {gpu.name} leaves {format_size(budget)} for the "
            f"KV cache ({format_size(parts['usable'])} usable, weights "
            f"{format_size(parts['weights'] + parts['draft_weights'])}, activations "
            f"{format_size(parts['activations'])},"
            f" non-torch {format_size(parts['non_torch'])}): raise tp or gpu_memory_utilization"
        )
    return {**parts, "kv_budget": budget}
