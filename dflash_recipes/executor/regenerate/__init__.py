"""`dflash-recipe regenerate`: the job, its types and its two backends (an OpenAI-compatible server,
local transformers)."""
