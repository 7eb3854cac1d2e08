"""What a plan costs (docs/dflash.md, "Will it fit?"), torch-free: the estimate (:mod:`.estimate`)
and what would fit a smaller device (:mod:`.fit`, loaded only when a plan does not fit); `compile`
reports them and `run` checks them against the real device."""
