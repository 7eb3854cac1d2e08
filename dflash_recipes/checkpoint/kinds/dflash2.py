"""DFlash 2 (``DFlash2DraftModel``), torch-free: its layout facts and config checks only.

A first step toward issue 37; NOT yet registered as a kind (no recipe field, no executor
half). What it holds: the tensors DFlash 2 adds to the DFlash backbone (per layer a grouped
dynamic causal convolution on both sides of attention and MLP; one candidate selector with
two codebooks stored without a ``.weight`` suffix, as z-lab releases them), the number of
parameters they add, and the checks a ``dflash_config`` must pass (``conv_group_size``
divides the hidden size, the kernel fits the block, ``1 <= selector_top_k <= vocab``).
"""

from __future__ import annotations

from collections.abc import Mapping

#: The ``dflash_config`` keys DFlash 2 adds, each required by vLLM's loader.
NEW_CONFIG_KEYS: tuple[str, ...] = (
    "conv_kernel_size",
    "conv_group_size",
    "selector_rank",
    "selector_top_k",
)

#: The architecture string engines switch on.
ARCHITECTURE = "DFlash2DraftModel"


def extra_layout(
    *, hidden: int, vocab: int, layers: int, kernel: int, group_size: int, rank: int
) -> dict[str, tuple[int, ...]]:
    """The tensors DFlash 2 adds to the backbone, unprefixed, name -> shape."""
    groups = hidden // group_size
    out: dict[str, tuple[int, ...]] = {}
    for i in range(layers):
        for conv in ("attention_conv", "mlp_conv"):
            out[f"layers.{i}.{conv}.base_kernel"] = (2, kernel, hidden)
            out[f"layers.{i}.{conv}.kernel_projection.weight"] = (2 * kernel * groups, hidden)
    out["candidate_selector.hidden_projection.weight"] = (rank, hidden)
    out["candidate_selector.predecessor_codebook"] = (vocab, rank)
    out["candidate_selector.successor_codebook"] = (vocab, rank)
    return out


def extra_parameters(shapes: Mapping[str, tuple[int, ...]]) -> int:
    """How many parameters `shapes` (an :func:`extra_layout`) holds."""
    total = 0
    for shape in shapes.values():
        n = 1
        for dim in shape:
            n *= dim
        total += n
    return total


def config_problems(
    dflash_config: Mapping[str, object], *, hidden: int, vocab: int, block_size: int
) -> list[str]:
    """What is wrong with a DFlash 2 ``dflash_config`` (empty when nothing is)."""
    problems = [
        f"dflash_config.{key} is missing (DFlash 2 needs it)"
        for key in NEW_CONFIG_KEYS
        if not isinstance(dflash_config.get(key), int)
    ]
    if problems:
        return problems
    kernel = dflash_config["conv_kernel_size"]
    group = dflash_config["conv_group_size"]
    top_k = dflash_config["selector_top_k"]
    assert isinstance(kernel, int) and isinstance(group, int) and isinstance(top_k, int)
    if group < 1 or hidden % group:
        problems.append(f"conv_group_size {group} must divide the hidden size {hidden}")
    if not 1 <= kernel <= block_size:
        problems.append(f"conv_kernel_size {kernel} must be in 1..block_size ({block_size})")
    if not 1 <= top_k <= vocab:
        problems.append(f"selector_top_k {top_k} must be in 1..vocab ({vocab})")
    return problems
