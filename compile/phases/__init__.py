"""The compile's phases, one module each, in the order compile/pipeline.py declares and runs them:
`load` (checkpoint, oracle, tokenizer), `decisions` (attention's products, the int8 plan, auto's
precision), `transform` (one pass sequence per strategy, weights lifted), `libraries` (built per
strategy, chosen, validated, timed) and `manifest` (the artifact's record)."""
