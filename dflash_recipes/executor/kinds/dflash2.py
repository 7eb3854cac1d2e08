"""DFlash 2, its torch half: the convolutions inside every layer, the candidate selector, the
unary plus selector objective and the selector's greedy path.

Its torch-free half (the layout, the recipe fields, the compile checks, the export config):
:mod:`dflash_recipes.checkpoint.kinds.dflash2`.

:class:`GroupedDynamicCausalConv`: the convolution on both sides of a sublayer. From the
normed input u one projection gives per-position coefficient offsets delta[side, tap, group];
side 0 filters u before the sublayer, side 1 filters the sublayer output o (still with the
coefficients of u), and the result is added to the residual. Taps run over block positions
only: a tap t reaching before the block start (``pos % block < t``) reads zero, so position 0
(the anchor) sees zero padding and position 1 sees the anchor. Initialised as the identity
(tap 0 weight 1, projection 0), so a DFlash 1 backbone computes what it computed before.

:class:`DFlash2DecoderLayer` (:meth:`DFlash2Modules.build_layer`): a DFlash decoder layer with
one convolution around attention (``attention_conv``) and one around the MLP (``mlp_conv``).

:class:`CandidateSelector`, the kind's head (:class:`SelectorHead`, registered at the drafter's
top level as ``candidate_selector``): ``hidden_projection`` W (``[r, H]``) and the two codebooks
A (``predecessor_codebook``) and B (``successor_codebook``), ``[V, r]`` bare parameters (no
``.weight``, as z-lab releases them). The score of the edge p -> c at a slot with draft state h
is ``U(c) + <A[p] * (W h), B[c]>`` (:func:`edge_scores`), U the unary scores (the target head's
logits, times ``output_multiplier``, optionally soft-capped: :func:`unary_scores`) over the
slot's top-K candidates. :func:`select_path`: the single greedy path (the drafter's proposals);
:func:`selector_loss`: the K-way cross-entropy with the true previous token.

**Objective** (:func:`dflash2_loss`): plain DFlash's weighted cross-entropy of the unary scores
(block position k predicts anchor + k, the anchor never scored) plus ``selector_loss_alpha``
times the selector's cross-entropy, both weighted means with the same position weights, so
chunks combine exactly. A fresh drafter (or one warm-started from DFlash 1) has identity
convolutions and a zero successor codebook: it computes what the DFlash 1 backbone computes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import attrs
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dflash_recipes.executor.kinds.dflash import dflash_loss
from dflash_recipes.executor.kinds.protocol import (
    INIT_STD,
    Chooser,
    KindHead,
    expect_head,
    greedy_choice,
)
from dflash_recipes.executor.model.layers import DraftDecoderLayer, KVJoin
from dflash_recipes.executor.model.masks import DraftMask
from dflash_recipes.executor.training.anchors import previous_tokens
from dflash_recipes.executor.training.loss import (
    LossOutput,
    ObjectiveInputs,
    objective_weights,
    without_anchor,
)
from dflash_recipes.plan.draft_spec import ResolvedDraft
from dflash_recipes.plan.run_plan import ObjectivePlan
from dflash_recipes.recipe.choices import SelectorMissingGold
from dflash_recipes.records import Record

#: What the selector's loss does at a position whose gold token is not in the unary top-K
#: (the recipe's enumeration, ``dflash.dflash_selector_missing_gold``).
MissingGold = SelectorMissingGold


@attrs.frozen(repr=False, eq=False, slots=False)
class DFlash2Settings(Record):
    """The ``dflash_config`` keys DFlash 2 adds (reference section 1)."""

    conv_kernel_size: int
    conv_group_size: int
    selector_rank: int
    selector_top_k: int
    output_multiplier: float = 1.0
    final_logit_softcapping: float | None = None
    input_embedding_scale: float = 1.0


class GroupedDynamicCausalConv(nn.Module):
    """The grouped dynamic causal convolution (module doc)."""

    def __init__(self, hidden: int, kernel: int, group_size: int) -> None:
        super().__init__()
        if group_size < 1 or hidden % group_size:
            msg = f"conv_group_size {group_size} must divide the hidden size {hidden}"
            raise ValueError(msg)
        self.kernel = kernel
        self.group_size = group_size
        self.groups = hidden // group_size
        self.base_kernel = nn.Parameter(torch.empty(2, kernel, hidden))
        self.kernel_projection = nn.Linear(hidden, 2 * kernel * self.groups, bias=False)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """The identity: tap 0 weight 1 on both sides, every other tap 0, projection 0."""
        self.base_kernel.zero_()
        self.base_kernel[:, 0] = 1.0
        nn.init.zeros_(self.kernel_projection.weight)

    def coefficients(self, u: Tensor) -> Tensor:
        """[batch, seq, 2, K, H] coefficients from the normed input u [batch, seq, H]."""
        b, s, _ = u.shape
        delta = self.kernel_projection(u).view(b, s, 2, self.kernel, self.groups)
        delta = delta.repeat_interleave(self.group_size, dim=-1)
        out: Tensor = self.base_kernel.to(delta.dtype) + delta
        return out

    def apply_side(self, x: Tensor, coeff: Tensor, side: int, block_size: int) -> Tensor:
        """Filter x [batch, seq, H] (seq a whole number of blocks) with side `side`."""
        pos = torch.arange(x.shape[1], device=x.device) % block_size
        out = coeff[:, :, side, 0] * x
        for t in range(1, self.kernel):
            shifted = F.pad(x, (0, 0, t, 0))[:, : x.shape[1]]
            keep = (pos >= t).to(x.dtype).view(1, -1, 1)
            out = out + coeff[:, :, side, t] * shifted * keep
        return out

    def forward(self, u: Tensor, sublayer: Callable[[Tensor], Tensor], block_size: int) -> Tensor:
        """``post(sublayer(pre(u)))``: the sublayer's contribution to the residual."""
        if u.shape[1] % block_size:
            msg = f"the query stream ({u.shape[1]} positions) is not whole blocks of {block_size}"
            raise ValueError(msg)
        coeff = self.coefficients(u)
        out = sublayer(self.apply_side(u, coeff, 0, block_size))
        return self.apply_side(out, coeff, 1, block_size)


class DFlash2DecoderLayer(DraftDecoderLayer):
    """A DFlash decoder layer with a convolution on both sides of attention and of the MLP."""

    def __init__(self, spec: ResolvedDraft, settings: DFlash2Settings) -> None:
        super().__init__(spec)
        self.block_size = spec.block_size
        hidden, kernel, group = (
            spec.hidden_size,
            settings.conv_kernel_size,
            settings.conv_group_size,
        )
        self.attention_conv = GroupedDynamicCausalConv(hidden, kernel, group)
        self.mlp_conv = GroupedDynamicCausalConv(hidden, kernel, group)

    def reset_kind_parameters(self) -> None:
        """Both convolutions back to the identity (the drafter's initialisation drew their
        projections from a normal like every linear)."""
        self.attention_conv.reset_parameters()
        self.mlp_conv.reset_parameters()

    def _mlp_part(self, x: Tensor) -> Tensor:
        result: Tensor = x + self.mlp_conv(
            self.post_attention_layernorm(x), self.mlp, self.block_size
        )
        return result

    def forward(
        self, x: Tensor, context: Tensor, cos: Tensor, sin: Tensor, mask: DraftMask
    ) -> Tensor:
        attn = self.attention_conv(
            self.input_layernorm(x),
            lambda v: self.self_attn(v, context, cos, sin, mask),
            self.block_size,
        )
        return self._mlp_part(x + attn)

    def forward_cached(
        self, x: Tensor, join: KVJoin, cos: Tensor, sin: Tensor, mask: Tensor
    ) -> Tensor:
        attn = self.attention_conv(
            self.input_layernorm(x),
            lambda v: self.self_attn.forward_cached(v, join, cos, sin, mask),
            self.block_size,
        )
        return self._mlp_part(x + attn)


class CandidateSelector(nn.Module):
    """The selector's parameters (module doc); tensor names as z-lab releases them."""

    def __init__(self, hidden: int, vocab: int, rank: int) -> None:
        super().__init__()
        self.hidden_projection = nn.Linear(hidden, rank, bias=False)
        self.predecessor_codebook = nn.Parameter(torch.empty(vocab, rank))
        self.successor_codebook = nn.Parameter(torch.empty(vocab, rank))
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self, generator: torch.Generator | None = None) -> None:
        """Projection and predecessor codebook normal(0, 0.02); successor codebook zero, so a
        fresh selector adds nothing to the unary scores (SpecForge's initialisation)."""
        nn.init.normal_(self.hidden_projection.weight, std=INIT_STD, generator=generator)
        nn.init.normal_(self.predecessor_codebook, std=INIT_STD, generator=generator)
        nn.init.zeros_(self.successor_codebook)

    def edge_scores(
        self, unary: Tensor, candidates: Tensor, prev: Tensor, hidden: Tensor
    ) -> Tensor:
        """:func:`edge_scores` with this selector's parameters."""
        return edge_scores(
            unary,
            candidates,
            prev,
            hidden,
            self.hidden_projection.weight,
            self.predecessor_codebook,
            self.successor_codebook,
        )


def unary_scores(logits: Tensor, settings: DFlash2Settings) -> Tensor:
    """The unary scores U in float32: logits times ``output_multiplier``, then, with
    ``final_logit_softcapping`` c, ``c * tanh(U / c)``. float32 logits with neither (the
    defaults) are returned as they are: no copy of the step's largest tensor."""
    scores = logits.float()
    if settings.output_multiplier != 1.0:
        scores = scores * settings.output_multiplier
    cap = settings.final_logit_softcapping
    if cap is not None:
        scores = cap * torch.tanh(scores / cap)
    return scores


def edge_scores(
    unary: Tensor,
    candidates: Tensor,
    prev: Tensor,
    hidden: Tensor,
    projection: Tensor,
    predecessor: Tensor,
    successor: Tensor,
) -> Tensor:
    """``[..., K]`` float32 scores of the edges ``prev -> candidates[..., i]``.

    ``unary [..., K]`` the candidates' unary scores, ``candidates [..., K]`` their token ids,
    ``prev [...]`` the predecessor token, ``hidden [..., H]`` the slot's draft state,
    ``projection [r, H]``, codebooks ``[V, r]``: ``U(c) + <A[p] * (W h), B[c]>``.
    """
    query = predecessor[prev].float() * (hidden.float() @ projection.float().T)
    pair = (successor[candidates].float() * query.unsqueeze(-2)).sum(-1)
    out: Tensor = unary.float() + pair
    return out


def select_path(
    unary: Tensor,
    hidden: Tensor,
    anchors: Tensor,
    top_k: int,
    selector: CandidateSelector,
    choose: Chooser = greedy_choice,
) -> Tensor:
    """``[R, S]`` single paths of R blocks over their S proposal slots.

    ``unary [R, S, V]`` (:func:`unary_scores`), ``hidden [R, S, H]`` the slots' draft states,
    ``anchors [R]`` the verified anchor tokens (slot 0's predecessor; slot j's is the token
    chosen at j-1). At each slot: the top-K of the unary scores, then `choose` over the edge
    scores from the predecessor (the argmax; a sampled draft draws from their softmax, its
    distribution zero outside the candidates, as vLLM and SGLang sample at T > 0).
    """
    prev = anchors
    chosen: list[Tensor] = []
    for j in range(unary.shape[1]):
        scores, cands = unary[:, j].float().topk(top_k, dim=-1)
        edges = selector.edge_scores(scores, cands, prev, hidden[:, j])
        prev = choose(edges, cands)
        chosen.append(prev)
    return torch.stack(chosen, dim=1)


def selector_path(
    unary: Tensor,
    hidden: Tensor,
    anchor: int,
    top_k: int,
    projection: Tensor,
    predecessor: Tensor,
    successor: Tensor,
) -> list[int]:
    """The greedy path of one block: unary [B-1, V], hidden [B-1, H] (:func:`select_path`)."""
    path: list[int] = []
    prev = torch.tensor(anchor)
    for j in range(unary.shape[0]):
        scores, cands = unary[j].float().topk(top_k)
        edges = edge_scores(scores, cands, prev, hidden[j], projection, predecessor, successor)
        prev = cands[edges.argmax()]
        path.append(int(prev))
    return path


@attrs.frozen(eq=False)
class SelectorLoss:
    """The selector's objective over N positions (:func:`selector_loss`)."""

    #: ``sum_i w_i * CE_i / sum_i w_i`` (0 without weight): positions skipped for a missing gold
    #: token count in the denominator, as SpecForge normalises by DFlash's effective tokens.
    loss: Tensor
    #: Positions scored (nonzero weight) whose gold token was in the top-K (all, with inject).
    counted: Tensor
    #: Positions scored (nonzero weight).
    count: Tensor
    #: ``[N]`` bool: the position is scored and its greedy choice from the true previous token,
    #: among the unary top-K as served (never an injected token), is the gold token.
    chosen_correct: Tensor

    @property
    def correct(self) -> Tensor:
        """Positions whose greedy choice is the gold token (:attr:`chosen_correct`'s count)."""
        return self.chosen_correct.sum()


def selector_loss(
    selector: CandidateSelector,
    hidden: Tensor,
    unary: Tensor,
    prev: Tensor,
    gold: Tensor,
    weights: Tensor,
    top_k: int,
    missing: MissingGold = "skip",
) -> SelectorLoss:
    """The K-way cross-entropy of the gold token over the unary top-K, teacher-forced with the
    true previous token (reference section 4).

    ``hidden [N, H]`` draft states, ``unary [N, V]`` (:func:`unary_scores`; not
    differentiated through: the unary loss trains the backbone), ``prev``/``gold [N]`` the true
    previous and gold tokens, ``weights [N]`` the DFlash position weights (0: not scored). A
    gold token outside the top-K is skipped (``skip``: no loss, as serving can never pick it,
    and the position counts as wrong) or put in place of the last candidate (``inject``).
    """
    if missing not in ("skip", "inject"):
        msg = f"missing gold must be skip or inject, got {missing!r}"
        raise ValueError(msg)
    scores, cands = unary.detach().float().topk(top_k, dim=-1)
    hit = cands == gold.unsqueeze(-1)
    found = hit.any(-1)
    served = found  # the gold token was a candidate serving could have chosen
    if missing == "inject":
        last = torch.zeros_like(hit)
        last[:, -1] = True
        inject = (~found).unsqueeze(-1) & last
        cands = torch.where(inject, gold.unsqueeze(-1), cands)
        scores = torch.where(inject, unary.detach().float().gather(-1, gold.unsqueeze(-1)), scores)
        hit = hit | inject
        found = torch.ones_like(found)
    edges = selector.edge_scores(scores, cands, prev, hidden)
    gold_index = hit.float().argmax(-1, keepdim=True)
    ce = torch.logsumexp(edges, -1) - edges.gather(-1, gold_index).squeeze(-1)
    w = weights.float()
    used = w * found.float()
    total = w.sum()
    loss = (used * ce).sum() / total.clamp_min(torch.finfo(torch.float32).tiny)
    scored = w != 0
    choice = cands.gather(-1, edges.argmax(-1, keepdim=True)).squeeze(-1)
    chosen_correct = scored & served & (choice == gold)
    return SelectorLoss(
        loss=loss,
        counted=(scored & found).sum(),
        count=scored.sum(),
        chosen_correct=chosen_correct,
    )


def settings_of(spec: ResolvedDraft) -> DFlash2Settings:
    """The DFlash 2 settings of a resolved drafter; ValueError when the plan leaves one unset."""
    kernel, group = spec.conv_kernel_size, spec.conv_group_size
    rank, top_k = spec.selector_rank, spec.selector_top_k
    if kernel is None or group is None or rank is None or top_k is None:
        msg = (
            "a dflash2 drafter needs conv_kernel_size, conv_group_size, selector_rank and "
            "selector_top_k; compile the recipe so they are taken from the init checkpoint or "
            "set them under dflash_architecture_config"
        )
        raise ValueError(msg)
    return DFlash2Settings(
        conv_kernel_size=kernel,
        conv_group_size=group,
        selector_rank=rank,
        selector_top_k=top_k,
        output_multiplier=1.0 if spec.output_multiplier is None else spec.output_multiplier,
        final_logit_softcapping=spec.final_logit_softcapping,
        input_embedding_scale=(
            1.0 if spec.input_embedding_scale is None else spec.input_embedding_scale
        ),
    )


class SelectorHead(KindHead):
    """DFlash 2's head: the ``candidate_selector`` (registered at the drafter's top level) and
    the settings its scores read."""

    def __init__(self, spec: ResolvedDraft) -> None:
        super().__init__()
        self.settings = settings_of(spec)
        self.candidate_selector = CandidateSelector(
            spec.hidden_size, spec.vocab_size, self.settings.selector_rank
        )

    def reset_parameters(self, generator: torch.Generator | None = None) -> None:
        """The selector's initialisation (:meth:`CandidateSelector.reset_parameters`)."""
        self.candidate_selector.reset_parameters(generator)


def selector_head(head: nn.Module | None) -> SelectorHead:
    """`head` as DFlash 2's :class:`SelectorHead`; TypeError otherwise."""
    return expect_head(head, SelectorHead, "a DFlash 2 head (SelectorHead)")


def dflash2_loss(
    head: SelectorHead,
    hidden: Tensor,
    logits: Tensor,
    prev: Tensor,
    targets: ObjectiveInputs,
    objective: ObjectivePlan,
) -> LossOutput:
    """The unary loss (:func:`~dflash_recipes.executor.kinds.dflash.dflash_loss` of the unary
    scores) plus ``objective.selector_loss_alpha`` times :func:`selector_loss` (module doc).

    ``hidden [..., K, H]`` final-normed draft states, ``logits [..., K, V]`` the target head's
    float32 logits, ``prev [..., K]`` the true token before each position's label. Reports the
    selector's cross-entropy as ``parts["selector_ce"]`` and its greedy choice's per-position
    hits as ``position_correct["selector"]``.
    """
    settings = head.settings
    unary = unary_scores(logits, settings)
    labels, label_mask = targets.labels, targets.label_mask
    teacher = targets.teacher if objective.self_logit_distillation else None
    scored = without_anchor(label_mask)
    # One computation of the position weights serves both terms (D-PACE's read the vocabulary).
    position_weights = objective_weights(unary, labels, scored, objective=objective)
    unary_out = dflash_loss(
        unary,
        labels,
        label_mask,
        objective=objective,
        teacher_logits=teacher,
        weights=position_weights,
    )
    weights = torch.broadcast_to(position_weights, labels.shape) * scored
    block = labels.shape[-1]
    flat = labels.numel()
    selection = selector_loss(
        head.candidate_selector,
        hidden.reshape(flat, hidden.shape[-1]),
        unary.reshape(flat, unary.shape[-1]),
        prev.reshape(flat),
        torch.where(scored, labels, torch.zeros_like(labels)).reshape(flat),
        weights.reshape(flat),
        settings.selector_top_k,
        objective.selector_missing_gold,
    )
    hits = selection.chosen_correct.view(-1, block).sum(dim=0).long()
    return LossOutput(
        loss=unary_out.loss + objective.selector_loss_alpha * selection.loss,
        ce=unary_out.ce,
        per_position_correct=unary_out.per_position_correct,
        per_position_count=unary_out.per_position_count,
        weight_sum=unary_out.weight_sum,
        parts={**unary_out.parts, "selector_ce": selection.loss.detach()},
        position_correct={"selector": hits},
    )


class DFlash2Modules:
    """DFlash 2 (module doc)."""

    name = "dflash2"

    def build_head(self, spec: ResolvedDraft) -> KindHead | None:
        """The candidate selector (:class:`SelectorHead`)."""
        return SelectorHead(spec)

    def build_layer(self, spec: ResolvedDraft) -> DraftDecoderLayer:
        """A decoder layer with both convolutions (:class:`DFlash2DecoderLayer`)."""
        return DFlash2DecoderLayer(spec, settings_of(spec))

    def head_inputs(
        self, spec: ResolvedDraft, ids: Tensor, anchors: Tensor, embeddings: nn.Module
    ) -> tuple[Tensor, ...]:
        """The true token before each position's label, ``[B, N, K]`` (the selector's
        teacher-forced predecessor; index 1 holds the anchor)."""
        return (previous_tokens(ids, anchors, spec.block_size, shift=0),)

    def objective(
        self,
        head: nn.Module | None,
        hidden: Tensor,
        logits: Tensor,
        head_inputs: Sequence[Tensor],
        targets: ObjectiveInputs,
        objective: ObjectivePlan,
    ) -> LossOutput:
        """:func:`dflash2_loss`."""
        (prev,) = head_inputs
        return dflash2_loss(selector_head(head), hidden, logits, prev, targets, objective)

    def propose(
        self,
        head: nn.Module | None,
        hidden: Tensor,
        base_logits: Tensor,
        anchor_tokens: Sequence[int],
        spec: ResolvedDraft,
        embeddings: nn.Module,
        choose: Chooser = greedy_choice,
    ) -> Tensor:
        """The selector's path over positions ``1 .. B-1`` (:func:`select_path`), the anchor
        the first predecessor, as vLLM and SGLang draft; `choose` picks among each slot's
        top-K candidates by their edge scores."""
        selector = selector_head(head)
        first = spec.first_drafting_position
        unary = unary_scores(base_logits[:, first:], selector.settings)
        anchors = torch.tensor(list(anchor_tokens), dtype=torch.long, device=hidden.device)
        return select_path(
            unary,
            hidden[:, first:],
            anchors,
            selector.settings.selector_top_k,
            selector.candidate_selector,
            choose,
        )


MODULES = DFlash2Modules()


__all__ = [
    "MODULES",
    "CandidateSelector",
    "DFlash2DecoderLayer",
    "DFlash2Modules",
    "DFlash2Settings",
    "GroupedDynamicCausalConv",
    "MissingGold",
    "SelectorHead",
    "SelectorLoss",
    "dflash2_loss",
    "edge_scores",
    "select_path",
    "selector_loss",
    "selector_path",
    "settings_of",
    "unary_scores",
]
