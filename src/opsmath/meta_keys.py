"""Keys of ``node.meta`` (and of ``node.meta["custom"]``) that one pipeline stage writes and a later one
reads. They live here, below every stage, so that no stage imports a later one for a string."""

USER_REGION = "opsmath_checkpoint_region"   # meta["custom"]: an inlined checkpoint body's nodes (capture -> memory)
FP8_WEIGHT = "fp8_weight_cast"              # placeholder meta: (weight placeholder's name, "q" or "s") (patterns -> runtime)
# GraphModule meta of a block's piece: (its weight, the later pieces', the bytes it and they hand on, and
# under a byte budget the bytes kept back for the later pieces' floors) (runtime -> memory)
BLOCK_SHARE = "opsmath_block_share"
