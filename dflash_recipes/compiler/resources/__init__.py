"""The compile-time resource plan (docs/dflash.md, "Will it fit?"), torch-free: the estimate
(:mod:`.estimate`), what would fit a smaller device (:mod:`.fit`, loaded only when a plan does
not fit) and the text `compile` prints (:mod:`.text`)."""
